"""mlcls.reporting's runs, table_specs, render and mlcls-tables: runs placed by their config, paper numbers
beside ours."""

from __future__ import annotations

import copy
import csv
import io
import json
from pathlib import Path

import pytest
import yaml
from conftest import compose_config, run_main
from omegaconf import OmegaConf

from mlcls.cli import tables as tables_cli
from mlcls.losses.spec import effective_bucket_size
from mlcls.reporting.paper import ReportError, load_paper
from mlcls.reporting.render import render_csv, render_markdown
from mlcls.reporting.runs import built_name, collect_runs, paper_deviations
from mlcls.reporting.table_specs import HARD_MIN_TP, fill_table, table_spec, unplaced_runs

SHARED_TABLES = Path("/work/shared/paper/tables.yaml")
# Table 6 sizes (train, test), typed from the paper, so that a run can follow the protocol exactly.
COCO_SIZES = {"name": "coco", "num_classes": 80, "train_size": 82081, "val_size": 40137}


@pytest.fixture(scope="module")
def twoway_coco() -> dict:
    """The resolved config of ``experiment=paper_twoway dataset=coco`` (composed once)."""
    return OmegaConf.to_container(compose_config(["experiment=paper_twoway", "dataset=coco"]), resolve=True)


@pytest.fixture(scope="module")
def bce_coco() -> dict:
    return OmegaConf.to_container(compose_config(["experiment=paper_bce", "dataset=coco"]), resolve=True)


def write_run(
    run_dir: Path,
    config: dict,
    mac: float,
    mas: float,
    world_size: int = 1,
    epochs_completed: int = 40,
    sizes: dict | None = None,
    in_provenance: bool = False,
) -> Path:
    """A run directory as the trainer leaves it: results.json and config.yaml (or provenance.config)."""
    run_dir.mkdir(parents=True)
    results = {
        "metrics": {"mAP_class": mac, "mAP_sample": mas},
        "dataset": sizes or COCO_SIZES,
        "epochs_completed": epochs_completed,
        "world_size": world_size,
    }
    if in_provenance:
        results["provenance"] = {"config": config, "world_size": world_size}
    else:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "results.json").write_text(json.dumps(results))
    return run_dir


def variant(config: dict, **dotted) -> dict:
    """A copy of ``config`` with dotted keys set (``loss__tp=1`` sets loss.tp)."""
    config = copy.deepcopy(config)
    for key, value in dotted.items():
        node = config
        *parents, leaf = key.split("__")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def csv_cells(text: str) -> dict[tuple[str, str], dict]:
    return {(row["row"], row["column"]): row for row in csv.DictReader(io.StringIO(text))}


# ------------------------------------------------------------------------------------------ paper numbers
def test_packaged_numbers_equal_the_shared_transcription():
    if not SHARED_TABLES.is_file():
        pytest.skip("shared/paper/tables.yaml is not on this machine")
    assert load_paper() == yaml.safe_load(SHARED_TABLES.read_text())


@pytest.mark.parametrize(
    ("table", "row", "column", "paper"),
    [  # typed from the paper's text (shared/seeds/004_...txt), not from the YAML
        ("table1", ("4",), "mAP@class T_N=1", 74.11),
        ("table1", ("4",), "mAP@sample T_N=1", 86.66),
        ("table1", ("→0",), "mAP@class T_N=0.5", 71.03),
        ("table1", ("0.5",), "mAP@sample T_N=4", 85.51),
        ("table2", ("mAP@class",), "ε=4", 73.44),
        ("table2", ("mAP@sample",), "ε=8", 86.02),
        ("table2", ("mAP@class",), "ε=0.5", None),
        ("table3", ("mAP@class",), "(a) Ours class", 73.06),
        ("table3", ("mAP@sample",), "(b) Softmax both", 84.33),
        ("table3", ("mAP@class",), "(b) Softmax both", None),
        ("table3", ("mAP@class",), "(b) Softmax sample", 58.00),
        ("table4", ("mAP@class",), "(b) Joint-way (22) T_P=2", 71.71),
        ("table4", ("mAP@sample",), "(a) Multi-sim (20) T_P=1", 85.42),
        ("table5", ("mAP@class",), "M=128", None),
        ("table7", ("VAW", "Ours"), "mAP@class DenseNet-169", 54.28),
        ("table7", ("VOC2012", "ASL"), "mAP@sample RegNetY-32GF", 95.46),
        ("table7", ("MSCOCO", "Softmax"), "mAP@class ResNet-50", 58.00),
        ("table7", ("WIDER", "BCE"), "mAP@sample ResNeXt-50", 78.56),
    ],
)
def test_cells_carry_the_papers_numbers(table, row, column, paper):
    spec = table_spec(table)
    assert spec.paper[(row, column)] == paper


