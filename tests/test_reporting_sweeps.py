"""The paper presets (configs/experiment/) and the sweeps of each table: every cell has exactly one run."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import yaml
from conftest import compose_config
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from mlcls import config_dir
from mlcls.losses.spec import loss_name
from mlcls.reporting.paper import ReportError
from mlcls.reporting.runs import PAPER_WEIGHTS, matches, run_attributes
from mlcls.reporting.sweeps import (
    SMOKE_STAND_INS,
    dataset_root,
    expand,
    gpu_hours,
    job_values,
    run_gpu_hours,
    sweep_gpu_hours,
    table_sweeps,
)
from mlcls.reporting.table_specs import table_spec

TABLES = ("table1", "table2", "table3", "table4", "table5", "table7")


class JobConfigs:
    """Resolved configs of sweep jobs: Hydra composes each (experiment, dataset) pair once; the job's other
    overrides, all plain leaf values, are then set on a copy."""

    def __init__(self) -> None:
        self.composed: dict[tuple[str, str], dict] = {}

    def __call__(self, job: list[str]) -> dict:
        values = job_values(job)
        key = (values["experiment"], values["dataset"])
        if key not in self.composed:
            overrides = [f"experiment={key[0]}", f"dataset={key[1]}"]
            self.composed[key] = OmegaConf.to_container(compose(config_name="train", overrides=overrides))
        cfg = OmegaConf.create(self.composed[key])
        for name, value in values.items():
            if name not in ("experiment", "dataset"):
                OmegaConf.update(cfg, name, yaml.safe_load(value), force_add=True)
        return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture(scope="module")
def job_configs():
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        yield JobConfigs()


def test_paper_preset_is_the_protocol_of_section_4_1():
    cfg = compose_config(["experiment=paper", "dataset=coco"])
    assert cfg.model.name == "resnet50.tv_in1k" and cfg.model.pretrained is True
    assert dict(cfg.optim) == {
        "_target_": "torch.optim.SGD",
        "_partial_": True,
        "fused": True,
        "lr_head": 0.01,
        "lr_backbone": 0.001,
        "weight_decay": 1e-4,
        "norm_weight_decay": None,
        "bias_weight_decay": None,
        "momentum": 0.9,
        "nesterov": True,
    }
    assert cfg.sched._target_ == "mlcls.engine.optim.cosine_schedule"
    assert cfg.sched.warmup_epochs == 0 and cfg.sched.min_lr_ratio == 0.0
    assert (cfg.trainer.epochs, cfg.trainer.batch_size, cfg.trainer.amp) == (40, 512, "fp16")
    assert (cfg.dataset.transform, cfg.dataset.image_size) == ("paper", 224)
    # The preset also overrides what the synthetic dataset config sets for itself (AdamW, 8 epochs).
    synthetic = compose_config(["experiment=paper", "dataset=synthetic"])
    assert synthetic.optim._target_ == "torch.optim.SGD" and synthetic.trainer.epochs == 40


@pytest.mark.parametrize(
    ("preset", "name", "expected"),
    [
        ("paper_twoway", "twoway", {"tp": 4.0, "tn": 1.0, "ways": "both", "margin": 0.0, "bucket_size": 128}),
        ("paper_softmax", "softmax", {"ways": "sample", "bucket_size": 128}),
        ("paper_bce", "bce", {"pos_weight": "freq", "reduction": "mean"}),
        ("paper_focal", "focal", {"gamma": 2.0, "alpha": None, "reduction": "mean"}),
        (
            "paper_asl",
            "asl",
            {"gamma_pos": 0.0, "gamma_neg": 4.0, "clip": 0.05, "detach_weight": True, "reduction": "sum"},
        ),
        ("paper_multisim", "multisim", {"tp": 4.0}),
        ("paper_joint", "joint", {"tp": 4.0, "tn": 1.0, "margin": 0.0, "bucket_size": 128}),
    ],
)
def test_loss_presets(preset, name, expected):
    cfg = compose_config([f"experiment={preset}", "dataset=coco"])
    loss = OmegaConf.to_container(cfg.loss, resolve=True)
    assert loss_name(loss) == name
    assert {key: loss[key] for key in expected} == expected
    assert cfg.trainer.batch_size == 512 and cfg.optim.lr_head == 0.01  # the protocol comes along
    instantiate(cfg.loss)  # the loss accepts its settings


def test_backbone_weights_exist_in_timm():
    assert set(PAPER_WEIGHTS.values()) <= set(timm.list_pretrained())
    assert {name.split(".")[0] for name in PAPER_WEIGHTS.values()} == {
        "resnet50",
        "resnext50_32x4d",
        "densenet169",
        "regnety_320",
    }


@pytest.mark.parametrize("table", TABLES)
def test_each_cell_has_exactly_one_run(table, job_configs):
    sweeps = table_sweeps(table)
    if table == "table7":
        # Six sweeps that differ only in the dataset (and its root); the MS-COCO one is composed below.
        assert [s.dataset for s in sweeps] == ["coco", "vispr", "vaw", "wider", "voc2007", "voc2012"]
        assert {tuple(o for o in s.overrides if not o.startswith("dataset=")) for s in sweeps} == {
            tuple(o for o in sweeps[0].overrides if not o.startswith("dataset="))
        }
        sweeps = sweeps[:1]
    spec = table_spec(table)
    runs = [run_attributes(job_configs(job), world_size=1) for s in sweeps for job in s.runs()]
    cells = [spec.cell_match(row, column) for row in spec.rows for column in spec.columns]
    cells = [wanted for wanted in cells if wanted["dataset"] == sweeps[0].dataset]  # all, but in Table 7
    for wanted in cells:
        assert sum(matches(run, wanted) for run in runs) == 1, wanted
    assert all(any(matches(run, wanted) for wanted in cells) for run in runs)
    expected = {
        "table1": (20, 40),
        "table2": (5, 10),
        "table3": (6, 12),
        "table4": (6, 12),
        "table5": (6, 12),
    }
    assert (len(runs), len(cells)) == expected.get(table, (20, 40))


@pytest.mark.slow
def test_table5_under_torchrun_gathers(job_configs):
    (sweep,) = table_sweeps("table5", nproc_per_node=4)
    spec = table_spec("table5")
    runs = [run_attributes(job_configs(job), world_size=4) for job in sweep.runs()]
    assert all(job_values(job)["loss.gather"] == "true" for job in sweep.runs())
    for column in spec.columns:
        assert sum(matches(run, spec.cell_match(spec.rows[0], column)) for run in runs) == 1
    assert "loss.gather=true" not in table_sweeps("table5", nproc_per_node=1)[0].overrides


@pytest.mark.parametrize("table", TABLES)
def test_smoke_sweep_is_two_cells_at_a_32th_of_the_batch(table, job_configs):
    (sweep,) = table_sweeps(table, smoke=True)
    jobs = sweep.runs()
    assert len(jobs) == 2
    spec = table_spec(table)
    cells = [spec.cell_match(row, column) for row in spec.rows for column in spec.columns]
    placed = set()
    for job in jobs:
        values = job_values(job)
        assert values["trainer.batch_size"] == "16" and values["dataset"] == "synthetic"
        config = job_configs(job)
        run = run_attributes(config, world_size=1)
        run.update({k: SMOKE_STAND_INS.get(run[k], run[k]) for k in ("dataset", "backbone")})
        hits = [i for i, wanted in enumerate(cells) if matches(run, wanted)]
        assert hits, job
        placed.add(tuple(hits))
    assert len(placed) == 2  # the two jobs fill different cells


def test_expand_is_the_product_of_comma_lists():
    jobs = expand(["+experiment=a,b", "loss.tp=1,2", "x=[1,2]", "++y=3"])
    assert jobs[0] == ["+experiment=a", "loss.tp=1", "x=[1,2]", "++y=3"]
    assert [job_values(job)["loss.tp"] for job in jobs] == ["1", "2", "1", "2"]
    assert len(jobs) == 4
    # A user's override appended after the table's replaces it.
    assert [job_values(j)["loss.tp"] for j in expand(["loss.tp=1,2,4", "loss.tp=3"])] == ["3"]


def test_roots_and_data_root():
    assert dataset_root("voc2007", Path("/data")) == Path("/data/voc")
    assert dataset_root("coco", Path("/d")) == Path("/d/coco")
    (sweep,) = table_sweeps("table1", roots={"coco": "/x/coco"}, data_root=Path("/data"))
    assert "dataset.root=/x/coco" in sweep.overrides
    table7 = table_sweeps("table7", data_root=Path("/data"))
    assert [o for s in table7 for o in s.overrides if o.startswith("dataset.root=")][
        -1
    ] == "dataset.root=/data/voc"


def test_gpu_hours_follow_the_stated_cost_model():
    # 40 epochs x (82,081 train + 40,137 test / 3) images at 1,200 images/s (V100, ResNet-50).
    coco = 40 * (82081 + 40137 / 3) / 1200 / 3600
    assert run_gpu_hours("coco", "resnet50", "v100") == pytest.approx(coco)
    assert run_gpu_hours("coco", "regnety_320", "v100") == pytest.approx(7 * coco)
    assert sweep_gpu_hours(table_sweeps("table1")) == pytest.approx(20 * coco)


def test_one_cost_formula_with_the_protocol_as_parameters():
    # An hour of V100 training is 1,200 x 3,600 images, of evaluation 3 times as many; a100 trains 2,600/s.
    assert gpu_hours(1200 * 3600, 0) == pytest.approx(1.0)
    assert gpu_hours(0, 3 * 1200 * 3600, "v100", cost=4.0) == pytest.approx(4.0)
    assert gpu_hours(2600 * 3600, 3 * 2600 * 3600, "a100") == pytest.approx(2.0)
    # A sweep's jobs are costed by the function it is given (a benchmark with its own protocol).
    seen = []
    assert sweep_gpu_hours(table_sweeps("table1"), "a100", lambda job, gpu: seen.append(gpu) or 0.5) == 10.0
    assert seen == ["a100"] * 20


def test_unknown_table():
    with pytest.raises(ReportError, match="unknown table 'table8'"):
        table_sweeps("table8")
