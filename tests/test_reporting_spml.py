"""The single-positive benchmark's presets (configs/experiment/spml*.yaml): what each composes to on each
dataset, ``mlcls-reproduce spml``'s sweeps and cost, the published numbers' sources, and the smoke table."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from conftest import compose_config
from hydra.utils import instantiate
from omegaconf import OmegaConf

from mlcls.cli import reproduce, tables
from mlcls.engine.config_checks import check_config
from mlcls.engine.optim import cosine_factor
from mlcls.reporting import spml
from mlcls.reporting.paper import ReportError
from mlcls.reporting.render import render_markdown
from mlcls.reporting.runs import RunRecord

# The released protocol, typed from Cole et al.'s train.py / datasets.py (not read from spml.yaml).
# The epoch is selected on a held-out 20 % of the training split, scored on full labels (its default, the
# "clean" validation variant).
RELEASED = {"epochs": 10, "batch": 16, "lr": 1e-4, "size": 448, "holdout": 0.2, "val_labels": "clean"}
EXPECTED_POSITIVES = {"voc2012": 1.5, "coco": 2.9, "nuswide": 1.9, "cub": 31.4}
EM_ALPHA = {"voc2012": 0.2, "coco": 0.1, "nuswide": 0.1, "cub": 0.01}
# APL's beta and warm-up epochs, typed from Zhou et al.'s train.py (not read from spml.yaml).
APL_BETA = {"voc2012": 0.02, "coco": 0.9, "nuswide": 0.2, "cub": 0.4}
APL_WARMUP = {"voc2012": 5, "coco": 5, "nuswide": 4, "cub": 3}
# EM's and EM+APL's batch size and lr, typed from Zhou et al.'s main.py (commit 9f960bc), per dataset.
EM_BATCH_LR = {"voc2012": (8, 1e-5), "coco": (16, 1e-5), "nuswide": (16, 1e-5), "cub": (8, 1e-4)}
# LL's batch size and (backbone, classifier) lr, typed from Kim et al.'s config.py and train.py (5025d16):
# bsize 16, lr 1e-5, the classifier at lr_mult 10 times it, for every dataset.
LL_BATCH_LR = (16, (1e-5, 1e-4))
TARGETS = {
    "full": "BinaryCrossEntropyLoss",
    "an": "AssumeNegativeLoss",
    "an_ls": "LabelSmoothedAssumeNegativeLoss",
    "wan": "WeakAssumeNegativeLoss",
    "epr": "ExpectedPositiveLoss",
    "em": "EntropyMaximisationLoss",
    "em_apl": "EntropyMaximisationLoss",
    "ll_r": "LargeLossLoss",
    "ll_ct": "LargeLossLoss",
    "ll_cp": "LargeLossLoss",
    "hill": "HillLoss",
    "splc": "SPLCLoss",
    "twoway": "TwoWayLoss",
    "role": "RoleLoss",
}
# Rows of the table without a preset yet: their published numbers are shown, our cells stay empty.
UNPRESET: tuple[str, ...] = ()
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "experiment"
# The rows read from the results table of VLPL's README (mvrl/VLPL at ed09b592, "Main results on the
# single-positive label setting"): VOC | COCO | NUS | CUB, typed from it, not read from spml_published.yaml.
VLPL_README = {
    "an": (85.89, 64.92, 42.27, 18.31),
    "em": (89.09, 70.70, 47.15, 20.85),
    "em_apl": (89.19, 70.87, 47.59, 21.84),
    "ll_r": (89.2, 71.0, 47.4, 19.5),
}


def test_every_preset_file_is_a_method_of_the_table():
    files = {path.stem for path in CONFIGS.glob("spml_*.yaml")}
    assert files == {f"spml_{method}" for method in TARGETS}
    assert set(spml.SPML_METHODS) == set(TARGETS) | set(UNPRESET)
    assert spml.preset_methods() == tuple(method for method in spml.SPML_METHODS if method in TARGETS)


DATASETS = ("voc2012", "coco", "nuswide", "cub")
# The presets whose values depend on the dataset (interpolations on dataset.name in spml.yaml), composed on
# each dataset; every other preset on one dataset, in turn, so that each dataset is composed with several.
PER_DATASET = ("em", "em_apl", "epr", "role")
PRESET_DATASETS = [
    (method, dataset)
    for index, method in enumerate(sorted(TARGETS))
    for dataset in (DATASETS if method in PER_DATASET else DATASETS[index % len(DATASETS) :][:1])
]


def test_only_the_per_dataset_presets_read_the_dataset():
    """The other presets compose alike on every dataset: outside the dataset configs themselves, only the
    per-dataset presets interpolate a dataset key."""
    reading = {
        path.relative_to(CONFIGS.parent).as_posix()
        for path in CONFIGS.parent.rglob("*.yaml")
        if path.parent.name != "dataset" and re.search(r"\$\{[^}]*\bdataset\.", path.read_text())
    }
    assert reading == {f"experiment/spml_{method}.yaml" for method in PER_DATASET}
    assert {dataset for _, dataset in PRESET_DATASETS} == set(DATASETS)


@pytest.mark.parametrize(("method", "dataset"), PRESET_DATASETS)
def test_preset_composes_to_the_released_protocol(method, dataset):
    cfg = compose_config([f"experiment=spml_{method}", f"dataset={dataset}"])
    check_config(cfg, world_size=1)
    assert cfg.dataset.name == dataset
    assert (cfg.model.name, cfg.model.pretrained) == ("resnet50.tv_in1k", True)
    assert (cfg.dataset.image_size, cfg.dataset.transform) == (RELEASED["size"], "light")
    assert cfg.dataset.observed == ("all" if method == "full" else "single_positive")
    batch, lrs = RELEASED["batch"], (RELEASED["lr"], RELEASED["lr"])
    if method in ("em", "em_apl"):
        batch, lr = EM_BATCH_LR[dataset]
        lrs = (lr, lr)
    if method.startswith("ll_"):
        batch, lrs = LL_BATCH_LR
    assert (cfg.trainer.epochs, cfg.trainer.batch_size) == (RELEASED["epochs"], batch)
    holdout = (cfg.dataset.val_fraction, cfg.dataset.val_labels)
    assert holdout == (RELEASED["holdout"], RELEASED["val_labels"])
    optim = cfg.optim
    assert optim._target_ == "torch.optim.Adam" and optim.weight_decay == 0.0
    assert (optim.lr_backbone, optim.lr_head) == lrs
    assert cfg.sched.warmup_epochs == 0
    factors = {cosine_factor(it, 100, cfg.sched.warmup_epochs, cfg.sched.min_lr_ratio) for it in range(100)}
    assert factors == {1.0}  # a constant learning rate
    loss = instantiate(cfg.loss)
    assert type(loss).__name__ == TARGETS[method]
    if method in ("epr", "role"):
        assert cfg.loss.expected_positives == EXPECTED_POSITIVES[dataset]
    if method in ("em", "em_apl"):
        assert cfg.loss.alpha == EM_ALPHA[dataset]
        assert loss.apl == (method == "em_apl") and loss.needs_sample_index == loss.apl
    if method == "em_apl":
        assert (loss.beta, loss.warmup_epochs) == (APL_BETA[dataset], APL_WARMUP[dataset])
        assert (loss.neg_proportion, loss.epochs) == (0.9, RELEASED["epochs"])
    if method.startswith("ll_"):
        assert cfg.loss.mode == method[3:]


def test_job_gpu_hours_follow_the_benchmark_protocol():
    # 10 epochs of COCO at 448 px (4 x ResNet-50 at 224 px, 1,200 images/s per V100): 80 % of 82,081 trained,
    # 40,137 test + 20 % held out evaluated (3 x faster); EM+APL adds a pass over the trained images per
    # epoch from its warm-up to the last but one.
    trained, evaluated = 0.8 * 82081, 40137 + 0.2 * 82081
    plain = 10 * (trained + evaluated / 3) * 4 / 1200 / 3600
    apl = plain + (10 - APL_WARMUP["coco"]) * trained / 3 * 4 / 1200 / 3600
    assert spml.job_gpu_hours({"dataset": "coco", "experiment": "spml_an"}) == pytest.approx(plain)
    assert spml.job_gpu_hours({"dataset": "coco", "experiment": "spml_em_apl"}) == pytest.approx(apl)


def test_dry_run_lists_every_preset_with_gpu_hours(tmp_path, capsys):
    argv = ["spml", "--dry-run", "--data-root", "/data", "--sweep-dir", str(tmp_path / "s")]
    assert reproduce.main(argv) == 0
    basis, *lines = capsys.readouterr().out.splitlines()
    assert basis.startswith("# GPU-hours at ResNet-50's 1,200 training images/s at 224 px (published V100")
    # 10 epochs x (80 % of train + (val + 20 % of train) / 3) images x 4 (448 px) at 1200 ResNet-50
    # images/s per V100, 14 presets: the held-out 20 % is evaluated each epoch, not trained on; EM+APL adds
    # a forward pass over the trained images (80 % of train, / 3) after epochs warm-up .. 9.
    # CUB: the official train_test_split.txt flags (5,994 train / 5,794 test)
    sizes = {
        "voc2012": (5717, 5823),
        "coco": (82081, 40137),
        "nuswide": (161789, 107859),
        "cub": (5994, 5794),
    }
    hours_per_image = 4 / 1200 / 3600
    hours = {
        name: (14 * 10 * (0.8 * tr + (te + 0.2 * tr) / 3) + (10 - APL_WARMUP[name]) * 0.8 * tr / 3)
        * hours_per_image
        for name, (tr, te) in sizes.items()
    }
    assert lines[0] == (
        "# spml: single-positive benchmark; 4 sweep(s), 56 runs, "
        f"about {sum(hours.values()):.0f} v100 GPU-hours"
    )
    experiments = ", ".join(f"spml_{method}" for method in spml.SPML_METHODS if method in TARGETS)
    for number, name in enumerate(sizes):
        header, command = lines[1 + 2 * number], lines[2 + 2 * number]
        assert header == f"# {name}: {experiments} ({hours[name]:.0f} v100 GPU-hours)"
        swept = experiments.replace(", ", ",")
        assert command.startswith(f"mlcls-train -m dataset={name} experiment={swept} ")
        assert f"hydra.sweep.dir={tmp_path / 's' / 'spml' / name}" in command
    assert len(lines) == 9 and not (tmp_path / "s").exists()


def test_published_numbers_carry_their_source():
    for entry in spml.load_published():
        assert all(entry[field] not in (None, "") for field in ("paper", "table", "row"))
        assert entry["source"].startswith("https://")
    entry = {"paper": "P", "table": "Table 1", "row": "AN", "method": "an", "dataset": "coco", "value": 60.0}
    entry["source"] = "https://example.org/paper"
    assert spml.check_published({"published": [entry]}) == (entry,)
    for field in ("paper", "table", "row", "value", "source"):
        with pytest.raises(ReportError, match=f"entry 0 lacks {field}"):
            spml.check_published({"published": [{**entry, field: None}]})
    with pytest.raises(ReportError, match="a second number for an on coco"):
        spml.check_published({"published": [entry, entry]})
    with pytest.raises(ReportError, match="expected a mAP in %"):
        spml.check_published({"published": [{**entry, "value": 0.6e3}]})


def test_published_number_lands_in_its_cell(monkeypatch):
    entry = {"paper": "P", "table": "T1", "row": "EPR", "method": "epr", "dataset": "nuswide", "value": 45.5}
    entry["source"] = "https://example.org/t1"
    monkeypatch.setattr(spml, "load_published", lambda: (entry,))
    spec = spml.spml_spec()
    assert spec.paper[(("EPR",), "NUS")] == 45.5
    assert [key for key, value in spec.paper.items() if value is not None] == [(("EPR",), "NUS")]
    assert "P T1 (https://example.org/t1)" in spec.note


def test_published_numbers_are_the_vlpl_readme_rows():
    entries = spml.load_published()
    read = {(entry["method"], entry["dataset"]): entry["value"] for entry in entries}
    typed = {
        (m, d): v
        for m, values in VLPL_README.items()
        for d, v in zip(("voc2012", "coco", "nuswide", "cub"), values, strict=True)
    }
    assert read == typed
    assert {entry["row"] for entry in entries} == {"AN Loss", "EM", "EM+APL", "LL-R"}
    assert {entry["source"] for entry in entries} == {
        "https://github.com/mvrl/VLPL/blob/ed09b592bbde3c1e2995f818261cd4cfbce97fca/README.md"
    }


def test_rendered_table_shows_the_published_numbers_beside_our_runs():
    run = RunRecord(
        path=Path("run"),
        attributes={"method": "an", "dataset": "coco"},
        metrics={"mAP_class": 60.0},
        deviations=(),
    )
    text = render_markdown(spml.fill_spml([run]))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    an, em_apl = VLPL_README["an"], VLPL_README["em_apl"]
    coco = f"60.00 / {an[1]:.2f} ({60.0 - an[1]:+.2f})"
    assert (
        rows["AN"]
        == f"| AN | missing / {an[0]:.2f} | {coco} | missing / {an[2]:.2f} | missing / {an[3]:.2f} |"
    )
    # No EM+APL run here: its published numbers stand beside an empty cell.
    assert rows["EM+APL"] == "| EM+APL | " + " | ".join(f"missing / {v:.2f}" for v in em_apl) + " |"
    assert rows["ROLE"] == "| ROLE |" + " missing / n/a |" * 4
    assert "mvrl/VLPL" in text


@pytest.mark.parametrize(("apl", "method"), [(True, "em_apl"), (False, "em"), (None, "em")])
def test_an_em_run_with_apl_is_the_em_apl_row(apl, method):
    loss = {"_target_": "mlcls.losses.EntropyMaximisationLoss", **({} if apl is None else {"apl": apl})}
    config = {"dataset": {"observed": "single_positive"}, "loss": loss}
    assert spml._method_of(config, {"loss": "em"}) == method


@pytest.mark.slow
def test_smoke_sweep_fills_its_rows(tmp_path, capsys):
    assert reproduce.main(["spml", "--smoke", "--sweep-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    runs = sorted((tmp_path / "spml" / "smoke").glob("*/results.json"))
    assert len(runs) == 2
    ours = {}
    for path in runs:
        results = json.loads(path.read_text())
        config = results["provenance"]["config"]
        assert config["dataset"]["observed"] == "single_positive"
        assert results["best"]["selected_on"] == "holdout" and results["dataset"]["holdout_size"] > 0
        ours[config["loss"]["_target_"].rsplit(".", 1)[-1]] = results["best"]["mAP_class"]
    cells = {(row["row"], row["column"]): row for row in csv.DictReader((tmp_path / "spml.csv").open())}
    assert len(cells) == len(spml.SPML_METHODS) * 4  # VOC12, COCO, NUS, CUB
    filled = {key: float(row["ours"]) for key, row in cells.items() if row["ours"]}
    expected = {("AN", "COCO"): ours["AssumeNegativeLoss"], ("Two-way", "COCO"): ours["TwoWayLoss"]}
    assert filled == pytest.approx(expected)
    assert "synthetic stands in for coco" in cells[("AN", "COCO")]["deviations"]
    assert "model.name=resnet10t (benchmark resnet50.tv_in1k)" in cells[("AN", "COCO")]["deviations"]
    # mlcls-tables renders the same table from the same runs.
    text = tables.report([tmp_path / "spml"], ["spml"], stand_ins={"synthetic": "coco"})
    assert text == (tmp_path / "spml.md").read_text()


@pytest.mark.parametrize("held_out", [True, False])
def test_a_cell_reports_the_epoch_the_held_out_split_selected(held_out, tmp_path):
    config = OmegaConf.to_container(compose_config(["experiment=spml_an", "dataset=coco"]), resolve=True)
    best = {"epoch": 2, "mAP_class": 20.0, "mAP_sample": 25.0, "weights": "raw"}
    if held_out:
        best.update(selected_on="holdout", selection={"mAP_class": 60.0, "mAP_sample": 65.0})
    results = {
        "metrics": {"mAP_class": 30.0, "mAP_sample": 35.0},
        "best": best,
        "epochs_completed": 10,
        "provenance": {"config": config, "world_size": 1},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    (run,) = spml.collect_spml_runs([tmp_path])
    # the validation split at the selected epoch; a run without a held-out split: its last evaluation
    assert run.metrics == ({"mAP_class": 20.0, "mAP_sample": 25.0} if held_out else results["metrics"])
    assert run.attributes["method"] == "an" and run.deviations == ()


@pytest.mark.parametrize(
    ("preset", "overrides", "deviations"),
    [
        ("spml_em_apl", [], ()),  # Zhou et al.'s batch 8 and lr 1e-5 on VOC 2012: no departure
        (
            "spml_em_apl",
            ["trainer.batch_size=16", "optim.lr_head=0.0001", "optim.lr_backbone=0.0001"],
            (
                "trainer.batch_size=16 (benchmark 8)",
                "optim.lr_head=0.0001 (benchmark 1e-05)",
                "optim.lr_backbone=0.0001 (benchmark 1e-05)",
            ),
        ),
        ("spml_ll_ct", [], ()),  # Kim et al.'s lr 1e-5, the classifier at 1e-4: no departure
        (
            "spml_ll_r",
            ["optim.lr_head=0.0001", "optim.lr_backbone=0.0001"],
            ("optim.lr_backbone=0.0001 (benchmark 1e-05)",),
        ),
    ],
)
def test_em_and_ll_cells_are_held_to_their_authors_batch_and_lr(tmp_path, preset, overrides, deviations):
    cfg = compose_config([f"experiment={preset}", "dataset=voc2012", *overrides])
    config = OmegaConf.to_container(cfg, resolve=True)
    results = {"metrics": {"mAP_class": 30.0}, "epochs_completed": 10, "provenance": {"config": config}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    (run,) = spml.collect_spml_runs([tmp_path])
    assert run.attributes["method"] == preset.removeprefix("spml_") and run.deviations == deviations


def test_another_backbone_is_one_deviation(tmp_path):
    """Old: also "backbone resnet101 (benchmark resnet50)", the model.name deviation said twice."""
    cfg = compose_config(["experiment=spml_an", "dataset=voc2012", "model.name=resnet101"])
    config = OmegaConf.to_container(cfg, resolve=True)
    results = {"metrics": {"mAP_class": 30.0}, "epochs_completed": 10, "provenance": {"config": config}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    (run,) = spml.collect_spml_runs([tmp_path])
    assert run.deviations == ("model.name=resnet101 (benchmark resnet50.tv_in1k)",)


def test_tables_without_a_benchmark_run_is_one_line(tmp_path, capsys):
    assert tables.main([str(tmp_path), "--table", "spml"]) == 2
    assert capsys.readouterr().err == (
        f"mlcls-tables: error: no run under {tmp_path} is a row of the single-positive benchmark "
        "(experiment=spml_<method>; docs/reproduce.md)\n"
    )


@pytest.mark.parametrize("mode", ["r", "ct", "cp"])
def test_an_ll_run_is_the_row_of_its_mode(mode):
    config = {"dataset": {"observed": "single_positive"}}
    assert spml._method_of(config, {"loss": "ll", "loss.mode": mode}) == f"ll_{mode}"
    assert spml.SPML_METHODS[f"ll_{mode}"] == f"LL-{mode.capitalize()}"