def test_every_paper_number_fills_one_cell():
    """The non-null numbers of each table's transcription, walked here, are the spec's numbers: none lost,
    none given to two cells."""
    paper = load_paper()
    t1, t3, t4, t7 = (paper[k] for k in ("table1_temperature", "table3_ways", "table4_related", "table7"))
    numbers = {
        "table1": [v for row in t1["tp"].values() for metric in row.values() for v in metric],
        "table2": [v for pair in paper["table2_logit_bias"]["values"].values() for v in pair],
        "table3": [v for loss in t3.values() for pair in loss.values() for v in pair],
        "table4": [v for loss in t4.values() for k in ("mAP_class", "mAP_sample") for v in loss[k]],
        "table5": [],
        "table7": [
            v
            for dataset in ("coco", "vispr", "vaw", "wider", "voc2007", "voc2012")
            for loss in t7[dataset].values()
            for pair in loss.values()
            for v in pair
        ],
    }
    for name, expected in numbers.items():
        ours = [value for value in table_spec(name).paper.values() if value is not None]
        assert sorted(ours) == sorted(float(v) for v in expected if v is not None), name
    assert len(numbers["table7"]) == 6 * 5 * 4 * 2 and len(numbers["table1"]) == 5 * 4 * 2


def test_table_shapes_follow_the_paper():
    shapes = {
        name: (len(table_spec(name).rows), len(table_spec(name).columns)) for name in ("table1", "table7")
    }
    assert shapes == {"table1": (5, 8), "table7": (30, 8)}
    assert all(value is not None for value in table_spec("table7").paper.values())
    assert sum(value is not None for value in table_spec("table2").paper.values()) == 4


def test_unknown_table_is_a_one_line_error():
    with pytest.raises(ReportError, match="unknown table 'table6'; expected one of table1, table2"):
        table_spec("table6")


# ------------------------------------------------------------------------------------------ placing runs
def test_effective_bucket_size():
    assert effective_bucket_size({"bucket_size": 128}, 512, 1) == 128
    assert effective_bucket_size({"bucket_size": None, "gather": False}, 512, 4) == 128
    assert effective_bucket_size({"bucket_size": None, "gather": True}, 512, 4) == 512
    assert effective_bucket_size({"name": "bce", "pos_weight": "freq"}, 512, 4) is None


