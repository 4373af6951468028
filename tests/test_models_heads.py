"""Heads (mlcls/models/heads): the released state-dict names and shapes, float64 references of the equations,
gradients, memory at Open Images' 9,605 classes, the timm integration, and train -> ONNX export = predict."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import TINY, TINY_RESNET10T, compose_config

import mlcls
from mlcls.models import create_model, split_parameters
from mlcls.models.heads import CSRA, MLDecoder


# The released ML_Decoder ``MLDecoder``'s state dict for D input channels, C classes, G queries, duplicate
# factor K (E = 768, feed-forward 2048), written out from its structure.
def released_mldecoder_shapes(in_features: int, groups: int, factor: int, classes: int) -> dict:
    layer = "decoder.layers.0."
    return {
        "decoder.duplicate_pooling": (groups, 768, factor),
        "decoder.duplicate_pooling_bias": (classes,),
        layer + "multihead_attn.in_proj_weight": (3 * 768, 768),
        layer + "multihead_attn.in_proj_bias": (3 * 768,),
        layer + "multihead_attn.out_proj.weight": (768, 768),
        layer + "multihead_attn.out_proj.bias": (768,),
        layer + "linear1.weight": (2048, 768),
        layer + "linear1.bias": (2048,),
        layer + "linear2.weight": (768, 2048),
        layer + "linear2.bias": (768,),
        **{layer + f"norm{i}.{p}": (768,) for i in (1, 2, 3) for p in ("weight", "bias")},
        "decoder.embed_standart.weight": (768, in_features),
        "decoder.embed_standart.bias": (768,),
        "decoder.query_embed.weight": (groups, 768),
    }


def shapes(module: torch.nn.Module) -> dict:
    return {key: tuple(value.shape) for key, value in module.state_dict().items()}


@pytest.mark.parametrize(
    ("classes", "groups", "expected_groups", "factor"),
    [(80, 100, 80, 1), (9605, 100, 100, 97), (20, 8, 8, 3)],
)
def test_mldecoder_state_dict_is_the_released_one(classes, groups, expected_groups, factor):
    head = MLDecoder(64, classes, num_groups=groups)
    assert shapes(head) == released_mldecoder_shapes(64, expected_groups, factor, classes)
    # theirs into ours: a state dict under the released names loads strictly and is used
    released = {
        key: torch.randn(shape)
        for key, shape in released_mldecoder_shapes(64, expected_groups, factor, classes).items()
    }
    head.load_state_dict(released, strict=True)
    torch.testing.assert_close(head.decoder.duplicate_pooling, released["decoder.duplicate_pooling"])


def reference_mldecoder(head: MLDecoder, features: torch.Tensor) -> torch.Tensor:
    """ML-Decoder in float64 from its equations (eval mode: dropout is the identity), per sample."""
    p = {key: value.double() for key, value in head.state_dict().items()}
    layer, heads = "decoder.layers.0.", 8
    out = []
    for x in features.double():  # (D, H, W)
        memory = F.relu(
            x.flatten(1).T @ p["decoder.embed_standart.weight"].T + p["decoder.embed_standart.bias"]
        )
        query = p["decoder.query_embed.weight"]  # (G, E)
        t = F.layer_norm(2 * query, (768,), p[layer + "norm1.weight"], p[layer + "norm1.bias"])
        w, b = p[layer + "multihead_attn.in_proj_weight"], p[layer + "multihead_attn.in_proj_bias"]
        q, k, v = (
            t @ w[:768].T + b[:768],
            memory @ w[768:1536].T + b[768:1536],
            memory @ w[1536:].T + b[1536:],
        )
        dh = 768 // heads
        attended = torch.cat(
            [
                torch.softmax(
                    q[:, i * dh : (i + 1) * dh] @ k[:, i * dh : (i + 1) * dh].T / math.sqrt(dh), dim=1
                )
                @ v[:, i * dh : (i + 1) * dh]
                for i in range(heads)
            ],
            dim=1,
        )
        attended = (
            attended @ p[layer + "multihead_attn.out_proj.weight"].T
            + p[layer + "multihead_attn.out_proj.bias"]
        )
        t = F.layer_norm(t + attended, (768,), p[layer + "norm2.weight"], p[layer + "norm2.bias"])
        hidden = F.relu(t @ p[layer + "linear1.weight"].T + p[layer + "linear1.bias"])
        fed = hidden @ p[layer + "linear2.weight"].T + p[layer + "linear2.bias"]
        t = F.layer_norm(t + fed, (768,), p[layer + "norm3.weight"], p[layer + "norm3.bias"])
        pooling = p["decoder.duplicate_pooling"]  # (G, E, K)
        grouped = torch.stack([t[g] @ pooling[g] for g in range(pooling.shape[0])])  # (G, K)
        classes = p["decoder.duplicate_pooling_bias"].numel()
        out.append(grouped.flatten()[:classes] + p["decoder.duplicate_pooling_bias"])
    return torch.stack(out)


@pytest.mark.parametrize("training", [False, True])
def test_mldecoder_matches_its_equations_for_maps_and_tokens(training):
    """In eval mode (torch's fused attention without gradients), and in training mode with gradients (its
    other code path) at dropout 0, where the reference needs no random masks."""
    torch.manual_seed(0)
    # K = 5: the last group's 2 surplus outputs are cut
    head = MLDecoder(32, 23, num_groups=5, dropout=0.0 if training else 0.1).train(training)
    with torch.no_grad():
        head.decoder.duplicate_pooling_bias.normal_()
    features = torch.randn(3, 32, 4, 5)
    with torch.set_grad_enabled(training):
        logits = head(features)
        tokens = head(features.flatten(2).transpose(1, 2))
    assert logits.shape == (3, 23) and logits.requires_grad == training
    torch.testing.assert_close(
        logits.detach().double(), reference_mldecoder(head, features), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(tokens, logits, atol=0, rtol=0)


def test_mldecoder_dropout_acts_in_training_only():
    torch.manual_seed(0)
    head = MLDecoder(16, 6, num_groups=3)
    features = torch.randn(2, 16, 3, 3)
    with torch.no_grad():
        evaluated = head.eval()(features)
        trained = [head.train()(features) for _ in range(2)]
    torch.testing.assert_close(head.eval()(features), evaluated, atol=0, rtol=0)
    assert not torch.allclose(trained[0], trained[1]) and not torch.allclose(trained[0], evaluated)


def test_mldecoder_initialisation_is_the_released_one():
    """duplicate_pooling (G, E, K) ~ xavier_normal_: N(0, 2 / (fan_in + fan_out)), torch's fans of a 3-d
    tensor being E K and G K; bias zero; fixed queries N(0, 1) (nn.Embedding's default)."""
    torch.manual_seed(0)
    groups, factor, width = 50, 4, 768
    decoder = MLDecoder(8, 197, num_groups=groups).decoder  # K = ceil(197 / 50) = 4
    pooling = decoder.duplicate_pooling
    assert pooling.shape == (groups, width, factor)
    expected_std = math.sqrt(2.0 / (width * factor + groups * factor))
    assert abs(pooling.mean().item()) < 0.01 * expected_std  # 4 standard errors
    assert abs(pooling.std().item() / expected_std - 1.0) < 0.02  # 153,600 samples: std error 0.2 %
    assert pooling.abs().max() > 3.5 * expected_std  # normal, not uniform (bounded by sqrt(3) std)
    assert torch.equal(decoder.duplicate_pooling_bias, torch.zeros(197))
    queries = decoder.query_embed.weight
    assert not queries.requires_grad and abs(queries.std().item() - 1.0) < 0.03


def test_mldecoder_queries_stay_fixed_and_every_other_parameter_learns():
    torch.manual_seed(0)
    head = MLDecoder(16, 7, num_groups=3)
    head(torch.randn(2, 16, 3, 3)).square().sum().backward()
    for name, param in head.named_parameters():
        if name == "decoder.query_embed.weight":
            assert not param.requires_grad and param.grad is None
        else:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def saved_activation_bytes(module: torch.nn.Module, features: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of ``module(features).sum()`` (each
    storage once): the training memory of the head beyond its parameters and the input."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(features).sum().backward()
    inputs_and_params = {features.untyped_storage().data_ptr()} | {
        p.untyped_storage().data_ptr() for p in module.parameters()
    }
    return sum(size for pointer, size in storages.items() if pointer not in inputs_and_params)


@pytest.mark.slow  # over 2 s of the fast run's time
def test_mldecoder_at_open_images_scale_is_leaner_than_the_linear_head():
    """C = 9,605 on ResNet-50's 2048 x 14 x 14 map (448 px), batch 8: 14.5 M parameters (58 MB), fewer than
    the linear head's 19.7 M, and under 100 MB of activations kept for the backward pass, within 1 MB of
    the same decoder at C = 100: its training memory does not grow with the class count."""
    classes, channels = 9605, 2048
    head = MLDecoder(channels, classes)
    expected = (
        channels * 768
        + 768  # embed_standart
        + 100 * 768  # queries
        + 3 * 768 * 768
        + 3 * 768
        + 768 * 768
        + 768  # cross-attention
        + 768 * 2048
        + 2048
        + 2048 * 768
        + 768  # feed-forward
        + 3 * 2 * 768  # norms
        + 100 * 768 * 97
        + classes  # group fully-connected
    )
    count = sum(p.numel() for p in head.parameters())
    assert count == expected and count < channels * classes + classes
    features = torch.randn(8, channels, 14, 14, requires_grad=True)
    activation_bytes = saved_activation_bytes(head, features)
    assert activation_bytes < 100e6, activation_bytes
    assert abs(activation_bytes - saved_activation_bytes(MLDecoder(channels, 100), features)) < 1e6


def reference_csra(weights: list[torch.Tensor], temperatures: list, lam: float, features: torch.Tensor):
    """CSRA in float64 with loops over samples, classes and positions: sum over heads of
    mean_p s(p) + lam * (max_p s(p) or sum_p softmax(T s)(p) s(p)), s(p) = w_c . x_p / ||w_c||."""
    batch, channels = features.shape[:2]
    x = features.double().reshape(batch, channels, -1)
    out = torch.zeros(batch, weights[0].shape[0], dtype=torch.float64)
    for weight, temperature in zip(weights, temperatures, strict=True):
        w = weight.double().reshape(weight.shape[0], channels)
        for b in range(batch):
            for c in range(w.shape[0]):
                scores = [float(w[c] @ x[b, :, p]) / float(w[c].norm()) for p in range(x.shape[2])]
                if temperature is None:
                    attention = max(scores)
                else:
                    exps = [math.exp(temperature * s) for s in scores]
                    attention = sum(e / sum(exps) * s for e, s in zip(exps, scores, strict=True))
                out[b, c] += sum(scores) / len(scores) + lam * attention
    return out


@pytest.mark.parametrize(
    ("num_heads", "temperatures"),
    [(1, [1]), (2, [1, None]), (4, [1, 2, 4, None]), (6, [1, 2, 3, 4, 5, None]), (8, [*range(1, 8), None])],
)
def test_csra_matches_a_float64_loop_and_has_the_released_keys(num_heads, temperatures):
    torch.manual_seed(num_heads)
    head = CSRA(6, 4, num_heads=num_heads, lam=0.3)
    assert shapes(head) == {f"multi_head.{i}.head.weight": (4, 6, 1, 1) for i in range(num_heads)}
    features = torch.randn(2, 6, 3, 2, requires_grad=True)
    logits = head(features)
    weights = [head.state_dict()[f"multi_head.{i}.head.weight"] for i in range(num_heads)]
    torch.testing.assert_close(
        logits.double(), reference_csra(weights, temperatures, 0.3, features.detach()), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(head(features.flatten(2).transpose(1, 2)), logits, atol=0, rtol=0)  # tokens
    logits.square().sum().backward()
    assert all(p.grad.abs().sum() > 0 for p in head.parameters()) and features.grad.abs().sum() > 0


def test_csra_rejects_an_unreleased_head_count():
    with pytest.raises(ValueError, match="num_heads=3; expected one of \\[1, 2, 4, 6, 8\\]"):
        CSRA(6, 4, num_heads=3)


@pytest.mark.parametrize(
    ("name", "head"), [("resnet10t", "mldecoder"), ("resnet10t", "csra"), ("test_vit", "mldecoder")]
)
def test_create_model_puts_the_head_on_the_backbone_features(name, head):
    torch.manual_seed(0)
    options = {"num_groups": 3} if head == "mldecoder" else {"num_heads": 2}
    model = create_model(name, 5, pretrained=False, head=head, **options)
    backbone = timm.create_model(name, pretrained=False, num_classes=0, global_pool="")
    assert isinstance(model.get_classifier(), MLDecoder if head == "mldecoder" else CSRA)
    size = backbone.pretrained_cfg["input_size"][1] if name == "test_vit" else 64
    images = torch.randn(2, 3, size, size)
    model.eval()
    backbone.load_state_dict(model.backbone.state_dict())
    with torch.no_grad():
        expected = model.get_classifier()(backbone.eval().forward_features(images))
        torch.testing.assert_close(model(images), expected, atol=0, rtol=0)
    head_params, backbone_params = split_parameters(model)
    head_ids = {id(p) for p in head_params}
    assert head_ids == {id(p) for p in model.get_classifier().parameters() if p.requires_grad}
    assert len(backbone_params) == len(list(backbone.parameters()))


def test_linear_head_is_timms_model_unchanged():
    torch.manual_seed(0)
    ours = create_model("resnet10t", 5, pretrained=False, head="linear")
    torch.manual_seed(0)
    reference = timm.create_model("resnet10t", pretrained=False, num_classes=5)
    assert type(ours) is type(reference)
    for (key, value), (ref_key, ref_value) in zip(
        ours.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert key == ref_key
        torch.testing.assert_close(value, ref_value, atol=0, rtol=0)


def test_unknown_head_and_another_heads_option_fail_in_one_line():
    with pytest.raises(ValueError, match="model/head='mlp'; expected one of linear, mldecoder, csra"):
        create_model("resnet10t", 5, pretrained=False, head="mlp")
    with pytest.raises(
        ValueError, match="^model.head.drop_rate is not an option of the csra head; it takes num_heads, lam"
    ):
        create_model("resnet10t", 5, pretrained=False, head={"name": "csra", "drop_rate": 0.2})
    with pytest.raises(ValueError, match="^model.head.num_heads is not an option of the mldecoder head; "):
        create_model("resnet10t", 5, pretrained=False, head="mldecoder", num_heads=2)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["mldecoder", "csra"])
def test_trained_head_exports_to_onnx_equal_to_predict(head, tmp_path):
    """A tiny run with the head and an EMA; its checkpoint rebuilt by mlcls.inference, exported to ONNX."""
    pytest.importorskip("onnxruntime")
    from mlcls.cli.train import run
    from mlcls.inference.export import export_checkpoint
    from mlcls.inference.predictor import load_inference_model

    overrides = [
        *TINY_RESNET10T,
        "trainer.epochs=1",
        "dataset.train_size=32",
        "dataset.val_size=16",
        "dataset.image_size=16",
        f"model/head={head}",
    ]
    options = {"num_groups": 4} if head == "mldecoder" else {"num_heads": 2}
    overrides += [f"model.head.{key}={value}" for key, value in options.items()] + ["trainer.ema_decay=0.9"]
    run(compose_config([*overrides]), run_dir=tmp_path)
    checkpoint = tmp_path / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, weights_only=False)
    assert any(key.startswith("head.") for key in state["model"])
    reference = create_model("resnet10t", len(state["classes"]), pretrained=False, head=head, **options)
    reference.load_state_dict(state["model"])
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            load_inference_model(checkpoint, "cpu").model(images), reference.eval()(images)
        )
    _, difference = export_checkpoint(checkpoint, "onnx", tmp_path / "m.onnx")
    assert difference is not None and difference < 1e-4


LOSSES = sorted(path.stem for path in (Path(mlcls.__file__).parent / "configs" / "loss").glob("*.yaml"))


@pytest.fixture(scope="module")
def loss_configs() -> dict:
    """Each loss config of the project, composed once for every head."""
    # epr and role have no default k
    required = {name: ["loss.expected_positives=2.9"] for name in ("epr", "role")}
    return {name: compose_config([*TINY, f"loss={name}", *required.get(name, [])]).loss for name in LOSSES}


@pytest.mark.parametrize("head", ["mldecoder", "csra"])
@pytest.mark.slow
def test_every_loss_trains_every_head(head, loss_configs):
    """Each loss config of the project on each head's logits: a finite loss whose gradient reaches the head
    and the backbone (the heads give (B, C) logits like the linear one, so every loss applies). The logits
    are computed once; each loss's own gradients are taken from them, down to the backbone's last stage."""
    from types import SimpleNamespace

    from mlcls.engine.build import build_loss

    assert len(LOSSES) == 19
    torch.manual_seed(0)
    labels = (torch.rand(8, 12) < 0.3).float()
    labels[0, 0], labels[1, 0] = 1.0, 0.0  # every loss sees both kinds in some class
    images = torch.randn(8, 3, 16, 16)
    model = create_model(
        "resnet10t", 12, pretrained=False, head=head, **({"num_groups": 5} if head == "mldecoder" else {})
    )
    head_params = [p for p in model.get_classifier().parameters() if p.requires_grad]
    # the backbone's last stage: a gradient there has come through the whole head into the backbone (and
    # the backward pass stops there)
    backbone_params = list(model.backbone.layer4.parameters())
    logits = model(images)
    for name, loss_cfg in loss_configs.items():
        criterion = build_loss(loss_cfg, SimpleNamespace(labels=labels), torch.device("cpu"))
        indices = (torch.arange(8),) if getattr(criterion, "needs_sample_index", False) else ()
        loss = criterion(logits, labels, *indices)
        assert torch.isfinite(loss), name
        grads = torch.autograd.grad(loss, head_params + backbone_params, retain_graph=True, allow_unused=True)
        head_grads, backbone_grads = grads[: len(head_params)], grads[len(head_params) :]
        assert all(g is not None for g in head_grads) and any(g.abs().sum() > 0 for g in head_grads), name
        assert any(g is not None and g.abs().sum() > 0 for g in backbone_grads), name
