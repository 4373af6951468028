#!/usr/bin/env bash
# Every CUDA path of mlcls in one command, for a short window on a GPU machine without network access.
#
#   make wheels                            # here, with PyPI: the wheels of the non-torch dependencies
#   bash scripts/gpu_check.sh [OUT_DIR]    # there, in the repository root; OUT_DIR defaults to gpu-report
#
# Installs mlcls and .gpu-wheels/ into a virtual environment that sees the system's torch (never
# reinstalled: --no-index, and no torch wheel in the folder), then runs each step below under its own time
# limit, all of them within GPU_CHECK_BUDGET_S (540 s). A failing step is reported and the next one runs.
# Writes OUT_DIR/report.json, OUT_DIR/report.md and OUT_DIR/gpu_check.log (every step's output); exits 1
# when a step failed. docs/performance.md ("On a GPU") lists the steps and their figures.
#
# Without CUDA it says so in one line and exits 2. GPU_CHECK_CPU=1 runs the installation and the report
# anyway, with the CUDA steps marked skipped (tests/test_gpu_check.py, so that the script cannot rot).
# Other settings: GPU_CHECK_PYTHON (python3), GPU_CHECK_WHEELS (.gpu-wheels), GPU_CHECK_VENV (.gpu-venv),
# GPU_CHECK_STEPS (a comma-separated list: only these steps, after the installation; a rerun of the failed).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out_dir=$(realpath -m "${1:-gpu-report}")
python=${GPU_CHECK_PYTHON:-python3}
wheels=$(realpath -m "${GPU_CHECK_WHEELS:-$repo/.gpu-wheels}")
venv=$(realpath -m "${GPU_CHECK_VENV:-$repo/.gpu-venv}")
budget_s=${GPU_CHECK_BUDGET_S:-540}
cpu_only=${GPU_CHECK_CPU:-0}

cuda=$("$python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null) || cuda=missing
if [[ $cuda != 1 && $cpu_only != 1 ]]; then
    if [[ $cuda == missing ]]; then
        echo "gpu_check: $python cannot import torch; run it where a CUDA build of torch is installed" >&2
    else
        echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check here" >&2
    fi
    exit 2
fi
if [[ ! -d $wheels ]]; then
    echo "gpu_check: no wheels folder $wheels; run 'make wheels' where PyPI is reachable" >&2
    exit 2
fi

cd "$repo" || exit 2
unset PYTHONPATH  # mlcls comes from the virtual environment's installation
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out_dir"
log=$out_dir/gpu_check.log
: >"$log"
start=$SECONDS
export python wheels venv

# record NAME STATUS EXIT_CODE SECONDS LIMIT FIGURES_FILE COMMAND: one line for scripts/gpu_check.py report
record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$work/steps.tsv"
}

# skip NAME REASON
skip() {
    record "$1" skipped - 0 0 - "$2"
    echo "=== $1: skipped ($2)" >>"$log"
}

# step NAME LIMIT_S FIGURES_FILE COMMAND...: COMMAND under min(LIMIT_S, what is left of the budget);
# its stdout (the figures: one JSON line) and stderr go to $work/NAME.out and NAME.err, and to the log.
step() {
    local name=$1 limit=$2 figures=$3
    shift 3
    if [[ -n ${GPU_CHECK_STEPS:-} && $name != install && ,$GPU_CHECK_STEPS, != *,$name,* ]]; then
        skip "$name" "not in GPU_CHECK_STEPS"
        return
    fi
    local left=$((budget_s - (SECONDS - start)))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        skip "$name" "out of time: ${left} s of the ${budget_s} s budget left"
        return
    fi
    echo "gpu_check: $name (at most $limit s)" >&2
    local began=$SECONDS status
    timeout --kill-after=15 "$limit" "$@" >"$work/$name.out" 2>"$work/$name.err"
    local code=$?
    case $code in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    record "$name" "$status" "$code" $((SECONDS - began)) "$limit" "$figures" "$*"
    {
        echo "=== $name: $status (exit $code, $((SECONDS - began)) s): $*"
        cat "$work/$name.out" "$work/$name.err"
    } >>"$log"
}

