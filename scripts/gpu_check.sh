#!/usr/bin/env bash
# Every CUDA path of mlcls in one command, for a short window on a GPU machine without network access.
#
#   make wheels                            # here, with PyPI: the wheels of the non-torch dependencies
#   bash scripts/gpu_check.sh [OUT_DIR]    # there, in the repository root; OUT_DIR defaults to gpu-report
#
# Installs mlcls and .gpu-wheels/ into a virtual environment that sees the system's torch (never
# reinstalled: --no-index, and no torch wheel in the folder), then runs each step below under its own time
# limit, all of them within GPU_CHECK_BUDGET_S (570 s: with a machine's start, a 15-minute window). A
# failing step is reported and the next one runs. Writes OUT_DIR/report.json, OUT_DIR/report.md,
# OUT_DIR/gpu_check.log (every step's output) and each bench's and the training run's figures beside them
# (at most 8 small files); exits 1 when a step failed. docs/performance.md ("On a GPU") lists the steps.
#
# Without CUDA it says so in one line and exits 2. GPU_CHECK_CPU=1 runs the installation and the report
# anyway, with the CUDA steps marked skipped (tests/test_gpu_check.py, so that the script cannot rot);
# GPU_CHECK_DRY_RUN=1 runs nothing and prints each step as it would run: name, time limit (or "skipped")
# and command, tab-separated, the command quoted for the shell.
# Other settings: GPU_CHECK_PYTHON (python3), GPU_CHECK_WHEELS (.gpu-wheels), GPU_CHECK_VENV (.gpu-venv),
# GPU_CHECK_STEPS (a comma-separated list: only these steps, after the installation; a rerun of the failed,
# or an earlier report's step, which runs only when named).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out_dir=$(realpath -m "${1:-gpu-report}")
python=${GPU_CHECK_PYTHON:-python3}
wheels=$(realpath -m "${GPU_CHECK_WHEELS:-$repo/.gpu-wheels}")
venv=$(realpath -m "${GPU_CHECK_VENV:-$repo/.gpu-venv}")
budget_s=${GPU_CHECK_BUDGET_S:-570}
cpu_only=${GPU_CHECK_CPU:-0}
dry_run=${GPU_CHECK_DRY_RUN:-0}
# Steps of earlier reports (their figures are in docs/performance.md): run only when GPU_CHECK_STEPS names them.
earlier_steps=,bench_step,demo,bench_pipeline,bench_eval,bench_step_compile,

if [[ $dry_run == 1 ]]; then
    cuda=1
else
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
fi

cd "$repo" || exit 2
unset PYTHONPATH  # mlcls comes from the virtual environment's installation
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log=$work/gpu_check.log
if [[ $dry_run != 1 ]]; then
    mkdir -p "$out_dir"
    log=$out_dir/gpu_check.log
fi
: >"$log"
start=$SECONDS
cuda_part=0  # set once the steps that need CUDA begin
export python wheels venv

# record NAME STATUS EXIT_CODE SECONDS LIMIT FIGURES_FILE COMMAND: one line for scripts/gpu_check.py report
record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$work/steps.tsv"
}