def test_protocol_run_fills_its_cells_with_differences(tmp_path, twoway_coco):
    # A misleading directory name: the config, not the name, decides.
    write_run(tmp_path / "table7_bce_vispr", twoway_coco, mac=75.0, mas=86.0)
    runs = collect_runs([tmp_path])
    assert runs[0].deviations == ()  # the paper_twoway preset on MS-COCO is the paper's protocol

    table1 = csv_cells(render_csv(fill_table(table_spec("table1"), runs)))
    cell = table1[("4", "mAP@class T_N=1")]
    assert float(cell["ours"]) == 75.0 and float(cell["paper"]) == 74.11
    assert float(cell["diff"]) == pytest.approx(75.0 - 74.11)
    assert cell["runs"] == "1" and cell["run_dirs"] == str(tmp_path / "table7_bce_vispr")
    assert float(table1[("4", "mAP@sample T_N=1")]["diff"]) == pytest.approx(86.0 - 86.66)
    filled = [key for key, row in table1.items() if row["ours"]]
    assert sorted(filled) == [("4", "mAP@class T_N=1"), ("4", "mAP@sample T_N=1")]
    assert (
        table1[("2", "mAP@class T_N=1")]["ours"] == ""
        and table1[("2", "mAP@class T_N=1")]["paper"] == "73.66"
    )

    markdown = render_markdown(fill_table(table_spec("table1"), runs))
    row_four = next(line for line in markdown.splitlines() if line.startswith("| 4 |"))
    assert row_four.split(" | ")[2] == "75.00 / 74.11 (+0.89)"
    assert row_four.split(" | ")[1] == "missing / 73.56"
    assert "Off the paper's protocol" not in markdown

    # The same run is Table 7's MS-COCO / Ours / ResNet-50 cell and Table 5's M = 128.
    table7 = csv_cells(render_csv(fill_table(table_spec("table7"), runs)))
    assert float(table7[("MSCOCO / Ours", "mAP@sample ResNet-50")]["ours"]) == 86.0
    assert float(table7[("MSCOCO / Ours", "mAP@sample ResNet-50")]["paper"]) == 86.66
    table5 = csv_cells(render_csv(fill_table(table_spec("table5"), runs)))
    assert (
        float(table5[("mAP@class", "M=128")]["ours"]) == 75.0
        and table5[("mAP@class", "M=128")]["paper"] == ""
    )


def test_runs_of_one_cell_are_averaged(tmp_path, twoway_coco):
    write_run(tmp_path / "a", variant(twoway_coco, loss__tp=2.0, loss__tn=0.5), mac=70.0, mas=80.0)
    write_run(tmp_path / "b", variant(twoway_coco, loss__tp=2, loss__tn=0.5), mac=71.0, mas=81.5)
    filled = fill_table(table_spec("table1"), collect_runs([tmp_path]))
    cells = csv_cells(render_csv(filled))
    assert float(cells[("2", "mAP@class T_N=0.5")]["ours"]) == 70.5
    assert float(cells[("2", "mAP@sample T_N=0.5")]["diff"]) == pytest.approx(80.75 - 86.27)
    assert cells[("2", "mAP@class T_N=0.5")]["runs"] == "2"
    assert "70.50 / 73.42 (-2.92) n=2" in render_markdown(filled)


def test_buckets_are_counted_per_batch(tmp_path, twoway_coco):
    one_gpu_whole_batch = variant(twoway_coco, loss__bucket_size=None)  # 1 bucket of 512
    four_gpus = variant(twoway_coco, loss__bucket_size=None)  # 4 x 128 on 4 processes
    gathered = variant(twoway_coco, loss__bucket_size=None, loss__gather=True)  # 512 over 4 processes
    write_run(tmp_path / "m512", one_gpu_whole_batch, mac=60.0, mas=80.0)
    write_run(tmp_path / "ddp128", four_gpus, mac=61.0, mas=81.0, world_size=4)
    write_run(tmp_path / "gather512", gathered, mac=62.0, mas=82.0, world_size=4)
    write_run(tmp_path / "m16", variant(twoway_coco, loss__bucket_size=16), mac=63.0, mas=83.0)
    runs = collect_runs([tmp_path])
    table5 = csv_cells(render_csv(fill_table(table_spec("table5"), runs)))
    assert float(table5[("mAP@class", "M=512")]["ours"]) == 61.0  # mean of 60 and 62
    assert float(table5[("mAP@class", "M=128")]["ours"]) == 61.0
    assert float(table5[("mAP@class", "M=16")]["ours"]) == 63.0
    assert table5[("mAP@class", "M=512")]["runs"] == "2"
    table1 = csv_cells(render_csv(fill_table(table_spec("table1"), runs)))
    assert table1[("4", "mAP@class T_N=1")]["run_dirs"] == str(tmp_path / "ddp128")


