"""Parameter groups (head/backbone x decay kind), the optimizer as a Hydra partial, the cosine schedule."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
import timm
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf
from torch import nn

from mlcls import config_dir
from mlcls.engine.build import build_optimization
from mlcls.engine.config_checks import check_config
from mlcls.engine.optim import build_optimizer, build_scheduler, group_lrs, parameter_groups
from mlcls.engine.state import CheckpointError, check_optimizer
from mlcls.errors import ConfigError
from mlcls.models import create_model

# resnet10t's normalisation layers, read off its parameter names: the deep stem's BatchNorms (conv1.1,
# conv1.4), bn1, each block's bn1/bn2 and the BatchNorm of each downsample branch (downsample.2).
RESNET10T_NORM = re.compile(r"^(conv1\.[14]|bn1|layer\d\.\d\.(bn\d|downsample\.2))\.(weight|bias)$")


def optim_config(name: str, **overrides) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(config_dir() / "optim" / f"{name}.yaml"))
    return {**cfg, **overrides}


def sched_config(**overrides) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(config_dir() / "sched" / "cosine.yaml")), **overrides}


@pytest.fixture
def resnet10t() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("resnet10t", pretrained=False, num_classes=5)


def names_of(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_null_norm_and_bias_decay_make_the_two_paper_groups(resnet10t):
    optimizer = build_optimizer(optim_config("sgd"), resnet10t)
    assert isinstance(optimizer, torch.optim.SGD)
    groups = optimizer.param_groups
    assert [g["name"] for g in groups] == ["head", "backbone"]
    assert names_of(resnet10t, groups[0]["params"]) == {"fc.weight", "fc.bias"}
    every = [name for name, _ in resnet10t.named_parameters()]
    assert [n for n in every if n.startswith("fc.")] + [n for n in every if not n.startswith("fc.")] == [
        name for g in groups for name, p in resnet10t.named_parameters() if any(p is q for q in g["params"])
    ]  # model order within each group
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.01, 1e-4), (0.001, 1e-4)]
    assert (groups[0]["momentum"], groups[0]["nesterov"]) == (0.9, True)
    assert group_lrs(optimizer) == {"head": 0.01, "backbone": 0.001}


def test_resnet10t_groups_by_part_and_decay_kind(resnet10t):
    cfg = optim_config("sgd", norm_weight_decay=0.0, bias_weight_decay=0.5)
    groups = {g["name"]: g for g in build_optimizer(cfg, resnet10t).param_groups}
    assert list(groups) == ["head", "head_bias", "backbone", "backbone_norm"]  # no empty groups
    every = {name for name, _ in resnet10t.named_parameters()}
    norm = {name for name in every if RESNET10T_NORM.match(name)}
    assert len(norm) == 28  # 14 BatchNorms: 2 in the stem, bn1, 2 per block x 4, 3 downsamples
    assert names_of(resnet10t, groups["backbone_norm"]["params"]) == norm
    assert names_of(resnet10t, groups["head"]["params"]) == {"fc.weight"}
    assert names_of(resnet10t, groups["head_bias"]["params"]) == {"fc.bias"}
    assert names_of(resnet10t, groups["backbone"]["params"]) == every - norm - {"fc.weight", "fc.bias"}
    assert len(groups["backbone"]["params"]) == 14  # the convolutions, without bias
    decays = {name: g["weight_decay"] for name, g in groups.items()}
    assert decays == {"head": 1e-4, "head_bias": 0.5, "backbone": 1e-4, "backbone_norm": 0.0}
    lrs = {name: g["lr"] for name, g in groups.items()}
    assert lrs == {"head": 0.01, "head_bias": 0.01, "backbone": 0.001, "backbone_norm": 0.001}


class NormZoo(nn.Module):
    """Convolution biases, a LayerNorm, and timm norm layers that subclass no torch norm (RmsNorm,
    EvoNorm), a layer-scale vector (decayed as a weight) and a linear classifier. The model's own name
    contains "Norm" and it owns a 1-D parameter: it is no norm layer all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.evo = timm.layers.EvoNorm2dS0(4, group_size=2)
        self.rms = timm.layers.RmsNorm(4)
        self.ln = nn.LayerNorm(4)
        self.gamma = nn.Parameter(torch.ones(4))
        self.fc = nn.Linear(4, 2)

    def get_classifier(self) -> nn.Module:
        return self.fc


