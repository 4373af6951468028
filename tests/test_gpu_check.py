"""scripts/gpu_check.sh on the CPU, so that it cannot rot between GPU windows: the one-line refusal without
CUDA, the installation into a virtual environment with the report (CUDA steps skipped), the steps it would
run on a GPU (a dry run: their order and limits, every command's options and overrides read as mlcls reads
them), the JPEGs it generates as dataset=csv reads them, and the report that scripts/gpu_check.py writes
from recorded steps (figures, test outcomes, failures, the contenders, training against the bench)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from omegaconf import OmegaConf
from packaging.requirements import Requirement
from PIL import Image

from mlcls.cli.bench import build_parser
from mlcls.data.datasets.csv_dataset import CSVDataset

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
# Issue 49's steps, in their order, then an earlier report's, run only when GPU_CHECK_STEPS names them.
ISSUE_STEPS = ["cuda_tests", "jpegs", "bench_e2e", "bench_e2e_workers4", "train_gpu", "bench_e2e_compile"]
EARLIER_STEPS = ["bench_step", "demo", "bench_pipeline", "bench_eval", "bench_step_compile"]
BUDGET_S = 570
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU does")


def _load_helper():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_helper()


def _run_script(out_dir: Path, cwd: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, **settings}
    command = ["bash", str(SCRIPT), str(out_dir)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _cuda_guarded_tests() -> list[str]:
    """The tests under ``skipif(not torch.cuda.is_available(), ...)``, found in the sources."""
    guarded = re.compile(
        r"@pytest\.mark\.skipif\(\s*not torch\.cuda\.is_available\(\).*\n(?:@.*\n)*def (\w+)"
    )
    return [
        f"tests/{path.name}::{name}"
        for path in sorted((REPO / "tests").glob("test_*.py"))
        for name in guarded.findall(path.read_text())
    ]


@pytest.mark.slow
@NO_GPU
@pytest.mark.parametrize(
    "python, line",
    [
        (sys.executable, "no CUDA device (torch.cuda.is_available() is False); nothing to check here"),
        ("false", "false cannot import torch; run it where a CUDA build of torch is installed"),
    ],
    ids=["torch without CUDA", "no torch"],
)
def test_refuses_in_one_line_without_cuda(tmp_path, python, line):
    done = _run_script(tmp_path / "report", tmp_path, GPU_CHECK_PYTHON=python)
    assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [f"gpu_check: {line}"])
    assert not (tmp_path / "report").exists()


@pytest.mark.slow
@NO_GPU
def test_installs_and_reports_on_the_cpu_with_the_cuda_steps_skipped(tmp_path):
    wheels, venv, out = tmp_path / "wheels", tmp_path / "venv", tmp_path / "report"
    wheels.mkdir()  # an empty folder: every dependency is already importable by this Python
    done = _run_script(
        out, tmp_path, GPU_CHECK_CPU="1", GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_VENV=str(venv)
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    steps = {step["name"]: step for step in report["steps"]}
    assert (report["status"], report["cpu_only"], report["environment"]["torch"]) == (
        "ok",
        True,
        torch.__version__,
    )

    install = steps["install"]
    assert install["status"] == "ok" and install["figures"]["missing"] == []
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert set(install["figures"]["present"]) == {Requirement(line).name for line in project["dependencies"]}
    assert install["figures"]["present"]["torch"] == metadata.version("torch")
    # mlcls is installed in the environment, from this repository: found from elsewhere, without PYTHONPATH.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    where = [str(venv / "bin" / "python"), "-c", "import mlcls; print(mlcls.__file__)"]
    located = subprocess.run(where, cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert Path(located.stdout.strip()) == REPO / "mlcls" / "__init__.py"
    # the environment's console script: the install step ends with `mlcls-bench --help` (its status is the
    # step's), run without PYTHONPATH; it is the environment's own, not one found on the PATH
    install_function = SCRIPT.read_text().split("\ninstall() {\n")[1].split("\n}\n")[0]
    assert install_function.rstrip().endswith('"$venv/bin/mlcls-bench" --help >/dev/null')
    assert (venv / "bin" / "mlcls-bench").read_text().startswith(f"#!{venv / 'bin' / 'python'}")

    selected = steps["cuda_tests_collected"]["figures"]["selected_tests"]
    assert sorted({test_id.split("[")[0] for test_id in selected}) == sorted(_cuda_guarded_tests())
    assert {name for name, step in steps.items() if step["status"] == "skipped"} == {
        *ISSUE_STEPS,
        *EARLIER_STEPS,
    }
    assert {steps[name]["command"] for name in ISSUE_STEPS} == {"no CUDA"}
    markdown = (out / "report.md").read_text()
    assert all(f"| {name} | {step['status']} |" in markdown for name, step in steps.items())
    assert "=== install: ok" in (out / "gpu_check.log").read_text()
    assert sorted(path.name for path in out.iterdir()) == ["gpu_check.log", "report.json", "report.md"]


@pytest.mark.slow  # a bash process (0.1 s)
def test_a_dry_run_lists_issue_49s_checks_as_they_would_run(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_PYTHON": "false"}  # needs no torch nor CUDA
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "report")], env=env, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    assert not (tmp_path / "report").exists()
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    assert [row[0] for row in rows] == ["install", *ISSUE_STEPS, *EARLIER_STEPS]
    planned = {
        name: (int(limit), shlex.split(command)) for name, limit, command in rows[: -len(EARLIER_STEPS)]
    }
    assert all(row[1:] == ["skipped", "an earlier report's step: name it in GPU_CHECK_STEPS to run it"]
               for row in rows[1 + len(ISSUE_STEPS):])  # fmt: skip
    assert all(10 <= limit <= BUDGET_S for limit, _ in planned.values())  # each under its own time limit

    jpegs = planned["jpegs"][1]
    assert jpegs[1:3] == ["scripts/gpu_check.py", "jpegs"]
    options = dict(zip(jpegs[3::2], jpegs[4::2], strict=True))
    assert int(options["--train"]) >= 8000 and options["--size"] == "640x480"
    folder = options["--out"]
    resnet50 = {"model.name": "resnet50", "dataset.image_size": 224, "trainer.batch_size": 256,
                "trainer.amp": "bf16", "trainer.channels_last": True}  # fmt: skip
    e2e_runs = {"bench_e2e": (15, False), "bench_e2e_workers4": (4, False), "bench_e2e_compile": (15, True)}
    for name, (workers, compiled) in e2e_runs.items():
        command = planned[name][1]
        assert command[0].endswith("/bin/mlcls-bench") and command[1] == "e2e"
        args = build_parser(["e2e"]).parse_args(command[1:])
        cfg = compose_config(args.overrides)
        settings = {key: OmegaConf.select(cfg, key) for key in resnet50}
        assert settings == resnet50 and (cfg.trainer.workers, cfg.trainer.compile) == (workers, compiled)
        assert args.images == f"{folder}/train" and (args.steps, args.warmup) == (100, None)  # the rule's
        assert args.backends == ("gpu" if compiled else "gpu,fast,shards")
    train = planned["train_gpu"][1]
    assert train[0].endswith("/bin/mlcls-train")
    cfg = compose_config(train[1:])
    assert {key: OmegaConf.select(cfg, key) for key in resnet50} == resnet50 and cfg.model.pretrained is False
    assert (cfg.dataset.name, cfg.dataset.root, cfg.data.backend) == ("csv", folder, "gpu")
    assert (cfg.dataset.train_file, cfg.dataset.val_file) == ("train.csv", "val.csv")
    assert (cfg.trainer.workers, cfg.trainer.epochs, cfg.trainer.device) == (15, 3, "cuda")


def test_the_generated_jpegs_are_a_csv_dataset_with_every_class(tmp_path):
    assert gpu_check.main(["jpegs", "--out", str(tmp_path), "--train", "5", "--val", "2", "--size", "40x30",
                           "--classes", "3"]) == 0  # fmt: skip
    for split, count in (("train", 5), ("val", 2)):
        dataset = CSVDataset(split, root=str(tmp_path), val_file="val.csv", classes=["c00", "c01", "c02"])
        assert len(dataset) == count
        for k in range(count):
            path = tmp_path / split / f"{k:05d}.jpg"
            with Image.open(path) as image:
                assert (image.format, image.size) == ("JPEG", (40, 30))
            assert dataset.samples[k].path == str(path)
            assert dataset.labels[k, k % 3] == 1  # class k mod 3, at least
        if split == "train":
            assert dataset.labels.sum(0).min() >= 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train", "train.csv", "val", "val.csv"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_engine_ema" name="test_update" time="0.2" />
<testcase classname="tests.test_metrics" name="test_ap" time="0.1">
<failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="tests.test_data_dali" name="test_loader" time="0.0">
<skipped type="pytest.skip" message="could not import 'nvidia.dali'">skip</skipped></testcase>
</testsuite></testsuites>"""