def test_hard_minimum_row_and_table_2_4_cells(tmp_path, twoway_coco):
    write_run(tmp_path / "tp0", variant(twoway_coco, loss__tp=HARD_MIN_TP, loss__tn=2.0), mac=50.0, mas=70.0)
    biased = variant(twoway_coco, loss__tp=1.0, loss__tn=1.0, loss__margin=4.0)
    write_run(tmp_path / "eps4", biased, mac=73.0, mas=86.5)
    joint = variant(twoway_coco, loss__name="joint", loss__tp=2.0)
    del joint["loss"]["ways"]
    write_run(tmp_path / "joint", joint, mac=71.0, mas=85.0)
    runs = collect_runs([tmp_path])
    table1 = csv_cells(render_csv(fill_table(table_spec("table1"), runs)))
    assert float(table1[("→0", "mAP@class T_N=2")]["diff"]) == pytest.approx(50.0 - 71.88)
    table2 = csv_cells(render_csv(fill_table(table_spec("table2"), runs)))
    assert float(table2[("mAP@sample", "ε=4")]["diff"]) == pytest.approx(86.5 - 86.21)
    table4 = csv_cells(render_csv(fill_table(table_spec("table4"), runs)))
    assert float(table4[("mAP@class", "(b) Joint-way (22) T_P=2")]["diff"]) == pytest.approx(71.0 - 71.71)
    assert table4[("mAP@class", "(a) Multi-sim (20) T_P=2")]["ours"] == ""


def test_loss_settings_off_the_paper_place_nowhere(tmp_path, bce_coco):
    write_run(tmp_path / "freq", bce_coco, mac=67.0, mas=79.0)
    write_run(tmp_path / "plain", variant(bce_coco, loss__pos_weight="none"), mac=66.0, mas=78.0)
    runs = collect_runs([tmp_path])
    table7 = csv_cells(render_csv(fill_table(table_spec("table7"), runs)))
    assert float(table7[("MSCOCO / BCE", "mAP@class ResNet-50")]["diff"]) == pytest.approx(67.0 - 67.71)
    assert [run.path.name for run in unplaced_runs(runs, [table_spec("table7")])] == ["plain"]


def test_config_is_read_from_provenance(tmp_path, bce_coco):
    write_run(
        tmp_path / "run", variant(bce_coco, model__name="densenet169.tv_in1k"), 64.5, 76.0, in_provenance=True
    )
    table7 = csv_cells(render_csv(fill_table(table_spec("table7"), collect_runs([tmp_path / "run"]))))
    assert float(table7[("MSCOCO / BCE", "mAP@class DenseNet-169")]["ours"]) == 64.5


def test_deviations_are_marked_and_listed(tmp_path, twoway_coco):
    short = variant(twoway_coco, trainer__epochs=20, model__pretrained=False, optim__lr_head=0.1)
    write_run(
        tmp_path / "short",
        short,
        mac=70.0,
        mas=85.0,
        epochs_completed=12,
        sizes={**COCO_SIZES, "train_size": 8},
    )
    runs = collect_runs([tmp_path])
    assert set(runs[0].deviations) == {
        "trainer.epochs=20 (paper 40)",
        "optim.lr_head=0.1 (paper 0.01)",
        "unfinished: 12 of 20 epochs",
        "not pretrained (paper resnet50.tv_in1k)",
        "train split 8 samples (paper 82081)",
    }
    markdown = render_markdown(fill_table(table_spec("table1"), runs))
    assert "70.00 / 74.11 (-4.11) *" in markdown
    assert "- trainer.epochs=20 (paper 40) (2 cells)" in markdown


