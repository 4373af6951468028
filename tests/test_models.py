"""mlcls.models.create_model: pretrained weights from the local Hugging Face cache without a request, and
one line at once naming model.pretrained=false / model.checkpoint_path= when they cannot be fetched."""

from __future__ import annotations

import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import timm
import torch
from safetensors.torch import save_file

from mlcls.errors import ConfigError
from mlcls.models import factory
from mlcls.models.factory import create_model

NAME = "resnet10t"
REPO = "timm/resnet10t.c3_in1k"  # the hub repository of timm's default resnet10t weights


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def cache_weights(cache: Path, state: dict[str, torch.Tensor]) -> None:
    """Lay ``state`` out as huggingface_hub caches ``REPO``'s model.safetensors (refs/main -> snapshot)."""
    commit = "0" * 40
    folder = cache / f"models--{REPO.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(snapshot / "model.safetensors"))


def test_cached_weights_load_without_any_request(empty_cache, monkeypatch):
    assert timm.models.get_pretrained_cfg(NAME).hf_hub_id == REPO
    reference = timm.create_model(NAME, pretrained=False).state_dict()  # the 1000-class ImageNet network
    cache_weights(empty_cache, reference)

    def no_request(*args, **kwargs):
        raise AssertionError("asked the hub")

    monkeypatch.setattr(factory, "get_hf_file_metadata", no_request)
    monkeypatch.setattr(factory, "hf_hub_download", no_request)
    model = create_model(NAME, num_classes=5, pretrained=True)
    loaded = model.state_dict()
    for key, value in reference.items():
        if not key.startswith("fc."):  # the classifier is new: 5 classes, not ImageNet's
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
    assert loaded["fc.weight"].shape == (5, reference["fc.weight"].shape[1])


def test_unreachable_hub_fails_at_once_naming_both_ways_out(empty_cache, monkeypatch):
    # nothing listens on the loopback discard port: the connection is refused at once
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        create_model(NAME, num_classes=5, pretrained=True)
    assert time.monotonic() - start < factory.HUB_TIMEOUT
    message = str(info.value)
    assert message.startswith(
        f"model.pretrained=true: cannot fetch the weights of {NAME}: the Hugging Face hub"
    )
    assert "model.pretrained=false" in message and "model.checkpoint_path=<file>" in message
    assert "\n" not in message


def test_offline_mode_fails_without_a_request(empty_cache, monkeypatch):
    monkeypatch.setattr(factory, "is_offline_mode", lambda: True)
    monkeypatch.setattr(factory, "get_hf_file_metadata", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set and they are not in the local Hugging Face"):
        create_model(NAME, num_classes=5, pretrained=True)


def test_from_scratch_and_local_file_never_look_at_the_hub(empty_cache, monkeypatch, tmp_path):
    monkeypatch.setattr(factory, "pretrained_weights_file", lambda name: pytest.fail("looked for weights"))
    assert create_model(NAME, num_classes=3, pretrained=False).get_classifier().out_features == 3
    weights = tmp_path / "weights.safetensors"
    reference = timm.create_model(NAME, pretrained=False).state_dict()
    save_file({k: v.contiguous() for k, v in reference.items()}, str(weights))
    model = create_model(NAME, num_classes=3, checkpoint_path=str(weights))
    torch.testing.assert_close(
        model.state_dict()["conv1.0.weight"], reference["conv1.0.weight"], rtol=0, atol=0
    )