@pytest.mark.slow
def test_report_gathers_every_figure_and_the_end_of_each_failure(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "cuda_tests.xml").write_text(JUNIT)
    (work / "cuda_tests.out").write_text('{"selected_tests": ["a", "b", "c"]}\n3 tests, 1 failed\n')
    (work / "bench_step.out").write_text('resnet50\n{"trainer_images_per_s": 2500.5, "overhead": 0.012}\n')
    (work / "demo.out").write_text("{not json\n")
    (work / "demo.err").write_text(
        "".join(f"line {k}\n" for k in range(30)) + "RuntimeError: out of memory\n"
    )
    rows = [
        ("cuda_tests", "failed", "1", "41", "120", str(work / "cuda_tests.xml"), "pytest -p gpu_check"),
        ("bench_step", "ok", "0", "35", "90", "-", "mlcls-bench step model.name=resnet50"),
        ("demo", "timeout", "124", "120", "120", str(work / "demo" / "results.json"), "mlcls-train"),
        ("bench_eval", "skipped", "-", "0", "0", "-", "out of time"),
    ]
    (work / "steps.tsv").write_text("".join("\t".join(row) + "\n" for row in rows))

    report = gpu_check.write_report(work / "steps.tsv", out, cpu_only=False)

    assert json.loads((out / "report.json").read_text()) == report
    assert report["status"] == "failed: cuda_tests, demo" and report["seconds"] == 41 + 35 + 120
    tests, bench, demo, skipped = report["steps"]
    assert {key: tests["figures"][key] for key in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1,
        "failed": 1,
        "errors": 0,
        "skipped": 1,
    }
    assert tests["figures"]["selected_tests"] == ["a", "b", "c"]
    assert (
        tests["figures"]["tests"]["tests.test_data_dali::test_loader"]
        == "skipped: could not import 'nvidia.dali'"
    )
    assert (
        bench["figures"] == {"trainer_images_per_s": 2500.5, "overhead": 0.012} and "stderr_tail" not in bench
    )
    assert (demo["exit_code"], demo["figures"]) == (124, {})
    assert demo["stderr_tail"].splitlines() == [f"line {k}" for k in range(16, 30)] + [
        "RuntimeError: out of memory"
    ]
    assert (skipped["status"], skipped["exit_code"]) == ("skipped", None)
    markdown = (out / "report.md").read_text()
    assert "| bench_step | ok | 35 (90) | trainer_images_per_s=2500, overhead=0.012 |" in markdown
    assert (
        "| cuda_tests | failed | 41 (120) | selected_tests: 3, passed=1, failed=1, errors=0, skipped=1 |"
        in markdown
    )
    assert "## demo: timeout" in markdown and "RuntimeError: out of memory" in markdown
    assert sorted(path.name for path in out.iterdir()) == ["report.json", "report.md"]


