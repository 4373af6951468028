"""scripts/gpu_check.sh on the CPU, so that it cannot rot between GPU windows: the one-line refusal without
CUDA, the installation into a virtual environment with the report (CUDA steps skipped), and the report
that scripts/gpu_check.py writes from recorded steps (figures, test outcomes, failures)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
CUDA_STEPS = {
    "cuda_tests",
    "bench_step",
    "bench_e2e",
    "bench_pipeline",
    "demo",
    "bench_eval",
    "bench_e2e_workers4",
    "bench_step_compile",
    "bench_e2e_compile",
}
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
    assert {name for name, step in steps.items() if step["status"] == "skipped"} == CUDA_STEPS
    markdown = (out / "report.md").read_text()
    assert all(f"| {name} | {step['status']} |" in markdown for name, step in steps.items())
    assert "=== install: ok" in (out / "gpu_check.log").read_text()
    assert sorted(path.name for path in out.iterdir()) == ["gpu_check.log", "report.json", "report.md"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_ema" name="test_update" time="0.2" />
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