# skip NAME REASON
skip() {
    if [[ $dry_run == 1 ]]; then
        printf '%s\tskipped\t%s\n' "$1" "$2"
        return
    fi
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
    if [[ $earlier_steps == *,$name,* && ,${GPU_CHECK_STEPS:-}, != *,$name,* ]]; then
        skip "$name" "an earlier report's step: name it in GPU_CHECK_STEPS to run it"
        return
    fi
    if [[ $cuda_part == 1 && $cuda != 1 ]]; then
        skip "$name" "no CUDA"
        return
    fi
    local left=$((budget_s - (SECONDS - start)))
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        skip "$name" "out of time: ${left} s of the ${budget_s} s budget left"
        return
    fi
    if [[ $dry_run == 1 ]]; then
        printf '%s\t%s\t' "$name" "$limit"
        printf '%q ' "$@"
        echo
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
if [[ $cuda != 1 ]]; then
    PYTHONPATH=scripts step cuda_tests_collected 120 - "${select_tests[@]}" --collect-only
fi

# Issue 49's checks, most telling first; when the budget runs out, what is skipped comes last. The model of
# docs/performance.md's GPU figures; >= 8,000 generated JPEGs of 640x480 (train/, val/, with CSV files
# for dataset=csv), read by every bench and by the training run.
cuda_part=1
resnet50=(model.name=resnet50 dataset.image_size=224 trainer.batch_size=256 trainer.amp=bf16
    trainer.channels_last=true)
jpegs=$work/jpegs
e2e=("$bin/mlcls-bench" e2e "${resnet50[@]}")
contenders=(--backends gpu,fast,shards --images "$jpegs/train")  # beside gpu_only, which every e2e run has
# The CPU suite's limits on an unmarked test (its time, its processes) do not apply: the first CUDA test
# starts CUDA, and CUDA paths may start compile workers or DataLoader workers.
export MLCLS_UNMARKED_LIMIT_S=inf
PYTHONPATH=scripts step cuda_tests 150 "$work/cuda_tests.xml" "${select_tests[@]}" \
    --junitxml="$work/cuda_tests.xml"
step jpegs 90 - "$bin/python" scripts/gpu_check.py jpegs --out "$jpegs" --train 8192 --val 512 --size 640x480
# each contender in steady state: 15 workers x 4 + 2 warm-up steps (4 workers: 18), then 100 timed steps
step bench_e2e 170 - "${e2e[@]}" trainer.workers=15 "${contenders[@]}"
step bench_e2e_workers4 170 - "${e2e[@]}" trainer.workers=4 "${contenders[@]}"
# the training run the bench must predict: its epochs after the first against bench_e2e's shares
step train_gpu 120 "$work/train/results.json" "$bin/mlcls-train" "${resnet50[@]}" model.pretrained=false \
    dataset=csv "dataset.root=$jpegs" dataset.train_file=train.csv dataset.val_file=val.csv \
    data.backend=gpu trainer.workers=15 trainer.epochs=3 trainer.device=cuda trainer.report=false \
    "hydra.run.dir=$work/train"
# last, with what the budget leaves: compiling takes a minute or more
step bench_e2e_compile 300 - "${e2e[@]}" trainer.workers=15 trainer.compile=true --backends gpu \
    --images "$jpegs/train"

# Earlier reports' steps (GPU_CHECK_STEPS names them).
step bench_step 90 - "$bin/mlcls-bench" step "${resnet50[@]}" --repeats 5 --steps 10
step demo 120 "$work/demo/results.json" "$bin/mlcls-train" trainer.device=cuda "hydra.run.dir=$work/demo"
step bench_pipeline 90 - "$bin/mlcls-bench" pipeline --n 256 --repeats 3
step bench_eval 60 - "$bin/mlcls-bench" eval --n 41620 --c 9605
step bench_step_compile 240 - "$bin/mlcls-bench" step "${resnet50[@]}" trainer.compile=true --repeats 3 \
    --steps 10
[[ $dry_run == 1 ]] && exit 0

for name in bench_e2e bench_e2e_workers4 bench_e2e_compile; do  # the JSON lines beside the report
    [[ -s $work/$name.out ]] && tail -n 1 "$work/$name.out" >"$out_dir/$name.json"
done
[[ -s $work/train/results.json ]] && cp "$work/train/results.json" "$out_dir/train_gpu.json"

report_python=$bin/python
[[ -x $report_python ]] || report_python=$python
flags=()
[[ $cuda != 1 ]] && flags=(--cpu-only)
"$report_python" scripts/gpu_check.py report --steps "$work/steps.tsv" --out "$out_dir" "${flags[@]}"
