"""The Python half of scripts/gpu_check.sh: the dependency check, the choice of CUDA tests, the report.

``python scripts/gpu_check.py deps``
    every run-time requirement of the installed mlcls (extras left out) against what is installed; prints
    one JSON line ``{"present": {name: version}, "missing": [requirement, ...]}``; exit 1 if any is missing.
``python scripts/gpu_check.py jpegs --out DIR [--train 8192] [--val 512] [--size 640x480] [--classes 20]``
    generated JPEGs (mlcls's benchmark generator) in DIR/train and DIR/val, listed with labels in
    DIR/train.csv and DIR/val.csv for ``dataset=csv``; prints one JSON line of counts.
``python scripts/gpu_check.py report --steps STEPS.tsv --out OUT_DIR [--cpu-only]``
    report.json and report.md in OUT_DIR from the steps the shell script ran (one tab-separated line each:
    name, status, exit code, seconds, time limit, figures file, command): each step's figures, the
    contenders of each ``mlcls-bench e2e`` step, and the training run's steady state beside the bench's.
``pytest -p gpu_check`` (with scripts/ on PYTHONPATH)
    keeps the CUDA tests only: those with a ``skipif`` whose reason says "needs CUDA", e.g.
    ``@pytest.mark.skipif(not torch.cuda.is_available(), reason="the DALI loader needs CUDA")``. Prints
    their ids first, as one JSON line ``{"selected_tests": [...]}``.

Only the standard library at module level: the report is written even when the installation failed (then
without the contenders' tables, which mlcls renders).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

STEP_FIELDS = ("name", "status", "exit_code", "seconds", "limit_s", "figures_file", "command")
# Figures shown in report.md (report.json keeps every figure of every step).
HEADLINE_SUFFIXES = ("_per_s", "_s", "_share", "overhead")
HEADLINE_KEYS = ("passed", "failed", "errors", "skipped", "missing", "steady_state")
# The training run the bench must predict, and the bench it is compared with (same workers, same JPEGs).
TRAIN_STEP, BENCH_STEP = "train_gpu", "bench_e2e"


def is_cuda_test(item: Any) -> bool:
    """Whether a pytest item has a ``skipif`` whose reason says "needs CUDA"."""
    return any("needs CUDA" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Keep the CUDA tests only (a pytest hook: ``-p gpu_check``); the others are deselected."""
    selected = [item for item in items if is_cuda_test(item)]
    deselected = [item for item in items if not is_cuda_test(item)]
    config.hook.pytest_deselected(items=deselected)
    items[:] = selected
    print(json.dumps({"selected_tests": [item.nodeid for item in selected]}), flush=True)


def check_requirements(distribution: str = "mlcls") -> dict[str, Any]:
    """``{"present": {name: version}, "missing": [requirement, ...]}`` for the run-time requirements of
    ``distribution`` (those without an ``extra`` marker), read from its installed metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement

    present: dict[str, str] = {}
    missing: list[str] = []
    for line in metadata.requires(distribution) or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(str(requirement))
            continue
        if requirement.specifier.contains(version, prereleases=True):
            present[requirement.name] = version
        else:
            missing.append(f"{requirement} (installed: {version})")
    return {"present": present, "missing": missing}


def last_json_line(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object (what mlcls-bench prints), else ``{}``."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return {}


def junit_figures(path: Path) -> dict[str, Any]:
    """Counts and each test's outcome (``passed``, ``failed``, ``error``, ``skipped: <reason>``) of a
    pytest JUnit XML file."""
    outcomes: dict[str, str] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = f"skipped: {child.get('message', '')}"
        outcomes[name] = outcome
    labels = {"passed": "passed", "failed": "failed", "errors": "error", "skipped": "skipped"}
    kinds = [outcome.split(":")[0] for outcome in outcomes.values()]
    counts = {key: kinds.count(label) for key, label in labels.items()}
    return {**counts, "tests": outcomes}


def run_figures(path: Path) -> dict[str, Any]:
    """The headline of a run's results.json: last metrics, best, epochs, wall time and throughput, each
    epoch's images/s and, from two epochs on, the steady state: the mean of the epochs after the first."""
    results = json.loads(path.read_text())
    provenance = results.get("provenance", {})
    rates = [record["images_per_s"] for record in results.get("history", []) if "images_per_s" in record]
    return {
        "metrics": results.get("metrics", {}),
        "best": results.get("best"),
        "epochs_completed": results.get("epochs_completed"),
        **{key: value for key, value in provenance.items() if key.endswith(("_s", "_per_s", "gpu"))},
        "epoch_images_per_s": rates,
        **({"steady_images_per_s": statistics.fmean(rates[1:])} if len(rates) > 1 else {}),
    }