def test_timm_norm_layers_and_biases_are_recognised():
    model = NormZoo()
    cfg = optim_config("adamw", norm_weight_decay=0.0, bias_weight_decay=0.0)
    groups = {g["name"]: names_of(model, g["params"]) for g in build_optimizer(cfg, model).param_groups}
    evo = {f"evo.{name}" for name, _ in model.evo.named_parameters()}
    assert len(evo) == 3  # weight, bias, v
    assert groups == {
        "head": {"fc.weight"},
        "head_norm_bias": {"fc.bias"},
        "backbone": {"conv.weight", "gamma"},
        "backbone_norm_bias": {"conv.bias", "rms.weight", "ln.weight", "ln.bias", *evo},
    }


@pytest.mark.slow
def test_null_decays_step_like_torch_sgd_with_two_groups(resnet10t):
    reference = timm.create_model("resnet10t", pretrained=False, num_classes=5)
    reference.load_state_dict(resnet10t.state_dict())
    ours = build_optimizer(optim_config("sgd", weight_decay=0.05), resnet10t)
    head = list(reference.fc.parameters())
    rest = [p for name, p in reference.named_parameters() if not name.startswith("fc.")]
    theirs = torch.optim.SGD(
        [{"params": head, "lr": 0.01}, {"params": rest, "lr": 0.001}],
        momentum=0.9,
        nesterov=True,
        weight_decay=0.05,
        fused=True,
    )
    images = torch.randn(4, 3, 32, 32)
    for model, optimizer in ((resnet10t, ours), (reference, theirs)):
        for _ in range(3):
            optimizer.zero_grad()
            model(images).square().mean().backward()
            optimizer.step()
    for (name, p), q in zip(resnet10t.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_zero_norm_and_bias_decay_exempts_them_from_adamw_decay(resnet10t):
    cfg = optim_config("adamw", lr_head=0.1, lr_backbone=0.1, weight_decay=0.5)
    cfg.update(norm_weight_decay=0.0, bias_weight_decay=0.0)
    before = {name: p.detach().clone() for name, p in resnet10t.named_parameters()}
    optimizer = build_optimizer(cfg, resnet10t)
    for p in resnet10t.parameters():
        p.grad = torch.zeros_like(p)  # Adam's term is 0: only the decoupled decay p <- p (1 - lr wd) remains
    optimizer.step()
    for name, p in resnet10t.named_parameters():
        exempt = RESNET10T_NORM.match(name) or name == "fc.bias"
        expected = before[name] if exempt else before[name] * (1 - 0.1 * 0.5)
        torch.testing.assert_close(p.detach(), expected, msg=name)


def test_any_torch_optimizer_with_its_own_keywords(resnet10t):
    cfg = optim_config("adamw", _target_="torch.optim.RMSprop", alpha=0.95)
    del cfg["betas"], cfg["fused"]  # keywords RMSprop does not take
    optimizer = build_optimizer(cfg, resnet10t)
    assert isinstance(optimizer, torch.optim.RMSprop)
    assert optimizer.defaults["alpha"] == 0.95
    assert not {"lr_head", "lr_backbone", "norm_weight_decay"} & set(optimizer.defaults)


def paper_cosine_lr(
    base_lr: float, iteration: int, total: int, warmup: int, floor: float, held: int = 0
) -> float:
    """The per-iteration cosine decay in float64, after a linear warm-up from base_lr / warmup and ``held``
    iterations at base_lr."""
    if iteration < warmup:
        return base_lr * (iteration + 1) / warmup
    start = warmup + held
    if iteration < start:
        return base_lr
    t = np.float64(min(iteration - start, total - start)) / np.float64(total - start)
    return float(base_lr * (floor + (1 - floor) * (1 + np.cos(np.pi * t)) / 2))


@pytest.mark.parametrize(
    ("warmup", "floor", "decay_start", "held"), [(0, 0.0, 0.0, 0), (5, 0.1, 0.0, 0), (5, 0.1, 0.75, 26)]
)
def test_cosine_schedule_follows_the_per_iteration_formula(resnet10t, warmup, floor, decay_start, held):
    """``held``: the iterations at the full rate, three quarters of the 35 after the warm-up."""
    optimizer = build_optimizer(optim_config("sgd", norm_weight_decay=0.0), resnet10t)
    total = 40
    cfg = sched_config(
        warmup_epochs=warmup, min_lr_ratio=floor, decay_start=decay_start
    )  # one iteration per epoch: epochs = iterations
    scheduler = build_scheduler(cfg, optimizer, total)
    for iteration in range(total + 3):  # past the end the lr stays at the floor
        lrs = group_lrs(optimizer)
        for part, base in (("head", 0.01), ("backbone", 0.001)):
            assert math.isclose(
                lrs[part], paper_cosine_lr(base, iteration, total, warmup, floor, held), rel_tol=1e-12
            )
        assert len({g["lr"] for g in optimizer.param_groups if g["name"].startswith("backbone")}) == 1
        optimizer.step()
        scheduler.step()


@pytest.mark.parametrize(
    ("warmup_epochs", "head_warmup_epochs", "iters_per_epoch", "warmup"),
    [(1.5, 0, 4, 6), (0.3, 1, 5, 2), (None, 0, 4, 0), (None, 1, 4, 4), (None, 0.5, 5, 2), (0, 1, 4, 0)],
)
def test_warmup_epochs_count_in_iterations_the_heads_where_null(
    resnet10t, warmup_epochs, head_warmup_epochs, iters_per_epoch, warmup
):
    optimizer = build_optimizer(optim_config("sgd"), resnet10t)
    cfg = sched_config(warmup_epochs=warmup_epochs)
    total = 40
    scheduler = build_scheduler(cfg, optimizer, total, iters_per_epoch, head_warmup_epochs)
    for iteration in range(total):
        assert math.isclose(
            group_lrs(optimizer)["head"], paper_cosine_lr(0.01, iteration, total, warmup, 0.0), rel_tol=1e-12
        )
        optimizer.step()
        scheduler.step()


def test_a_state_without_group_names_is_refused_in_one_line(resnet10t):
    """Every optimizer this version builds names its groups; a state without names is no run's."""
    state = build_optimizer(optim_config("sgd"), resnet10t).state_dict()
    for group in state["param_groups"]:
        del group["name"]
    with pytest.raises(
        CheckpointError, match=r"^optimizer param_groups\[0\] lacks name; expected this run's \d+ entries$"
    ):
        check_optimizer(state, build_optimizer(optim_config("sgd"), resnet10t))


def test_a_state_with_other_groups_is_refused_in_one_line(resnet10t):
    state = build_optimizer(optim_config("sgd"), resnet10t).state_dict()
    split = build_optimizer(optim_config("sgd", norm_weight_decay=0.0), resnet10t)
    with pytest.raises(
        CheckpointError,
        match=r"^optimizer param_groups holds a list of 2 items; expected 3 groups, this run's \(resume with "
        r"the run's model and optim\.\*_weight_decay settings\)$",
    ):
        check_optimizer(state, split)


def test_demo_adamw_exempts_norm_and_bias_and_the_paper_keeps_one_decay():
    demo = compose_config([])
    assert demo.optim._target_ == "torch.optim.AdamW"
    assert (demo.optim.norm_weight_decay, demo.optim.bias_weight_decay) == (0.0, 0.0)
    paper = compose_config(["experiment=paper", "dataset=synthetic"])
    assert paper.optim._target_ == "torch.optim.SGD"
    assert (paper.optim.norm_weight_decay, paper.optim.bias_weight_decay) == (None, None)
    with_adamw = compose_config(["experiment=paper", "dataset=coco", "optim=adamw", "trainer.amp=none"])
    check_config(with_adamw, world_size=1)  # the paper's block carries no SGD-only keyword


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lr_head=-1"], "optim.lr_head=-1; expected a number >= 0"),
        (["optim.norm_weight_decay=-1"], "optim.norm_weight_decay=-1; expected a number >= 0, or null"),
        (["optim.weight_decay=null"], "optim.weight_decay=None; expected a number >= 0"),
        (["optim._partial_=false"], "optim._partial_ must be true"),
        (["optim._target_=torch.optim.SDG"], "optim._target_=torch.optim.SDG: No module named"),
        (["++optim.momentum=0.9"], "AdamW.__init__() got an unexpected keyword argument 'momentum'"),
        (["optim.betas.1=1.5"], "Invalid beta parameter at index 1: 1.5"),
        (["optim._target_=torch.nn.Identity", "~optim.betas"], "is not a torch optimizer class"),
        (["sched.warmup_epochs=-3"], "sched.warmup_epochs=-3; expected a number >= 0"),
        (["sched.min_lr_ratio=2"], "min_lr_ratio=2; expected a number in [0, 1]"),
        (["sched.decay_start=-0.5"], "decay_start=-0.5; expected a number in [0, 1]"),
        (["sched=onecycle", "sched.pct_start=1.5"], "pct_start=1.5; expected a number in (0, 1)"),
    ],
)
def test_optimization_config_errors(overrides, message, resnet10t):
    """Checked where the optimizer and the schedule are built (old: on a dummy parameter in the config check,
    then again on the model)."""
    cfg = compose_config([*TINY, *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        build_optimization(cfg, resnet10t, 4)
    assert "\n" not in str(error.value)


def onecycle_config(**overrides) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(config_dir() / "sched" / "onecycle.yaml")), **overrides}


