"""The field's recipes beside the paper's (configs/experiment/mldecoder_*.yaml): what they compose to, and
``mlcls-reproduce presets --dry-run``'s commands and cost."""

from __future__ import annotations

import pytest
from conftest import compose_config

from mlcls.cli import reproduce
from mlcls.engine.config_checks import check_config
from mlcls.inference import preprocess_spec


@pytest.mark.parametrize("preset", ["mldecoder_coco", "twoway_mldecoder_coco"])
def test_preset_is_ml_decoders_coco_recipe(preset):
    """Held to ML-Decoder's published COCO recipe, not to the YAML: its train.py and README (Ridnik et al.,
    2023) train TResNet-L (ImageNet-21k weights) at 448 px, batch 56, Adam at lr 1e-4 with weight decay 1e-4
    (none on norms and biases), OneCycle with pct_start 0.2, EMA 0.9997, fp16, CutoutPIL + RandAugment,
    inputs in [0, 1], ASL with gamma_neg 4, gamma_pos 0, clip 0.05, summed, for 40 epochs."""
    cfg = compose_config([f"experiment={preset}", "trainer.amp=none"])  # fp16 needs CUDA
    check_config(cfg, world_size=1)
    assert cfg.dataset.name == "coco" and cfg.dataset.image_size == 448
    # The recipe's augmentation, and its [0, 1] inputs: no mean/std normalisation, in predict and export too.
    assert cfg.dataset.transform == "strong"
    assert (list(cfg.dataset.mean), list(cfg.dataset.std)) == ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    spec = preprocess_spec(cfg.dataset)
    assert (spec["resize"], spec["crop"]) == ([448, 448], None)
    assert (spec["mean"], spec["std"]) == ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    assert (cfg.model.name, cfg.model.head.name, cfg.model.head.num_groups, cfg.model.head.embed_dim) == (
        "tresnet_v2_l.miil_in21k",
        "mldecoder",
        100,
        768,
    )
    optim = cfg.optim
    assert optim._target_ == "torch.optim.Adam"
    assert (optim.lr_head, optim.lr_backbone, optim.weight_decay) == (1e-4, 1e-4, 1e-4)
    assert (optim.norm_weight_decay, optim.bias_weight_decay) == (0.0, 0.0)
    assert cfg.sched._target_ == "mlcls.engine.optim.onecycle_schedule" and cfg.sched.pct_start == 0.2
    trainer = cfg.trainer
    assert (trainer.epochs, trainer.batch_size, trainer.ema_decay, trainer.ema_warmup) == (
        40,
        56,
        0.9997,
        False,
    )
    assert compose_config([f"experiment={preset}"]).trainer.amp == "fp16"
    if preset == "mldecoder_coco":
        expected = {
            "gamma_pos": 0.0,
            "gamma_neg": 4.0,
            "clip": 0.05,
            "detach_weight": True,
            "reduction": "sum",
        }
        assert cfg.loss._target_ == "mlcls.losses.AsymmetricLoss"
    else:  # the two-way loss at its defaults, no ASL key carried over
        expected = {"tp": 4.0, "tn": 1.0, "ways": "both", "bucket_size": None, "margin": 0.0, "gather": False}
        assert cfg.loss._target_ == "mlcls.losses.TwoWayLoss"
    assert {k: v for k, v in cfg.loss.items() if k != "_target_"} == expected


def test_dry_run_prints_both_presets_with_their_gpu_hours(capsys, tmp_path):
    assert (
        reproduce.main(["presets", "--dry-run", "--root", "coco=/data/c", "--sweep-dir", str(tmp_path)]) == 0
    )
    basis, *lines = capsys.readouterr().out.splitlines()
    assert basis.startswith("# GPU-hours at ResNet-50's 1,200 training images/s at 224 px")
    # 40 epochs x (82,081 train + 40,137 val / 3) COCO images at 1200 ResNet-50 images/s on a V100, times
    # TResNet-L's cost at 448 px measured on an H200, 4,596 / 556 ResNet-50 images/s: 7.3 hours
    hours = 40 * (82081 + 40137 / 3) / 1200 * (4596 / 556) / 3600
    assert round(hours) == 7
    assert lines[0] == (
        "# mldecoder_coco: ML-Decoder's COCO recipe: TResNet-L 448 px, ML-Decoder head, ASL; "
        f"1 run, about {hours:.0f} v100 GPU-hours (TResNet-L 448 px at 8.3x ResNet-50's cost, the ratio of "
        "rates measured on an H200)"
    )
    assert lines[1].startswith("mlcls-train -m experiment=mldecoder_coco dataset.root=/data/c ")
    assert lines[2].startswith("# twoway_mldecoder_coco: ") and lines[2].endswith(
        f"about {hours:.0f} v100 GPU-hours (TResNet-L 448 px at 8.3x ResNet-50's cost, the ratio of rates "
        "measured on an H200)"
    )
    assert lines[3].endswith(f"trainer.resume=auto hydra.sweep.dir={tmp_path}/twoway_mldecoder_coco")
    assert len(lines) == 4


def test_presets_have_no_smoke_version(capsys):
    assert reproduce.main(["presets", "--smoke"]) == 2
    assert "the presets have no smoke version" in capsys.readouterr().err
