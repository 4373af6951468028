"""Create a timm model for multi-label classification and split its parameters into head and backbone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import timm
import torch
from huggingface_hub import (
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    is_offline_mode,
    try_to_load_from_cache,
)
from huggingface_hub.errors import EntryNotFoundError
from torch import nn

from mlcls.errors import ConfigError
from mlcls.models.heads import HEAD_MODULES, TEXT_HEADS, HeadedModel
from mlcls.models.weights import pretrained_state

# Seconds the Hugging Face hub has to answer the one request that tells whether it can be reached.
HUB_TIMEOUT = 10.0
# The weight files timm looks for in a hub repository, in its order of preference.
HUB_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# How the linear head's classifier is drawn (model.classifier_init): as the architecture draws it, or as
# torch's nn.Linear does.
CLASSIFIER_INITS = ("timm", "torch")

# Each head's options, as its config (configs/model/head/<head>.yaml) names them; ``warmup_epochs`` there is
# the schedule's default (mlcls.engine.optim.build_scheduler), not the network's.
HEAD_OPTIONS = {
    "linear": ("drop_rate",),
    "mldecoder": ("num_groups", "embed_dim"),
    "csra": ("num_heads", "lam"),
    "mldecoder_zsl": ("embed_dim",),
    "cosine": ("init_scale",),
}


def create_model(
    name: str,
    num_classes: int,
    pretrained: bool = True,
    checkpoint_path: str | None = None,
    checkpoint_names: str = "timm",
    classifier_init: str = "timm",
    head: str | Mapping[str, Any] = "linear",
    class_embeddings: torch.Tensor | None = None,
    **head_options: Any,
) -> nn.Module:
    """Build timm model ``name`` with a freshly initialised ``num_classes``-way classifier ``head``.

    ``head`` is the head's config (``model.head``: its ``name`` and options) or its name, the options then
    given as ``head_options`` (:data:`HEAD_OPTIONS`; an option of another head is a :class:`ConfigError`:
    none is silently unused); the text-query heads need ``class_embeddings`` ((num_classes, T) unit rows).

    With ``pretrained=True`` the ImageNet weights come from the local Hugging Face cache, else from the hub
    (:func:`pretrained_weights_file`); ``checkpoint_path`` loads a local weights file instead, read as data,
    its names timm's or mapped onto them as ``checkpoint_names`` says (:mod:`mlcls.models.weights`). In both
    cases the pretrained classifier is dropped, since its classes are not ours. The linear head's classifier
    is drawn as the architecture draws it (``classifier_init="timm"``) or as torch's ``nn.Linear`` does
    (``"torch"``: uniform within 1/sqrt(features)); timm's EfficientNets and MobileNets draw within
    1/sqrt(classes), 0.38 for 7 classes, which a short fine-tune spends its first epochs undoing
    (docs/report.md, "Fine-tuning"). The other heads draw their own.
    """
    if classifier_init not in CLASSIFIER_INITS:
        raise ConfigError(
            f"model.classifier_init={classifier_init!r}; expected one of {', '.join(CLASSIFIER_INITS)}"
        )
    if not timm.is_model(name):
        raise ValueError(f"unknown timm model {name!r}; see timm.list_models() for valid names")
    head_name, options = head_config(head, head_options)
    if head_name in TEXT_HEADS and class_embeddings is None:
        raise ConfigError(
            f"model/head={head_name} scores classes by their names: it needs their class embeddings "
            "(the text config, configs/text/)"
        )
    if head_name not in TEXT_HEADS and class_embeddings is not None:
        raise ConfigError(f"model/head={head_name} has no text queries; class embeddings are not its input")
    if class_embeddings is not None and class_embeddings.shape[0] != num_classes:
        raise ValueError(
            f"model/head={head_name} needs class embeddings for {num_classes} classes; "
            f"got {class_embeddings.shape[0]} rows"
        )
    kwargs: dict = {"num_classes": num_classes, "drop_rate": options.pop("drop_rate", 0.0)}
    if checkpoint_path:
        state = pretrained_state(name, checkpoint_path, checkpoint_names)
        kwargs["pretrained_cfg_overlay"] = {"state_dict": state}
        pretrained = True
    elif pretrained:
        weights = pretrained_weights_file(name)
        if weights is not None:
            kwargs["pretrained_cfg_overlay"] = {"file": weights}
    if head_name == "linear":
        model = _loaded(timm.create_model(name, pretrained=pretrained, **kwargs))
        if classifier_init == "torch":
            for module in model.get_classifier().modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()
        return model
    kwargs.update(num_classes=0, global_pool="")
    backbone = _loaded(timm.create_model(name, pretrained=pretrained, **kwargs))
    classes = class_embeddings if head_name in TEXT_HEADS else num_classes
    return HeadedModel(backbone, HEAD_MODULES[head_name](backbone.num_features, classes, **options))


def _loaded(model: nn.Module) -> nn.Module:
    """``model`` without the state dict its pretrained config held while timm loaded it (the file's tensors,
    else kept alive as long as the model)."""
    model.pretrained_cfg.pop("state_dict", None)
    return model


def head_config(head: str | Mapping[str, Any], options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The head's name and network options from ``head`` (a name, or a config with ``name``) and
    ``options``; :class:`ConfigError` for an unknown head or an option that is not the head's."""
    given = {"name": head} if isinstance(head, str) else dict(head)
    given.update(options)
    head_name = given.pop("name", "linear")
    if head_name not in HEAD_OPTIONS:
        raise ConfigError(f"model/head={head_name!r}; expected one of {', '.join(HEAD_OPTIONS)}")
    given.pop("warmup_epochs", None)  # the schedule's key (see HEAD_OPTIONS)
    foreign = [key for key in given if key not in HEAD_OPTIONS[head_name]]
    if foreign:
        raise ConfigError(
            f"model.head.{foreign[0]} is not an option of the {head_name} head; it takes "
            f"{', '.join(HEAD_OPTIONS[head_name])} (configs/model/head/{head_name}.yaml)"
        )
    return head_name, given


