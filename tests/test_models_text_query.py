"""The text-query heads (``model/head=mldecoder_zsl | cosine``) against float64 references of their
equations written here, with class lists they were not built with, and how a model is built with them."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_config
from omegaconf import open_dict

from mlcls.engine.build import class_queries
from mlcls.errors import ConfigError
from mlcls.models import create_model
from mlcls.models.heads import CosineHead, MLDecoderZSL
from mlcls.models.heads.text_query import scoring_classes, text_query_head
from mlcls.text import class_embeddings

B, D, H, W, T, E, HEADS, FF = 2, 6, 3, 2, 5, 8, 2, 16


def unit_rows(count: int, seed: int) -> torch.Tensor:
    rows = torch.randn(count, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return rows / rows.norm(dim=1, keepdim=True)


def randomised(head: torch.nn.Module) -> torch.nn.Module:
    """``head`` in float64 eval mode (dropout off) with every parameter drawn afresh, norms included."""
    torch.manual_seed(0)
    head.double().eval()
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return head


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias


def mldecoder_zsl_reference(head: MLDecoderZSL, features: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """ML-Decoder ZSL, one image and one class query at a time, from the parameters' values."""
    p = {name: value.detach() for name, value in head.named_parameters()}
    layer = "layers.0."
    wq, wk, wv = p[layer + "multihead_attn.in_proj_weight"].split(E)
    bq, bk, bv = p[layer + "multihead_attn.in_proj_bias"].split(E)
    d = E // HEADS
    logits = torch.zeros(features.shape[0], emb.shape[0], dtype=torch.float64)
    for b in range(features.shape[0]):
        tokens = features[b].reshape(D, -1).t()  # (N, D)
        memory = torch.relu(tokens @ p["embed_standart.weight"].t() + p["embed_standart.bias"])  # (N, E)
        keys, values = memory @ wk.t() + bk, memory @ wv.t() + bv
        for c in range(emb.shape[0]):
            query = torch.relu(p["wordvec_proj.weight"] @ emb[c] + p["wordvec_proj.bias"])  # (E,)
            t = layer_norm(query + query, p[layer + "norm1.weight"], p[layer + "norm1.bias"])
            q = wq @ t + bq
            heads = []
            for h in range(HEADS):
                part = slice(h * d, (h + 1) * d)
                weights = torch.softmax(keys[:, part] @ q[part] / math.sqrt(d), dim=0)  # (N,)
                heads.append(weights @ values[:, part])
            attended = p[layer + "multihead_attn.out_proj.weight"] @ torch.cat(heads)
            attended = attended + p[layer + "multihead_attn.out_proj.bias"]
            t = layer_norm(t + attended, p[layer + "norm2.weight"], p[layer + "norm2.bias"])
            hidden = torch.relu(p[layer + "linear1.weight"] @ t + p[layer + "linear1.bias"])
            fed = p[layer + "linear2.weight"] @ hidden + p[layer + "linear2.bias"]
            t = layer_norm(t + fed, p[layer + "norm3.weight"], p[layer + "norm3.bias"])
            logits[b, c] = t @ p["duplicate_pooling"][:, 0] + p["duplicate_pooling_bias"][0]
    return logits