@pytest.mark.slow  # as the test above: the report reads the environment (nvidia-smi)
def test_report_sets_the_training_runs_steady_state_beside_the_bench_and_tables_the_contenders(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "train").mkdir(parents=True)
    # epochs of 500 (the first: workers starting, cuDNN autotuning), 900 and 1,100 images/s: 1,000 after it
    history = [{"epoch": k + 1, "loss": 1.0, "images_per_s": rate} for k, rate in enumerate([500, 900, 1100])]
    (work / "train" / "results.json").write_text(json.dumps({"history": history, "epochs_completed": 3}))
    reference = {"images_per_s": 1250.0, "share": 1.0, "steps": 100, "buffer_batches": 0}
    gpu = {"images_per_s": 962.5, "share": 0.77, "steps": 100, "buffer_batches": 60}
    for figures, host_ms, idle in ((reference, 0.5, 0.01), (gpu, 3.25, 0.2)):
        figures |= {"warmup_steps": 62, "host_ms_per_batch": host_ms, "step_host_ms_per_batch": 20.0}
        figures |= {"gpu_idle_share": idle, "reserved_mib": 9000.0, "input_reserved_mib": None}
    gpu |= {
        "input_reserved_mib": 1500.0,
        "input_alone_reserved_mib": 1400.0,
        "input_alone_allocated_mib": 700.0,
    }
    bench = {"gpu_only_images_per_s": 1250.0, "gpu_images_per_s": 962.5, "gpu_share": 0.77}
    bench |= {"gpu_input_bound_mib": 1450.0}
    bench |= {
        "contenders": {"gpu_only": reference, "gpu": gpu},
        "steady_state": True,
        "steady_state_note": None,
    }
    bench |= {"warmup_steps": 62, "steps": 100, "batch_size": 256, "workers": 15, "prefetch_factor": 4}
    (work / "bench_e2e.out").write_text("generated 8192 JPEGs\n" + json.dumps(bench) + "\n")
    rows = [
        ("bench_e2e", "ok", "0", "120", "170", "-", "mlcls-bench e2e"),
        ("train_gpu", "ok", "0", "60", "120", str(work / "train" / "results.json"), "mlcls-train"),
    ]
    (work / "steps.tsv").write_text("".join("\t".join(row) + "\n" for row in rows))

    report = gpu_check.write_report(work / "steps.tsv", out, cpu_only=False)

    train = report["steps"][1]["figures"]
    assert train["epoch_images_per_s"] == [500, 900, 1100] and train["steady_images_per_s"] == 1000
    assert report["train_against_bench"] == {
        "train_steady_images_per_s": 1000,
        "bench_gpu_only_images_per_s": 1250.0,
        "train_share": 0.8,
        "bench_gpu_share": 0.77,
        "difference": pytest.approx(0.03),
    }
    markdown = (out / "report.md").read_text()
    assert (
        "| bench_e2e | ok | 120 (170) | gpu_only_images_per_s=1250, gpu_images_per_s=962.5, gpu_share=0.77, "
        "steady_state=True |"
    ) in markdown
    assert (
        "`train_gpu` in steady state (epochs after the first): 1,000.0 images/s, 0.800 of `bench_e2e`'s "
        "GPU-only 1,250.0; the bench's `gpu` share 0.770; difference +0.030 (target: within 0.03)."
    ) in markdown
    table = markdown.split("## bench_e2e: contenders\n\n")[1].splitlines()
    assert table[0] == "62 warm-up + 100 timed steps of 256, 15 workers x 4 batches buffered (steady state)"
    assert table[4:6] == [
        "| gpu_only | 1,250.0 | 1.000 | 100 | 0 | 0.50 | 20.00 | 0.010 | 9,000 | n/a | n/a | n/a |",
        "| gpu | 962.5 | 0.770 | 100 | 60 | 3.25 | 20.00 | 0.200 | 9,000 | 1,500 | 1,400 | 700 |",
    ]
    assert (
        "`gpu`'s input stage: 1,400 MiB reserved alone, 1,500 MiB added to the step's; its bound "
        "(`input_stage_bytes`) 1,450 MiB: **over it**."
    ) in markdown


