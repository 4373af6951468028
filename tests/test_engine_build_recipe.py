"""ML-Decoder's recipe as its authors ran it: its TResNet-L (timm's ``tresnet_v2_l``) with the closest public
weights, the ``randaugment`` package's RandAugment behind ``dataset.transform=strong`` (timm's policy as
``strong_timm``), CSRA on a ViT's patch tokens only, and SyncBatchNorm under ``trainer.sync_bn``."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import randaugment
import randaugment.randaugment
import timm
import torch
from conftest import compose_config
from PIL import Image
from test_models_heads import reference_csra
from timm.data.auto_augment import RandAugment as TimmRandAugment
from torch import nn

from mlcls.data.pipeline.transforms import SQUASH_EVAL_KINDS, TRANSFORM_KINDS, build_transform
from mlcls.data.sampling import seeded_call
from mlcls.engine.build import sync_batchnorm
from mlcls.engine.config_checks import check_config
from mlcls.engine.distributed import DistInfo
from mlcls.errors import ConfigError
from mlcls.models import create_model

PRESETS = ["mldecoder_coco", "twoway_mldecoder_coco"]
SIZE = 40
STRONG_STEPS = ["Resize", "CutoutPIL", "RandAugment", "ToTensor", "Normalize"]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_is_ml_decoders_tresnet_l_with_the_in21k_weights(preset):
    """The preset names timm's ``tresnet_v2_l.miil_in21k`` (a tag timm lists), and timm builds ML-Decoder's
    TResNet-L from it: stages of [3, 4, 23, 3] blocks and 2,048 features (random weights, no download)."""
    cfg = compose_config([f"experiment={preset}"])
    assert cfg.model.name == "tresnet_v2_l.miil_in21k" and cfg.model.pretrained is True
    assert cfg.model.name in timm.list_pretrained("tresnet_v2*")
    backbone = timm.create_model(cfg.model.name, pretrained=False, num_classes=0, global_pool="")
    stages = [len(getattr(backbone.body, f"layer{i}")) for i in range(1, 5)]
    assert (stages, backbone.num_features) == ([3, 4, 23, 3], 2048)
    with torch.no_grad():
        features = backbone.eval().forward_features(torch.zeros(1, 3, 64, 64))
    assert features.shape == (1, 2048, 2, 2)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_turns_sync_bn_on_and_the_default_is_off(preset):
    cfg = compose_config([f"experiment={preset}", "trainer.amp=none"])
    check_config(cfg, world_size=4)
    assert cfg.trainer.sync_bn is True and cfg.trainer.loss_sum_scope == "global"
    assert compose_config([]).trainer.sync_bn is False
    with pytest.raises(ConfigError, match=r"^trainer.sync_bn='yes'; expected true or false$"):
        check_config(compose_config(["trainer.sync_bn=yes"]), world_size=1)


@pytest.mark.slow
def test_strong_randaugment_is_the_packages_byte_for_byte():
    """The RandAugment step of ``strong`` is the package's class, and under the per-sample seeding
    (``seeded_call``) it gives, image after image, the bytes the package's RandAugment gives when called
    directly (with the NumPy alias it was written for) after seeding Python's and NumPy's generators the
    same way; timm's policy gives others."""
    steps = build_transform("strong", SIZE, train=True).transforms
    assert [type(step).__name__ for step in steps] == STRONG_STEPS
    ours = steps[2]
    assert isinstance(ours, randaugment.RandAugment)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    timm_step = build_transform("strong_timm", SIZE, train=True).transforms[2]
    changed = differs_from_timm = 0
    for seed in range(60):
        out = seeded_call(seed, ours, image)
        with pytest.MonkeyPatch.context() as patch:  # the package as published, under NumPy < 1.24
            patch.setattr(randaugment.randaugment, "np", np)
            patch.setattr(np, "int", int, raising=False)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            reference = randaugment.RandAugment()(image)
        assert out.mode == reference.mode == "RGB" and out.tobytes() == reference.tobytes(), seed
        changed += out.tobytes() != image.tobytes()
        differs_from_timm += seeded_call(seed, timm_step, image).tobytes() != out.tobytes()
    assert changed > 20 and differs_from_timm > 20  # not a no-op, and not timm's policy


def test_the_packages_cutout_draws_from_numpys_generator_seeded_per_sample():
    """The package's Cutout operation draws its centre from NumPy's global generator: under
    ``seeded_call`` it is the same for a seed whatever NumPy held before, and moves with the seed."""
    policy = randaugment.randaugment.SubPolicy(1.0, "Cutout", 9, 0.0, "Invert", 1)
    grey = Image.new("RGB", (SIZE, SIZE), (50, 60, 70))
    first = seeded_call(3, policy, grey).tobytes()
    np.random.seed(12345)
    assert seeded_call(3, policy, grey).tobytes() == first != grey.tobytes()
    assert len({seeded_call(seed, policy, grey).tobytes() for seed in range(10)}) > 5


