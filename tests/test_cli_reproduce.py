"""mlcls-reproduce: each smoke sweep trains, and its table renders ours beside the paper's numbers."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mlcls.cli import reproduce
from mlcls.losses.spec import loss_name

REPO = Path(__file__).resolve().parents[1]
METRICS = ("mAP_class", "mAP_sample")

# The cells each smoke sweep fills: (row, column of the mAP@class block) -> (config key, value) of the run
# expected there, and the paper's [mAP@class, mAP@sample] typed from the paper (None: not legible).
FILLED = {
    "table1": {
        ("1", "T_N=1"): ("loss.tp", 1, [72.93, 86.14]),
        ("4", "T_N=1"): ("loss.tp", 4, [74.11, 86.66]),
    },
    "table2": {
        ("", "ε=4"): ("loss.margin", 4, [73.44, 86.21]),
        ("", "ε=8"): ("loss.margin", 8, [73.18, 86.02]),
    },
    "table3": {
        ("", "(a) Ours class"): ("loss.name", "twoway", [73.06, 82.75]),
        ("", "(b) Softmax class"): ("loss.name", "softmax", [68.13, 69.15]),
    },
    "table4": {
        ("", "(a) Multi-sim (20) T_P=4"): ("loss.name", "multisim", [71.27, 85.95]),
        ("", "(b) Joint-way (22) T_P=4"): ("loss.name", "joint", [71.82, 85.64]),
    },
    "table5": {
        ("", "M=128"): ("loss.bucket_size", 4, [None, None]),  # 16 / 4 = 512 / 128 buckets per batch
        ("", "M=512"): ("loss.bucket_size", 16, [None, None]),
    },
    "table7": {
        ("MSCOCO / Ours", "ResNet-50"): ("loss.name", "twoway", [74.11, 86.66]),
        ("MSCOCO / BCE", "ResNet-50"): ("loss.name", "bce", [67.71, 79.65]),
    },
}
METRIC_LABELS = {"mAP_class": "mAP@class", "mAP_sample": "mAP@sample"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """``mlcls-reproduce all --smoke`` once for the module: per table 2 runs on the CPU, of one iteration at
    16 pixels (the tables read the runs' configs and results, not what the runs learnt; most of a smoke run's
    time is Hydra composing its config)."""
    root = tmp_path_factory.mktemp("reproduce")
    smaller = ["trainer.limit_train_batches=1", "dataset.image_size=16"]
    assert reproduce.main(["all", "--smoke", "--sweep-dir", str(root), *smaller]) == 0
    return root


def config_value(run_dir: Path, dotted: str):
    """The value of ``dotted`` in the run's resolved config; ``loss.name`` is the loss's short name."""
    node = yaml.safe_load((run_dir / "config.yaml").read_text())
    if dotted == "loss.name":
        return loss_name(node["loss"])
    for part in dotted.split("."):
        node = node[part]
    return node


def cell_position(table: str, row: str, column: str, metric: str) -> tuple[str, str]:
    """Where the CSV puts a cell: metric rows (Tables 2-5) or metric column blocks (Tables 1, 7)."""
    if table in ("table1", "table7"):
        return row, f"{METRIC_LABELS[metric]} {column}"
    return METRIC_LABELS[metric], column


@pytest.mark.parametrize("table", sorted(FILLED))
@pytest.mark.slow
def test_smoke_table_has_our_runs_beside_the_paper(smoke, table):
    runs = sorted((smoke / table / "smoke").glob("*/results.json"))
    assert len(runs) == 2
    rows = list(csv.DictReader((smoke / f"{table}.csv").open()))
    cells = {(r["row"], r["column"]): r for r in rows}
    expected_positions = set()
    for (row, column), (key, value, paper) in FILLED[table].items():
        for metric, paper_value in zip(METRICS, paper, strict=True):
            position = cell_position(table, row, column, metric)
            expected_positions.add(position)
            cell = cells[position]
            (run_dir,) = [Path(p) for p in cell["run_dirs"].split()]
            assert run_dir.parent == smoke / table / "smoke"
            assert config_value(run_dir, key) == value
            ours = json.loads((run_dir / "results.json").read_text())["metrics"][metric]
            assert float(cell["ours"]) == pytest.approx(ours, abs=1e-12)
            if paper_value is None:
                assert cell["paper"] == "" and cell["diff"] == ""
            else:
                assert float(cell["paper"]) == paper_value
                assert float(cell["diff"]) == pytest.approx(ours - paper_value)
            assert "synthetic stands in for coco" in cell["deviations"]
    filled = {position for position, cell in cells.items() if cell["ours"]}
    assert filled == expected_positions
    markdown = (smoke / f"{table}.md").read_text()
    assert markdown.count(" *") == len(filled) and "missing / " in markdown
    assert f"{len(filled)} of {len(rows)} cells filled." in markdown


@pytest.mark.slow
def test_smoke_markdown_cell(smoke):
    run = next(
        p.parent
        for p in (smoke / "table1" / "smoke").glob("*/results.json")
        if config_value(p.parent, "loss.tp") == 4
    )
    ours = json.loads((run / "results.json").read_text())["metrics"]["mAP_class"]
    line = next(line for line in (smoke / "table1.md").read_text().splitlines() if line.startswith("| 4 |"))
    assert line.split(" | ")[2] == f"{ours:.2f} / 74.11 ({ours - 74.11:+.2f}) *"


def test_dry_run_prints_sweeps_and_cost(tmp_path, capsys):
    assert (
        reproduce.main(["table7", "--dry-run", "--data-root", "/data", "--sweep-dir", str(tmp_path / "x")])
        == 0
    )
    basis, *lines = capsys.readouterr().out.splitlines()
    assert basis == (
        "# GPU-hours at ResNet-50's 1,200 training images/s at 224 px "
        "(published V100 figures, not measured by mlcls)"
    )
    assert lines[0].startswith("# table7:") and "6 sweep(s), 120 runs, about 210 v100 GPU-hours" in lines[0]
    assert [line.split()[2] for line in lines[1:]] == [
        f"dataset={name}" for name in ("coco", "vispr", "vaw", "wider", "voc2007", "voc2012")
    ]
    assert all(line.startswith("mlcls-train -m ") for line in lines[1:])
    assert f"hydra.sweep.dir={tmp_path / 'x' / 'table7' / 'vaw'}" in lines[3]
    assert "dataset.root=/data/voc" in lines[5]
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_dry_run_torchrun_starts_one_process_group_per_run(tmp_path, capsys):
    argv = ["table2", "--dry-run", "--launcher", "torchrun", "--sweep-dir", str(tmp_path), "trainer.seed=3"]
    assert reproduce.main(argv) == 0
    commands = capsys.readouterr().out.splitlines()[2:]  # after the cost basis and the table's line
    assert len(commands) == 5
    for number, (command, eps) in enumerate(zip(commands, ("0.5", "1", "2", "4", "8"), strict=True)):
        assert "--nproc_per_node=4 -m mlcls.train dataset=coco experiment=paper_twoway" in command
        assert f"loss.margin={eps} " in command and "trainer.seed=3" in command
        assert command.endswith(
            f"hydra.run.dir={tmp_path / 'table2' / 'coco' / str(number)} trainer.resume=auto"
        )


def test_failed_sweep_is_reported(tmp_path, capsys):
    assert reproduce.main(["table2", "--smoke", "--sweep-dir", str(tmp_path), "trainer.epochs=0"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert any("trainer.epochs=0" in line for line in err)
    assert err[-2].startswith("mlcls-reproduce: error: the sweep stopped with exit status")
    assert err[-1] == f"mlcls-reproduce: the same command with --sweep-dir {tmp_path} resumes"


def test_unknown_table_is_one_line(capsys):
    assert reproduce.main(["table6"]) == 2
    assert capsys.readouterr().err == (
        "mlcls-reproduce: error: unknown table 'table6'; "
        "expected one of table1, table2, table3, table4, table5, table7 or all, "
        "or a preset: mldecoder_coco, twoway_mldecoder_coco or presets, or spml\n"
    )


@pytest.mark.slow
def test_table_script_runs_the_command(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    script = REPO / "scripts" / "reproduce" / "table4.sh"
    done = subprocess.run(
        [str(script), "--dry-run", "--sweep-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    sweep = tmp_path / "table4" / "coco"
    assert done.stdout.splitlines()[2] == (  # after the cost basis and the table's line
        f"mlcls-train -m dataset=coco experiment=paper_multisim,paper_joint loss.tp=1,2,4 "
        f"trainer.resume=auto hydra.sweep.dir={sweep}"
    )


@pytest.mark.slow
def test_same_command_resumes_and_skips_finished_runs(smoke):
    runs = sorted((smoke / "table2" / "smoke").glob("*/checkpoints/last.pt"))
    before = [(p.stat().st_mtime_ns, (p.parents[1] / "results.json").read_text()) for p in runs]
    assert reproduce.main(["table2", "--smoke", "--sweep-dir", str(smoke)]) == 0
    after = [(p.stat().st_mtime_ns, (p.parents[1] / "results.json").read_text()) for p in runs]
    assert len(runs) == 2 and after == before  # nothing retrained, nothing rewritten