def test_report_rejects_a_malformed_steps_file(tmp_path):
    (tmp_path / "steps.tsv").write_text("install\tok\t0\n")
    with pytest.raises(ValueError, match=r"'install\\tok\\t0' has 3 fields; expected 7"):
        gpu_check.write_report(tmp_path / "steps.tsv", tmp_path / "out", cpu_only=True)


def test_deps_names_what_is_missing_or_too_old(monkeypatch, capsys):
    installed = metadata.version

    def version(name: str) -> str:
        if name == "simplejpeg":
            raise metadata.PackageNotFoundError(name)
        return "2.0" if name == "torch" else installed(name)

    monkeypatch.setattr(metadata, "version", version)
    assert gpu_check.main(["deps"]) == 1
    found = json.loads(capsys.readouterr().out)
    torch_line, simplejpeg_line = (
        next(line for line in metadata.requires("mlcls") if line.startswith(name))
        for name in ("torch", "simplejpeg")
    )
    assert found["missing"] == [
        f"{Requirement(torch_line)} (installed: 2.0)",
        str(Requirement(simplejpeg_line)),
    ]
    assert "torch" not in found["present"] and found["present"]["numpy"] == installed("numpy")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="reads the driver where there is none")
def test_environment_without_a_driver_names_torch_and_no_gpu():
    env = gpu_check.environment()
    assert (env["torch"], env["torch_cuda"], env["driver"]) == (torch.__version__, torch.version.cuda, None)
    assert env["cuda_available"] is torch.cuda.is_available()