def has_text_queries(head: str | Mapping[str, Any]) -> bool:
    """Whether the head config ``model.head`` (or its name) is a text-query head, whose classes are class
    embeddings (``mldecoder_zsl``, ``cosine``); :class:`ConfigError` for an unknown head."""
    return head_config(head, {})[0] in TEXT_HEADS


def pretrained_weights_file(name: str) -> str | None:
    """A local file holding the pretrained weights of timm model ``name`` that timm would fetch from the
    Hugging Face hub; ``None`` when they do not come from the hub (timm loads those itself).

    The local cache is tried first, without any request; then one request with a :data:`HUB_TIMEOUT`
    tells whether the hub answers, so that without it a :class:`ConfigError` says so at once instead of
    huggingface_hub's minute of retries.
    """
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not cfg.hf_hub_id:
        return None
    repo_id, _, revision = cfg.hf_hub_id.partition("@")
    revision = revision or None
    files = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HUB_WEIGHT_FILES
    for filename in files:
        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(cached, str):
            return cached
    if is_offline_mode():
        raise _unavailable(name, "HF_HUB_OFFLINE is set and they are not in the local Hugging Face cache")
    for filename in files:
        try:
            get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision), timeout=HUB_TIMEOUT)
        except EntryNotFoundError:
            continue
        except Exception as exc:  # any failure of the request means: the hub cannot be reached
            reason = f"the Hugging Face hub does not answer ({type(exc).__name__}: {exc})"
            raise _unavailable(name, reason) from exc
        return hf_hub_download(repo_id, filename, revision=revision)
    return None


def _unavailable(name: str, reason: str) -> ConfigError:
    return ConfigError(
        f"model.pretrained=true: cannot fetch the weights of {name}: {reason}; train from scratch with "
        "model.pretrained=false, or give a local weights file with model.checkpoint_path=<file>"
    )


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Return (head, backbone) trainable parameters; the head is timm's ``get_classifier()``."""
    classifier = model.get_classifier()
    head_ids = {id(p) for p in classifier.parameters()}
    head = [p for p in model.parameters() if p.requires_grad and id(p) in head_ids]
    backbone = [p for p in model.parameters() if p.requires_grad and id(p) not in head_ids]
    if not head:
        raise ValueError(f"{type(model).__name__} exposes no classifier parameters through get_classifier()")
    return head, backbone


# Keys of the model config that say how training starts or what it updates, not what the network is: the
# network is built without them (model.init_from: the starting weights; model.freeze_backbone).
TRAINING_KEYS = ("init_from", "freeze_backbone")


def freeze_backbone(model: nn.Module) -> int:
    """Train the head alone (``model.freeze_backbone``, linear probing): every parameter outside timm's
    ``get_classifier()`` stops requiring gradients, so the optimizer, DDP's gradient reduction and the
    backward pass leave it out. Returns the number of parameters frozen. Call :func:`backbone_in_eval`
    after each ``model.train()``, so that the backbone's normalisation statistics stay as they are too."""
    _, backbone = split_parameters(model)
    for param in backbone:
        param.requires_grad_(False)
    return sum(param.numel() for param in backbone)


def backbone_in_eval(model: nn.Module) -> None:
    """Put every submodule outside the head in eval mode, the head (and ``model`` itself, whose own dropout
    before the classifier belongs to the head) left as they are: batch-norm statistics are not updated and
    the backbone's dropout and drop-path are off, as when features are extracted once and a classifier is
    trained on them."""
    head = {id(module) for module in model.get_classifier().modules()}
    for module in model.modules():
        if module is not model and id(module) not in head:
            module.training = False