def cosine_reference(head: CosineHead, features: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    weight, tau = head.proj.weight.detach(), math.exp(head.log_scale.item())
    pooled = torch.einsum("bdhw->bd", features) / (features.shape[2] * features.shape[3])
    projected = torch.einsum("td,bd->bt", weight, pooled)
    dots = torch.einsum("bt,ct->bc", projected, emb)
    return tau * dots / (projected.norm(dim=1)[:, None] * emb.norm(dim=1)[None, :])


CASES = {
    "mldecoder_zsl": (
        lambda emb: MLDecoderZSL(D, emb, embed_dim=E, num_attention_heads=HEADS, feedforward_dim=FF),
        mldecoder_zsl_reference,
    ),
    "cosine": (lambda emb: CosineHead(D, emb, init_scale=7.0), cosine_reference),
}


@pytest.mark.parametrize("name", CASES)
def test_each_head_equals_its_float64_reference_for_the_classes_it_was_built_with_and_others(name):
    build, reference = CASES[name]
    built = unit_rows(4, seed=1)
    head = randomised(build(built))
    head.class_embeddings = built  # randomised() left the buffer as it was: float64 unit rows
    features = torch.randn(B, D, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(head(features), reference(head, features, built), rtol=1e-9, atol=1e-9)
    unseen = unit_rows(7, seed=3)
    head.set_class_embeddings(unseen)
    logits = head(features)
    assert logits.shape == (B, 7)
    torch.testing.assert_close(logits, reference(head, features, unseen), rtol=1e-9, atol=1e-9)


def test_scoring_classes_swaps_the_heads_classes_within_the_block_and_restores_its_own():
    """A zero-shot evaluation's swap: inside the block the head scores the given classes (the float64
    reference's logits of them); after it, also when the block raises, its own embeddings are back."""
    built = unit_rows(4, seed=1)
    head = randomised(CosineHead(D, built.float(), init_scale=7.0))
    head.class_embeddings = built
    features = torch.randn(B, D, H, W, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    evaluated = unit_rows(6, seed=4)
    with pytest.raises(RuntimeError, match="inside"), scoring_classes(head, evaluated) as swapped:
        assert swapped is head
        torch.testing.assert_close(
            head(features), cosine_reference(head, features, evaluated), rtol=1e-9, atol=0
        )
        raise RuntimeError("inside")
    assert torch.equal(head.class_embeddings, built)
    torch.testing.assert_close(head(features), cosine_reference(head, features, built), rtol=1e-9, atol=1e-9)
    without = torch.nn.Linear(D, 4)  # classes of weights of its own: it scores only those
    with (
        pytest.raises(ValueError, match="zero-shot evaluation needs a text-query head"),
        scoring_classes(without, evaluated),
    ):
        pass


@pytest.mark.parametrize("name", CASES)
def test_no_head_weight_belongs_to_a_class(name):
    head = CASES[name][0](unit_rows(4, seed=1).float())
    for count in (1, 9):
        head.set_class_embeddings(unit_rows(count, seed=count).float())
        assert head(torch.randn(B, D, H, W)).shape == (B, count)
    shapes = [param.shape for param in head.parameters()]
    assert [param.shape for param in CASES[name][0](unit_rows(9, seed=9).float()).parameters()] == shapes
    with pytest.raises(ValueError, match="width 3; this .* head was built for width 5"):
        head.set_class_embeddings(torch.ones(2, 3))


def test_the_cosine_scale_starts_at_init_scale_and_is_learnt():
    head = CosineHead(D, unit_rows(3, seed=1).float(), init_scale=10.0)
    assert head.log_scale.item() == pytest.approx(math.log(10.0))
    assert head.log_scale.requires_grad and "log_scale" in dict(head.named_parameters())


@pytest.mark.parametrize("head", ["mldecoder_zsl", "cosine"])
def test_a_model_with_a_text_head_is_built_from_the_dataset_classes(head):
    cfg = compose_config([f"model/head={head}", "model.name=resnet10t", "model.pretrained=false"])
    classes = ["red_circle", "blue_square"]
    queries = class_queries(cfg, classes)
    torch.testing.assert_close(queries["class_embeddings"], class_embeddings(cfg.text, classes))
    model = create_model("resnet10t", 2, pretrained=False, head=cfg.model.head, **queries)
    torch.testing.assert_close(text_query_head(model).class_embeddings, queries["class_embeddings"])
    assert model.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 2)
    with pytest.raises(ConfigError, match=f"model/head={head} scores classes by their names"):
        create_model("resnet10t", 2, pretrained=False, head=cfg.model.head)


def test_a_head_without_text_queries_needs_no_text_config():
    cfg = compose_config(["model/head=mldecoder"])
    with open_dict(cfg):
        del cfg["text"]
    assert class_queries(cfg, ["a", "b"]) == {}
    model = create_model("resnet10t", 2, pretrained=False, head="linear")
    assert text_query_head(model) is None
    with pytest.raises(ConfigError, match="model/head=linear has no text queries"):
        create_model("resnet10t", 2, pretrained=False, class_embeddings=torch.eye(2))