# The virtual environment: it sees every package $python sees (a .pth file naming $python's site
# directories, so that this works from another virtual environment too), plus the wheels and mlcls.
install() {
    set -e
    "$python" -m venv --without-pip --system-site-packages --clear "$venv"
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$python" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/gpu_check_parent.pth"
    local pip=("$venv/bin/python" -m pip)
    if ! "${pip[@]}" --version >/dev/null 2>&1; then
        local wheel=("$wheels"/pip-*.whl)
        pip=("$venv/bin/python" "${wheel[0]}/pip")  # a pip wheel runs as a zip application
    fi
    "${pip[@]}" install --no-index --find-links "$wheels" -r scripts/gpu_requirements.txt >&2
    "${pip[@]}" install --no-index --no-deps --find-links "$wheels" -r scripts/gpu_requirements_nodeps.txt >&2
    "${pip[@]}" install --no-index --no-deps --no-build-isolation -e . >&2
    "$venv/bin/python" scripts/gpu_check.py deps
    "$venv/bin/mlcls-bench" --help >/dev/null
}
export -f install

step install 120 - bash -c install
bin=$venv/bin
cuda_tests=$(grep -l "cuda.is_available" tests/test_*.py)
select_tests=("$bin/python" -m pytest -q -p no:cacheprovider -p gpu_check $cuda_tests)
resnet50=(model.name=resnet50 dataset.image_size=224 trainer.batch_size=256 trainer.amp=bf16
    trainer.channels_last=true)
if [[ $cuda != 1 ]]; then
    PYTHONPATH=scripts step cuda_tests_collected 120 - "${select_tests[@]}" --collect-only
    for name in cuda_tests bench_e2e bench_step bench_e2e_workers4 demo bench_pipeline bench_eval \
        bench_e2e_compile bench_step_compile; do
        skip $name "no CUDA"
    done
else
    # most telling first: when the budget runs out, what is skipped is what an earlier report measured.
    # The CPU suite's limits on an unmarked test (its time, its processes) do not apply: the first CUDA test
    # starts CUDA, and CUDA paths may start compile workers or DataLoader workers.
    export MLCLS_UNMARKED_LIMIT_S=inf
    PYTHONPATH=scripts step cuda_tests 180 "$work/cuda_tests.xml" "${select_tests[@]}" \
        --junitxml="$work/cuda_tests.xml"
    # the training loop fed by each loader against the same loop on device-resident batches (issue 37):
    # 512 generated 640x480 JPEGs, 32 warm-up + 20 timed steps of 256 per contender; ~60 s on an H100
    step bench_e2e 150 - "$bin/mlcls-bench" e2e "${resnet50[@]}" trainer.workers=15 \
        --backends fast,gpu,torchvision --count 512 --steps 20
    step bench_step 90 - "$bin/mlcls-bench" step "${resnet50[@]}" --repeats 5 --steps 10
    step bench_e2e_workers4 90 - "$bin/mlcls-bench" e2e "${resnet50[@]}" trainer.workers=4 \
        --backends fast,gpu --count 256 --steps 10
    step demo 120 "$work/demo/results.json" "$bin/mlcls-train" trainer.device=cuda \
        "trainer.output_dir=$work/demo"
    step bench_pipeline 90 - "$bin/mlcls-bench" pipeline --n 256 --repeats 3
    step bench_eval 60 - "$bin/mlcls-bench" eval --n 41620 --c 9605
    step bench_e2e_compile 180 - "$bin/mlcls-bench" e2e "${resnet50[@]}" trainer.workers=15 \
        trainer.compile=true --backends fast,gpu --count 256 --steps 10
    step bench_step_compile 240 - "$bin/mlcls-bench" step "${resnet50[@]}" trainer.compile=true \
        --repeats 3 --steps 10
    for name in bench_e2e bench_e2e_workers4 bench_e2e_compile; do  # the JSON lines beside the report
        [[ -s $work/$name.out ]] && tail -n 1 "$work/$name.out" >"$out_dir/$name.json"
    done
fi

report_python=$bin/python
[[ -x $report_python ]] || report_python=$python
flags=()
[[ $cuda != 1 ]] && flags=(--cpu-only)
"$report_python" scripts/gpu_check.py report --steps "$work/steps.tsv" --out "$out_dir" "${flags[@]}"