def test_onecycle_steps_like_torch_onecyclelr_per_group_and_resumes_exactly(resnet10t):
    """The lrs of each group against torch's OneCycleLR on a plain two-group Adam, every iteration, and a
    schedule rebuilt from a state dict halfway goes on with the same values."""
    cfg = optim_config("adamw", lr_head=1e-3, lr_backbone=1e-4, fused=False)
    optimizer = build_optimizer(cfg, resnet10t)
    total = 30
    scheduler = build_scheduler(onecycle_config(pct_start=0.2), optimizer, total)
    reference_optimizer = torch.optim.AdamW(
        [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in (1e-3, 1e-4)]
    )
    reference = torch.optim.lr_scheduler.OneCycleLR(
        reference_optimizer, max_lr=[1e-3, 1e-4], total_steps=total, pct_start=0.2
    )
    peak = round(0.2 * total) - 1  # torch's end of the warm-up phase: float(pct_start * total) - 1
    for iteration in range(total):
        expected = [g["lr"] for g in reference_optimizer.param_groups]
        lrs = group_lrs(optimizer)
        assert math.isclose(lrs["head"], expected[0], rel_tol=1e-12)
        assert math.isclose(lrs["backbone"], expected[1], rel_tol=1e-12)
        if iteration == 0:
            assert math.isclose(lrs["head"], 1e-3 / 25, rel_tol=1e-12)
        if iteration == peak:
            assert math.isclose(lrs["head"], 1e-3, rel_tol=1e-12)
        if iteration == total - 1:
            assert math.isclose(lrs["head"], 1e-3 / 25 / 1e4, rel_tol=1e-9)
        if iteration == total // 2:
            resumed = build_optimizer(cfg, resnet10t)  # built as the trainer does, then loaded
            resumed_scheduler = build_scheduler(onecycle_config(pct_start=0.2), resumed, total)
            resumed.load_state_dict(optimizer.state_dict())
            resumed_scheduler.load_state_dict(scheduler.state_dict())
            optimizer, scheduler = resumed, resumed_scheduler
        optimizer.step()
        scheduler.step()
        reference_optimizer.step()
        reference.step()