def with_groups(config: dict, optim_target: str, sched_target: str) -> dict:
    """``config`` with optimizer and schedule as ``_partial_`` configs (``_target_``, no ``name`` key)."""
    config = copy.deepcopy(config)
    for group, target in (("optim", optim_target), ("sched", sched_target)):
        config[group].pop("name", None)
        config[group].update({"_target_": target, "_partial_": True})
    return config


def deviations(config: dict) -> list[str]:
    return paper_deviations(config, {"epochs_completed": 40, "dataset": COCO_SIZES})


@pytest.mark.parametrize(
    ("optim_target", "sched_target", "expected"),
    [
        ("torch.optim.SGD", "torch.optim.lr_scheduler.CosineAnnealingLR", []),
        ("torch.optim.SGD", "mlcls.engine.schedule.warmup_cosine", []),
        ("torch.optim.AdamW", "mlcls.engine.schedule.cosine", ["optim=adamw (paper sgd)"]),
        ("torch.optim.ASGD", "mlcls.engine.schedule.cosine", ["optim=asgd (paper sgd)"]),
        ("torch.optim.SGD", "torch.optim.lr_scheduler.StepLR", ["sched=steplr (paper cosine)"]),
    ],
)
def test_optimizer_and_schedule_are_named_by_their_target(twoway_coco, optim_target, sched_target, expected):
    assert deviations(with_groups(twoway_coco, optim_target, sched_target)) == expected


def test_old_runs_name_their_optimizer_with_a_name_key(twoway_coco):
    assert deviations(twoway_coco) == []  # the paper presets of this version: optim.name, sched.name
    adamw = copy.deepcopy(twoway_coco)
    adamw["optim"]["name"] = "adamw"
    assert deviations(adamw) == ["optim=adamw (paper sgd)"]
    assert built_name({"name": "sgd", "_target_": "torch.optim.AdamW"}) == "sgd"
    assert built_name({}) is None


def test_stand_ins(tmp_path, twoway_coco):
    synthetic = variant(twoway_coco, dataset__name="synthetic", model__name="resnet10t")
    write_run(tmp_path / "smoke", synthetic, mac=30.0, mas=40.0)
    assert fill_table(table_spec("table1"), collect_runs([tmp_path])).filled == 0
    runs = collect_runs([tmp_path], {"synthetic": "coco", "resnet10t": "resnet50"})
    cells = csv_cells(render_csv(fill_table(table_spec("table1"), runs)))
    assert float(cells[("4", "mAP@class T_N=1")]["ours"]) == 30.0
    assert "synthetic stands in for coco" in cells[("4", "mAP@class T_N=1")]["deviations"]


def test_run_dir_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="empty: no results.json in it or below"):
        collect_runs([tmp_path / "empty"])
    with pytest.raises(ReportError, match="nowhere: no such directory"):
        collect_runs([tmp_path / "nowhere"])
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "noconfig" / "results.json").write_text("{}")
    with pytest.raises(ReportError, match="no provenance.config and there is no config.yaml"):
        collect_runs([tmp_path / "noconfig"])