def test_strong_timm_keeps_timms_policy_and_is_listed_as_a_kind():
    assert TRANSFORM_KINDS[-2:] == ("strong", "strong_timm") and "strong_timm" in SQUASH_EVAL_KINDS
    steps = build_transform("strong_timm", SIZE, train=True).transforms
    assert [type(step).__name__ for step in steps] == STRONG_STEPS
    timm_policy = steps[2]
    assert isinstance(timm_policy, TimmRandAugment) and timm_policy.num_layers == 2
    assert len(timm_policy.ops) > 10
    assert all((op.magnitude, op.magnitude_std, op.prob) == (9, 0.5, 0.5) for op in timm_policy.ops)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    for kind in ("strong", "strong_timm"):
        out = build_transform(kind, SIZE, train=False, mean=[0, 0, 0], std=[1, 1, 1])(image)
        squashed = np.asarray(image.resize((SIZE, SIZE), Image.Resampling.BILINEAR), dtype=np.float32) / 255
        assert torch.equal(out, torch.from_numpy(squashed).permute(2, 0, 1))
    dataset = compose_config(["dataset=synthetic", "dataset.transform=strong_timm"]).dataset
    assert dataset.transform == "strong_timm"


@pytest.mark.parametrize("num_heads", [1, 2])
def test_csra_on_a_vit_sees_the_patch_tokens_only(num_heads):
    """On timm's ``test_vit`` (random weights) the head is given N - num_prefix_tokens tokens, and the
    model's logits equal a float64 CSRA of the patch tokens of the backbone's output."""
    torch.manual_seed(0)
    model = create_model("test_vit", 3, pretrained=False, head="csra", num_heads=num_heads, lam=0.3)
    prefix = model.backbone.num_prefix_tokens
    assert prefix >= 1
    size = model.backbone.pretrained_cfg["input_size"][1]
    images = torch.randn(2, 3, size, size)
    seen: list[torch.Size] = []
    model.head.register_forward_hook(lambda module, args, output: seen.append(args[0].shape))
    model.eval()
    with torch.no_grad():
        tokens = model.backbone.forward_features(images)
        logits = model(images)
    assert seen == [torch.Size([2, tokens.shape[1] - prefix, tokens.shape[2]])]
    patches = tokens[:, prefix:].transpose(1, 2)  # (B, D, N - prefix)
    weights = [head.head.weight.detach() for head in model.head.multi_head]
    temperatures = [head.temperature for head in model.head.multi_head]
    expected = reference_csra(weights, temperatures, 0.3, patches)
    torch.testing.assert_close(logits.double(), expected, atol=1e-5, rtol=1e-5)
    everything = reference_csra(weights, temperatures, 0.3, tokens.transpose(1, 2))
    assert not torch.allclose(logits.double(), everything, atol=1e-3)  # the class token would change them


def test_csra_on_a_cnn_map_and_mldecoder_on_tokens_drop_nothing():
    cnn = create_model("resnet10t", 3, pretrained=False, head="csra")
    vit = create_model("test_vit", 3, pretrained=False, head="mldecoder", num_groups=3)
    assert (cnn.num_prefix_tokens, vit.num_prefix_tokens) == (0, 0)


def _bn_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2)
    )


def test_sync_bn_converts_batchnorm_on_cuda_processes_only(caplog):
    """Several CUDA processes: every BatchNorm becomes a SyncBatchNorm holding the same parameters and
    buffers under the same keys. One process: nothing changes. Several CPU processes (gloo): nothing
    changes, since torch's SyncBatchNorm refuses CPU tensors (tests/test_engine_build_loss_ddp.py), and one
    line of rank 0 says so."""
    torch.manual_seed(0)
    model = _bn_model()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    cuda = DistInfo(rank=0, world_size=2, device=torch.device("cuda", 0))
    converted = sync_batchnorm(model, cuda)
    norms = [module for module in converted.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    assert [type(module) for module in norms] == [nn.SyncBatchNorm, nn.SyncBatchNorm]
    assert converted.state_dict().keys() == state.keys()
    assert all(torch.equal(converted.state_dict()[key], value) for key, value in state.items())

    single = _bn_model()
    assert sync_batchnorm(single, DistInfo(0, 1, torch.device("cuda", 0))) is single
    cpu = _bn_model()
    with caplog.at_level(logging.INFO, logger="mlcls"):
        kept = sync_batchnorm(cpu, DistInfo(0, 2, torch.device("cpu")))
        assert sync_batchnorm(cpu, DistInfo(1, 2, torch.device("cpu"))) is cpu  # rank 1: no second line
    assert kept is cpu and not any(isinstance(m, nn.SyncBatchNorm) for m in kept.modules())
    lines = [record.getMessage() for record in caplog.records if "sync_bn" in record.getMessage()]
    assert lines == [
        "trainer.sync_bn: SyncBatchNorm needs CUDA devices; on the cpu each of the 2 processes keeps "
        "BatchNorm over its own share of the batch"
    ]


def test_loss_sum_scope_is_global_but_for_the_papers_asl_preset():
    """A summed loss is scaled to the global batch (tests/test_engine_build_loss_ddp.py), except in
    ``paper_asl``, which keeps the per-process sum of the paper's 4 GPUs; an unknown scope is a one-line
    error."""
    assert compose_config([]).trainer.loss_sum_scope == "global"
    paper_asl = compose_config(["experiment=paper_asl"])
    assert (paper_asl.loss.reduction, paper_asl.trainer.loss_sum_scope) == ("sum", "process")
    with pytest.raises(
        ConfigError, match=r"^trainer.loss_sum_scope='rank'; expected one of global, process$"
    ):
        check_config(compose_config(["trainer.loss_sum_scope=rank"]), world_size=1)