def test_mldecoder_recipe_decays_exactly_the_parameters_its_release_decays():
    """ML-Decoder's train.py decays every parameter but the 1-D ones (biases, norms; the head's
    ``duplicate_pooling_bias`` too); the fixed queries are in no group."""
    torch.manual_seed(0)
    model = create_model("resnet10t", 5, pretrained=False, head="mldecoder", num_groups=3)
    cfg = compose_config(["experiment=mldecoder_coco"]).optim
    groups = parameter_groups(model, cfg)
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay) == len(trainable) == len(list(model.parameters())) - 1  # all but the queries
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert decay[id(param)] == (0.0 if param.ndim == 1 else 1e-4), name
    assert [g["name"] for g in groups] == ["head", "head_norm_bias", "backbone", "backbone_norm_bias"]


# ------------------------------------------------------------------------------------ a short run says so
def note_lines(caplog, cfg, model: nn.Module, iters_per_epoch: int) -> list[str]:
    """The lines of the short-run note that building ``cfg``'s optimization logs."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        build_optimization(cfg, model, iters_per_epoch)
    return [record.getMessage() for record in caplog.records if "experiment=finetune" in record.getMessage()]


def test_a_short_default_run_says_what_its_decay_costs_and_the_fine_tune_recipe_does_not(caplog, resnet10t):
    """The tiny default run (2 epochs of 6 iterations) is told in one line the share of a constant rate's
    learning its cosine gives (the reference: the mean of the float64 formula); experiment=finetune's
    schedule over the same iterations holds its rate and is not told."""
    default = compose_config(TINY)
    lines = note_lines(caplog, default, resnet10t, 6)
    share = np.mean([paper_cosine_lr(1.0, iteration, 12, 0, 0.0) for iteration in range(12)])
    assert len(lines) == 1 and f"gives {share:.0%} of the learning of a constant rate" in lines[0], lines
    assert "over this run's 12 iterations" in lines[0]
    assert note_lines(caplog, compose_config([*TINY, "experiment=finetune"]), resnet10t, 6) == []
    long_run = compose_config([*TINY, "trainer.epochs=200"])  # 1,200 iterations: no longer short
    assert note_lines(caplog, long_run, resnet10t, 6) == []


# The presets that reproduce a published protocol, each with the iterations per epoch of the smallest dataset
# it is run on: VOC 2007's 5,011 training images in batches of 512 (the paper's tables), 16 (the
# single-positive benchmark); MS-COCO's 82,081 in batches of 56 (ML-Decoder's recipe).
PUBLISHED = {
    **{f"paper_{loss}": 10 for loss in ("asl", "bce", "focal", "joint", "multisim", "softmax", "twoway")},
    "paper": 10,
    "spml_an": 314,
    "mldecoder_coco": 1466,
    "twoway_mldecoder_coco": 1466,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_published_presets_are_not_told(caplog, resnet10t, preset):
    """The paper's presets decay to zero over 400 iterations on VOC 2007 and run as published (their protocol
    block); without it the line would come. ML-Decoder's recipe on MS-COCO is long."""
    cfg = compose_config([f"experiment={preset}"])
    assert note_lines(caplog, cfg, resnet10t, PUBLISHED[preset]) == []
    if preset == "paper":
        OmegaConf.set_struct(cfg, False)
        del cfg["protocol"]
        assert len(note_lines(caplog, cfg, resnet10t, PUBLISHED[preset])) == 1