# ------------------------------------------------------------------------------------------ mlcls-tables
def test_cli_writes_markdown_and_csv(tmp_path, capsys, twoway_coco):
    write_run(tmp_path / "runs" / "0", twoway_coco, mac=74.0, mas=86.0)
    out = tmp_path / "report"
    assert tables_cli.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    # every table the run fills, and only those
    assert [line for line in printed.splitlines() if line.startswith("### ")] == [
        "### " + table_spec(name).caption for name in ("table1", "table3", "table5", "table7")
    ]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{name}.{ext}" for name in ("table1", "table3", "table5", "table7") for ext in ("md", "csv")
    )
    cells = csv_cells((out / "table3.csv").read_text())
    assert float(cells[("mAP@class", "(a) Ours both")]["diff"]) == pytest.approx(74.0 - 74.11)


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert tables_cli.main([str(tmp_path / "empty")]) == 2
    assert (
        capsys.readouterr().err
        == f"mlcls-tables: error: {tmp_path / 'empty'}: no results.json in it or below\n"
    )
    assert tables_cli.main([str(tmp_path), "--table", "table8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlcls-tables: error: unknown table 'table8'") and err.count("\n") == 1


def test_the_command_prints_the_table_as_csv(tmp_path, twoway_coco, monkeypatch, capsys):
    write_run(tmp_path / "run", twoway_coco, mac=74.5, mas=86.0)
    argv = ["mlcls-tables", str(tmp_path / "run"), "--table", "table1", "--csv"]
    code, err, out = run_main(tables_cli.main, argv, monkeypatch, capsys)
    assert code == 0, err
    assert float(csv_cells(out)[("4", "mAP@class T_N=1")]["ours"]) == 74.5


def test_a_table_the_runs_fill_nowhere_is_one_line(tmp_path, capsys, twoway_coco):
    write_run(tmp_path / "run", twoway_coco, mac=74.5, mas=86.0)
    # T_P = 4 is not in Table 2: a table the runs fill nowhere is an error, not a page of "missing" cells
    assert tables_cli.main([str(tmp_path / "run"), "--table", "table2", "--csv"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("mlcls-tables: error: none of the 1 runs fills a cell of table2;")
    assert len(err.splitlines()) == 1


def test_a_table_no_run_can_be_placed_in_names_the_stand_ins(tmp_path, capsys, twoway_coco):
    synthetic = variant(twoway_coco, dataset__name="synthetic", model__name="resnet10t")
    write_run(tmp_path / "smoke", synthetic, mac=30.0, mas=40.0)
    argv = [str(tmp_path), "--table", "table1", "--stand-in", "synthetic=voc2007"]
    assert tables_cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "mlcls-tables: error: none of the 1 runs can fill a cell of table1: the runs have dataset voc2007 "
        "and backbone resnet10t, the tables need dataset coco and backbone resnet50; "
        "--stand-in synthetic=coco --stand-in resnet10t=resnet50 would place them\n"
    )
    argv = [
        str(tmp_path),
        "--table",
        "table1",
        "--stand-in",
        "synthetic=coco",
        "--stand-in",
        "resnet10t=resnet50",
    ]
    assert tables_cli.main([*argv, "--csv"]) == 0
    assert float(csv_cells(capsys.readouterr().out)[("4", "mAP@class T_N=1")]["ours"]) == 30.0


@pytest.mark.parametrize(
    ("amp", "device", "deviates"),
    [
        ("auto", "cpu", True),
        ("auto", "cuda", False),
        ("auto", None, False),
        ("none", "cuda", True),
        ("fp16", "cpu", False),
    ],
)
def test_amp_auto_off_cuda_is_no_mixed_precision(twoway_coco, amp, device, deviates):
    """trainer.amp=auto is bf16 on CUDA and float32 elsewhere: the device in results.json decides."""
    config = variant(twoway_coco, trainer__amp=amp)
    results = {"epochs_completed": 40, "dataset": COCO_SIZES}
    if device is not None:
        results["provenance"] = {"device": {"type": device}}
    assert ("no mixed precision (paper AMP)" in paper_deviations(config, results)) == deviates


def test_a_warm_up_left_to_the_head_is_read_from_the_head():
    """``sched.warmup_epochs`` null takes the head's own warm-up (``model.head.warmup_epochs``): a linear
    head's 0 epochs follows the paper's no warm-up, ML-Decoder's 1 epoch does not."""
    from mlcls.reporting.runs import _follows

    def config(sched: int | None, head: int) -> dict:
        return {"sched": {"warmup_epochs": sched}, "model": {"head": {"warmup_epochs": head}}}

    assert _follows(config(None, 0), "sched.warmup_epochs", 0)[0]
    follows, shown = _follows(config(None, 1), "sched.warmup_epochs", 0)
    assert not follows and shown == "null (model.head.warmup_epochs=1)"
    assert not _follows(config(2, 0), "sched.warmup_epochs", 0)[0]