def train_against_bench(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The training run's steady-state rate as a share of the bench's GPU-only rate, beside the bench's
    ``gpu`` share and their difference (issue 49: within 0.03); None unless both steps gave their figures."""
    figures = {step["name"]: step["figures"] for step in steps}
    train, bench = figures.get(TRAIN_STEP, {}), figures.get(BENCH_STEP, {})
    if "steady_images_per_s" not in train or not {"gpu_only_images_per_s", "gpu_share"} <= bench.keys():
        return None
    share = train["steady_images_per_s"] / bench["gpu_only_images_per_s"]
    return {
        "train_steady_images_per_s": train["steady_images_per_s"],
        "bench_gpu_only_images_per_s": bench["gpu_only_images_per_s"],
        "train_share": share,
        "bench_gpu_share": bench["gpu_share"],
        "difference": share - bench["gpu_share"],
    }


def step_figures(figures_file: str, stdout_file: Path) -> dict[str, Any]:
    """A step's figures: the last JSON line of its stdout, merged with its figures file (JUnit XML or a
    run's results.json) when it has one."""
    figures = last_json_line(stdout_file.read_text(errors="replace")) if stdout_file.is_file() else {}
    path = Path(figures_file) if figures_file not in ("", "-") else None
    if path is not None and path.is_file():
        try:
            figures.update(junit_figures(path) if path.suffix == ".xml" else run_figures(path))
        except (ElementTree.ParseError, json.JSONDecodeError, OSError) as exc:
            figures["figures_error"] = f"{path.name}: {exc}"
    return figures


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def read_steps(steps_file: Path) -> list[dict[str, Any]]:
    """The steps the shell script recorded, with their figures and, unless they passed, their stderr's end."""
    steps = []
    for line in steps_file.read_text().splitlines():
        values = line.split("\t", len(STEP_FIELDS) - 1)
        if len(values) != len(STEP_FIELDS):
            raise ValueError(f"{steps_file}: {line!r} has {len(values)} fields; expected {len(STEP_FIELDS)}")
        step: dict[str, Any] = dict(zip(STEP_FIELDS, values, strict=True))
        for key in ("exit_code", "seconds", "limit_s"):
            step[key] = int(step[key]) if step[key].lstrip("-").isdigit() else None
        logs = steps_file.parent / step["name"]
        step["figures"] = step_figures(step.pop("figures_file"), logs.with_suffix(".out"))
        if step["status"] not in ("ok", "skipped"):
            step["stderr_tail"] = tail(logs.with_suffix(".err"))
        steps.append(step)
    return steps


def environment() -> dict[str, Any]:
    """Python, torch, CUDA, cuDNN, the GPU and the NVIDIA driver, as far as they can be read."""
    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.platform()}
    env["cpus"] = os.cpu_count()
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        env["cuda_available"] = torch.cuda.is_available()
        if env["cuda_available"]:
            properties = torch.cuda.get_device_properties(0)
            env["gpu"] = properties.name
            env["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
            env["gpu_count"] = torch.cuda.device_count()
    except (ImportError, OSError, RuntimeError) as exc:  # no torch, or a broken CUDA installation
        env["torch"] = f"not importable: {exc}"
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
        env["driver"] = driver.splitlines()[0] if driver else None
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = None
    return env


def headline(figures: dict[str, Any]) -> str:
    """The figures of one step worth a glance, ``key=value`` separated by commas."""
    shown = []
    for key, value in figures.items():
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in HEADLINE_KEYS or (numeric and (key.endswith(HEADLINE_SUFFIXES) or "peak" in key)):
            shown.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
        elif isinstance(value, list):  # e.g. the ids of the selected tests
            shown.append(f"{key}: {len(value)}")
        elif key == "metrics" and isinstance(value, dict):
            shown.extend(f"{k}={v:.4g}" for k, v in value.items() if isinstance(v, float))
    return ", ".join(shown)


def render_markdown(report: dict[str, Any]) -> str:
    """report.md: the environment, one table row per step, the end of each failed step's stderr."""
    env = report["environment"]
    lines = [
        "# mlcls GPU check",
        "",
        f"{env.get('gpu', 'no GPU')} ({env.get('gpu_memory_gib', '-')} GiB), driver {env.get('driver')}, "
        f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')}), "
        f"Python {env.get('python')}, {env.get('cpus')} CPUs.",
        "",
        f"Overall: **{report['status']}**, {report['seconds']} s.",
        "",
        "| step | status | s (limit) | figures |",
        "|---|---|---|---|",
    ]
    for step in report["steps"]:
        lines.append(
            f"| {step['name']} | {step['status']} | {step['seconds']} ({step['limit_s']}) "
            f"| {headline(step['figures']).replace('|', '/')} |"
        )
    compared = report.get("train_against_bench")
    if compared is not None:
        lines += [
            "",
            f"`{TRAIN_STEP}` in steady state (epochs after the first): "
            f"{compared['train_steady_images_per_s']:,.1f} images/s, "
            f"{compared['train_share']:.3f} of `{BENCH_STEP}`'s GPU-only "
            f"{compared['bench_gpu_only_images_per_s']:,.1f}; the bench's `gpu` share "
            f"{compared['bench_gpu_share']:.3f}; difference {compared['difference']:+.3f} "
            "(target: within 0.03).",
        ]
    benches = [step for step in report["steps"] if "contenders" in step["figures"]]
    table = contender_renderer() if benches else None
    for step in benches if table is not None else []:
        lines += ["", f"## {step['name']}: contenders", "", table(step["figures"])]
        lines += memory_against_bound(step["figures"])
    for step in report["steps"]:
        if step.get("stderr_tail"):
            lines += ["", f"## {step['name']}: {step['status']}", "", "`" + step["command"] + "`", ""]
            lines += ["```", step["stderr_tail"], "```"]
    return "\n".join(lines) + "\n"


def memory_against_bound(figures: dict[str, Any]) -> list[str]:
    """The ``gpu`` contender's input-stage memory (reserved alone, and added to the step's) beside the bound
    the bench states (``gpu_input_bound_mib``, ``input_stage_bytes``), as lines of report.md; none where the
    bench measured neither."""
    bound, gpu = figures.get("gpu_input_bound_mib"), figures["contenders"].get("gpu", {})
    alone, added = gpu.get("input_alone_reserved_mib"), gpu.get("input_reserved_mib")
    if not all(isinstance(value, (int, float)) for value in (bound, alone, added)):
        return []
    verdict = "within it" if max(alone, added) <= bound else "**over it**"
    return [
        "",
        f"`gpu`'s input stage: {alone:,.0f} MiB reserved alone, {added:,.0f} MiB added to the step's; its "
        f"bound (`input_stage_bytes`) {bound:,.0f} MiB: {verdict}.",
    ]


def contender_renderer() -> Any:
    """``mlcls.bench.e2e_bench.contender_table``, or None where mlcls cannot be imported."""
    try:
        from mlcls.bench.e2e_bench import contender_table
    except (ImportError, OSError):  # the installation failed
        return None
    return contender_table


def write_jpegs(out: Path, train: int, val: int, size: tuple[int, int], classes: int) -> dict[str, Any]:
    """``train`` + ``val`` distinct generated JPEGs of ``size`` (``jpeg_files``, in parallel over the CPUs) in
    ``out``/train and ``out``/val, and ``out``/train.csv and val.csv listing each (``dataset=csv``'s columns
    ``image`` and ``labels``) with the class ``k mod classes`` (so that the training split has every class
    from ``classes`` images on) and up to two more drawn at random."""
    from mlcls.bench.pipeline_bench import jpeg_files

    parts = out / "parts"
    made = jpeg_files(None, train + val, size, parts)
    names = [f"c{k:02d}" for k in range(classes)]
    draw = random.Random(0)
    for split, paths in (("train", made[:train]), ("val", made[train:])):
        (out / split).mkdir(parents=True, exist_ok=True)
        rows = ["image,labels"]
        for k, path in enumerate(paths):
            image = f"{split}/{k:05d}.jpg"
            path.replace(out / image)
            labels = {names[k % classes], *draw.sample(names, draw.randint(0, min(2, classes)))}
            rows.append(f"{image},{' '.join(sorted(labels))}")
        (out / f"{split}.csv").write_text("\n".join(rows) + "\n")
    shutil.rmtree(parts)
    return {"train": train, "val": val, "size": list(size), "classes": classes}


def write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        handle.write(text)
    os.replace(handle.name, path)


def write_report(steps_file: Path, out_dir: Path, cpu_only: bool) -> dict[str, Any]:
    """Write ``out_dir``/report.json and report.md; the report's status is ``ok`` when no step failed."""
    steps = read_steps(steps_file)
    failed = [step["name"] for step in steps if step["status"] not in ("ok", "skipped")]
    report = {
        "status": "failed: " + ", ".join(failed) if failed else "ok",
        "cpu_only": cpu_only,
        "seconds": sum(step["seconds"] or 0 for step in steps),
        "environment": environment(),
        "steps": steps,
        "train_against_bench": train_against_bench(steps),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    write_atomically(out_dir / "report.md", render_markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("deps", help="the run-time requirements of mlcls against what is installed")
    jpegs = commands.add_parser("jpegs", help="generated JPEGs and their CSV files for dataset=csv")
    jpegs.add_argument("--out", type=Path, required=True, help="the folder of train/, val/ and the CSVs")
    jpegs.add_argument("--train", type=int, default=8192, help="training JPEGs")
    jpegs.add_argument("--val", type=int, default=512, help="validation JPEGs")
    jpegs.add_argument("--size", default="640x480", help="WIDTHxHEIGHT")
    jpegs.add_argument("--classes", type=int, default=20, help="class names c00, c01, ...")
    report = commands.add_parser("report", help="report.json and report.md from the recorded steps")
    report.add_argument("--steps", type=Path, required=True, help="the steps file the shell script wrote")
    report.add_argument("--out", type=Path, required=True, help="the report's folder")
    report.add_argument("--cpu-only", action="store_true", help="the CUDA steps were skipped (no CUDA)")
    args = parser.parse_args(argv)
    if args.command == "deps":
        found = check_requirements()
        print(json.dumps(found), flush=True)
        return 1 if found["missing"] else 0
    if args.command == "jpegs":
        width, height = (int(value) for value in args.size.lower().split("x"))
        print(json.dumps(write_jpegs(args.out, args.train, args.val, (width, height), args.classes)))
        return 0
    written = write_report(args.steps, args.out, args.cpu_only)
    print(f"gpu_check: {written['status']}; report in {args.out}/report.md and report.json")
    return 0 if written["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