# ------------------------------------------------------------------------------------- experiment=finetune
def config_names(group: str) -> list[str]:
    return sorted(path.stem for path in (config_dir() / group).glob("*.yaml") if path.stem != "base")


def test_finetune_composes_with_every_dataset_head_and_loss():
    """experiment=finetune beside each dataset (13 compositions), the heads and losses taken in turn, each
    passing the config check with the recipe's schedule, rates and augmentation; a zero-shot dataset with a
    text-query head, EPR and ROLE with the expected positives they need whatever the recipe. The losses left
    out are configs of their own group alone (no ``@package _global_``), which the recipe cannot meet."""
    datasets, heads, losses = config_names("dataset"), config_names("model/head"), config_names("loss")
    for loss in losses:
        assert "_global_" not in (config_dir() / "loss" / f"{loss}.yaml").read_text(), loss
    text_heads = [head for head in heads if head in ("cosine", "mldecoder_zsl")]
    for index, dataset in enumerate(datasets):
        loss = losses[(index * 3) % len(losses)]
        head = text_heads[index % 2] if dataset.endswith("_zsl") else heads[index % len(heads)]
        extra = ["loss.expected_positives=2"] if loss in ("epr", "role") else []
        overrides = [
            "experiment=finetune",
            f"dataset={dataset}",
            f"model/head={head}",
            f"loss={loss}",
            *extra,
        ]
        cfg = compose_config(overrides)
        check_config(cfg, world_size=1)
        assert (cfg.sched.decay_start, cfg.optim.lr_head, cfg.optim.lr_backbone) == (0.75, 1e-3, 1e-4), (
            overrides
        )
        assert (cfg.dataset.transform, cfg.model.classifier_init, cfg.model.head.name) == (
            "crop",
            "torch",
            head,
        )
