"""The authors' released checkpoints of ML-Decoder, ASL and CSRA as mlcls checkpoints (``mlcls-import``),
and the zero-shot model that ML-Decoder's ``train_zsl_nus.py`` saves.

A released file is read as data, once, through :func:`mlcls.torchfile.open_checkpoint`; each :data:`FORMATS`
entry says which networks it holds and how their names translate to mlcls's (:mod:`mlcls.models.released`
for the TResNets). docs/models.md tables the formats and their authors' evaluation: a squash-resize and
[0, 1] pixels, none of them subtracting ImageNet's mean.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from mlcls import config_dir
from mlcls.data.datasets.voc import VOC_CLASSES
from mlcls.data.pipeline.preprocess import preprocess_spec
from mlcls.errors import InferenceError, first_line, plural, shown
from mlcls.inference.fields import CLASS_EMBEDDINGS_KEY
from mlcls.io import FileTooLargeError, NotRegularFileError, UnsafeFileError
from mlcls.models import create_model
from mlcls.models.heads import TEXT_HEADS
from mlcls.models.heads.csra import TEMPERATURES
from mlcls.models.released import tresnet_key, tresnet_value, tresnet_variant
from mlcls.text import build_encoder, class_embeddings
from mlcls.torchfile import check_nesting, open_checkpoint

# MS-COCO's 80 categories in category-id order (the order of the COCO API and of every released COCO model)
COCO_CLASSES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors",
    "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip
OPEN_IMAGES_CLASSES = 9605
# The dataset config (configs/dataset/) an imported model of this many classes is evaluated on by default
DATASETS = {80: "coco", 20: "voc2007", OPEN_IMAGES_CLASSES: "openimages"}
# The released files' input size, per backbone (the figures of the authors' model zoos)
TRESNET_SIZES = {
    "tresnet_m": 224,
    "tresnet_l": 448,
    "tresnet_xl": 640,
    "tresnet_v2_l": 448,
    "tresnet_v2_xl": 640,
}
# CSRA's lam per released ResNet-101 file, by (heads, classes), as its README trains and evaluates them:
# VOC 2007's files (ResNet-101, ResNet-cut, extra data) 1 head and lam 0.1; COCO's ResNet-101 4 heads and 0.5;
# COCO's ResNet-cut (CutMix pre-training) 6 heads and 0.4.
CSRA_LAM = {(1, 20): 0.1, (4, 80): 0.5, (6, 80): 0.4}


@dataclass(frozen=True)
class ReleasedFormat:
    """What one format's files hold: the network, its released key names and the authors' training."""

    description: str
    head: str  # mlcls's model.head
    prefixes: tuple[str, ...]  # every released key starts with one of them
    classes_key: str  # the entry whose first dimension is the class count (zero-shot: the text width)
    backbones: tuple[str, ...]  # the timm names it may hold
    transform: str  # dataset.transform of the authors' training augmentation (evaluated by a squash-resize)


FORMATS = {
    "mldecoder": ReleasedFormat(
        "TResNet body.* + ML-Decoder head.decoder.*",
        "mldecoder",
        ("body.", "head.decoder."),
        "head.decoder.duplicate_pooling_bias",
        ("tresnet_m", "tresnet_v2_l", "tresnet_v2_xl"),
        "strong",
    ),
    "asl": ReleasedFormat(
        "TResNet body.* + linear head.fc.*",
        "linear",
        ("body.", "head.fc."),
        "head.fc.weight",
        ("tresnet_m", "tresnet_l", "tresnet_xl"),
        "strong",
    ),
    # train_zsl_nus.py saves model.state_dict() of MLDecoder(zsl=1): its queries are word vectors set as a
    # plain attribute (update_wordvecs), so the file holds no class and the names and vectors are given
    "mldecoder_zsl": ReleasedFormat(
        "TResNet body.* + ML-Decoder zero-shot head.wordvec_proj.* and head.decoder.*",
        "mldecoder_zsl",
        ("body.", "head.wordvec_proj.", "head.decoder."),
        "head.wordvec_proj.weight",
        ("tresnet_m", "tresnet_v2_l", "tresnet_v2_xl"),
        "strong",
    ),
    "csra": ReleasedFormat(
        "ResNet-101 conv1.*, bn1.*, layer1-4.* + CSRA classifier.multi_head.*",
        "csra",
        ("conv1.", "bn1.", "layer1.", "layer2.", "layer3.", "layer4.", "classifier.multi_head."),
        "classifier.multi_head.0.head.weight",
        ("resnet101",),
        "light",
    ),
}


def read_released(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state dict of released file ``path`` (its ``model`` entry, else ``state_dict``, else the file;
    ``module.`` prefixes dropped) and the file's other top-level entries (``idx_to_class``, ...), read as
    data; :class:`InferenceError` for a file that is not one."""
    path = Path(path)
    try:
        file = open_checkpoint(path, what="released file")
    except FileNotFoundError:
        raise InferenceError(f"{path} does not exist") from None
    except (NotRegularFileError, FileTooLargeError, UnsafeFileError) as exc:
        raise InferenceError(str(exc)) from None
    try:
        with file:
            state = torch.load(file, map_location="cpu", weights_only=True)
        check_nesting(state, str(path))
    except UnsafeFileError as exc:
        raise InferenceError(str(exc)) from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        raise InferenceError(
            f"{path} cannot be read as data ({type(exc).__name__}: {first_line(exc)}); a released checkpoint "
            "holds tensors, dicts and names only"
        ) from None
    if not isinstance(state, Mapping):
        raise InferenceError(f"{path} holds a {type(state).__name__}; expected a state dict")
    weights, meta = state, {}
    for key in ("model", "state_dict"):
        if isinstance(state.get(key), Mapping):
            weights, meta = state[key], {k: v for k, v in state.items() if k != key}
            break
    tensors = {}
    for key, value in weights.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise InferenceError(
                f"{path}: the state dict entry {shown(key)} is a {type(value).__name__}; expected tensors"
            )
        tensors[key.removeprefix("module.")] = value
    if not tensors:
        raise InferenceError(f"{path} holds an empty state dict")
    return tensors, meta


def _misfit(fmt: str, detail: str) -> InferenceError:
    return InferenceError(f"the file does not fit format {fmt} ({FORMATS[fmt].description}): {detail}")


def released_model_config(fmt: str, weights: Mapping[str, torch.Tensor], lam: float | None = None) -> dict:
    """The ``model`` config (the fields of :func:`mlcls.models.create_model`) of the network that
    ``weights`` (released names) hold under format ``fmt``; :class:`InferenceError` naming the first key
    that does not fit the format. ``lam``: CSRA's, else :data:`CSRA_LAM` of the file's heads and classes
    (a file of other heads or classes needs it given)."""
    if fmt not in FORMATS:
        raise InferenceError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    spec = FORMATS[fmt]
    foreign = next((key for key in weights if not key.startswith(spec.prefixes)), None)
    if foreign is not None:
        raise _misfit(fmt, f"its key {foreign!r} is none of those")
    head = weights.get(spec.classes_key)
    if head is None or head.ndim < 1 or head.shape[0] < 1:
        what = "the decoder's width" if spec.head in TEXT_HEADS else "the class count"
        raise _misfit(fmt, f"it has no {spec.classes_key} giving {what}")
    fields: dict[str, Any] = {
        "_target_": "mlcls.models.create_model",
        "name": spec.backbones[0],
        "pretrained": False,
        "checkpoint_path": None,
        "head": {
            "name": spec.head,
            "warmup_epochs": 1 if spec.head.startswith("mldecoder") else 0,
        },  # model/head/*.yaml
    }
    if fmt == "csra":
        heads, classes = sum(key.startswith("classifier.multi_head.") for key in weights), int(head.shape[0])
        if heads not in TEMPERATURES:
            raise _misfit(fmt, f"it has {plural(heads, 'head')}; CSRA's code builds {sorted(TEMPERATURES)}")
        if lam is None and (heads, classes) not in CSRA_LAM:
            known = ", ".join(f"{h} for {c}" for h, c in CSRA_LAM)
            raise InferenceError(
                f"the CSRA file has {plural(heads, 'head')} for {classes} classes, none of its authors' "
                f"released files (heads for classes: {known}); give lam=X, the lambda it was trained with"
            )
        fields["head"].update(num_heads=heads, lam=CSRA_LAM[heads, classes] if lam is None else lam)
        return fields
    if spec.head == "linear":
        fields["head"]["drop_rate"] = 0.0
    variant = tresnet_variant(weights)
    if variant not in spec.backbones:
        found = "no TResNet variant" if variant is None else variant
        raise _misfit(
            fmt,
            f"body.conv1.0.weight and the blocks of body.layer1-4 make {found}; expected "
            f"one of {', '.join(spec.backbones)}",
        )
    fields["name"] = variant
    if fmt == "mldecoder_zsl":  # Linear(300, E): its output width is the decoder's
        if head.ndim != 2:
            raise _misfit(
                fmt, f"{spec.classes_key} is {tuple(head.shape)}; expected (width, word-vector width)"
            )
        fields["head"]["embed_dim"] = int(head.shape[0])
    if fmt == "mldecoder":
        queries = weights.get("head.decoder.query_embed.weight")
        if queries is None or queries.ndim != 2:
            raise _misfit(fmt, "head.decoder.query_embed.weight is not a (queries, width) tensor")
        fields["head"].update(num_groups=int(queries.shape[0]), embed_dim=int(queries.shape[1]))
    return fields


def released_name(fmt: str, key: str) -> str:
    """The name in mlcls's model of the released entry ``key`` of format ``fmt``: CSRA's ResNet under
    ``backbone.`` and its classifier under ``head.``; a TResNet's body under timm's names
    (:func:`mlcls.models.released.tresnet_key`), under ``backbone.`` beside an ML-Decoder head; the
    zero-shot head's ``head.decoder.*`` without ``decoder.`` (``head.wordvec_proj.*`` unchanged)."""
    if fmt == "csra":
        classifier = key.startswith("classifier.")
        return "head." + key.removeprefix("classifier.") if classifier else "backbone." + key
    if key.startswith("body."):
        return ("backbone." if fmt != "asl" else "") + tresnet_key(key)
    if fmt == "mldecoder_zsl" and key.startswith("head.decoder."):
        return "head." + key.removeprefix("head.decoder.")
    return key


def convert_weights(
    fmt: str,
    weights: Mapping[str, torch.Tensor],
    model_config: Mapping[str, Any],
    class_embeddings: torch.Tensor | None = None,
) -> dict:
    """``weights`` (released names) as the state dict of mlcls's model of ``model_config``, every entry
    checked against that model built on the ``meta`` device: :class:`InferenceError` names the first
    released key the model has no place for, or of another shape, and the first entry the file lacks (a
    BatchNorm's ``num_batches_tracked``, which InPlace-ABN files before its version 2 lack, is 0). A
    text-query head (``mldecoder_zsl``) takes ``class_embeddings`` (C, T), the classes it scores."""
    fields = {key: value for key, value in model_config.items() if key != "_target_"}
    text_query = FORMATS[fmt].head in TEXT_HEADS
    if text_query != (class_embeddings is not None):
        raise ValueError(
            f"format {fmt}: class embeddings are {'required' if text_query else 'not its input'}"
        )
    classes = len(class_embeddings) if text_query else int(weights[FORMATS[fmt].classes_key].shape[0])
    with torch.device("meta"):
        expected = create_model(**fields, num_classes=classes, class_embeddings=class_embeddings).state_dict()
    converted = {} if class_embeddings is None else {CLASS_EMBEDDINGS_KEY: class_embeddings}
    for key, value in weights.items():  # the released names as mlcls's model names them
        name = released_name(fmt, key)
        if name in converted:
            raise _misfit(fmt, f"its key {key!r} names {name}, which another entry fills")
        if name not in expected:
            raise _misfit(
                fmt, f"its key {key!r} has no place in {fields['name']} with a {fields['head']} head"
            )
        if value.shape != expected[name].shape:
            raise _misfit(
                fmt, f"{key} is {tuple(value.shape)}, {tuple(expected[name].shape)} in {fields['name']}"
            )
        converted[name] = value if fmt == "csra" else tresnet_value(name, value)
    for name, tensor in expected.items():
        if name not in converted:
            if not name.endswith("num_batches_tracked"):
                raise _misfit(
                    fmt, f"it lacks the weights of {name} ({plural(len(expected), 'tensor')} expected)"
                )
            converted[name] = torch.zeros((), dtype=tensor.dtype)
    return {name: converted[name] for name in expected}


def released_classes(
    count: int, given: Sequence[str] | None, meta: Mapping[str, Any], path: str | Path
) -> list[str]:
    """The ``count`` distinct class names of a released file: ``given`` first, else the file's
    ``idx_to_class`` (index -> name) in its own order (the authors' ``infer.py`` takes its ``values()``; for
    keys "0", "1", "10", "2"... sorting would not give the model's order), else COCO's or VOC's names for 80
    or 20 classes; :class:`InferenceError` otherwise."""
    if given is not None:
        names = list(given)
        source = "the class list given"
    elif meta.get("idx_to_class") is not None:
        table = meta["idx_to_class"]
        if not isinstance(table, Mapping):
            raise InferenceError(f"{path}: idx_to_class is a {type(table).__name__}; expected index -> name")
        names = list(table.values())
        source = "its idx_to_class"
    elif count in (len(COCO_CLASSES), len(VOC_CLASSES)):
        return list(COCO_CLASSES if count == len(COCO_CLASSES) else VOC_CLASSES)
    else:
        what = " (Open Images)" if count == OPEN_IMAGES_CLASSES else ""
        raise InferenceError(
            f"{path} holds {count} classes{what} but not their names; give them with classes=<file of "
            f"{count} names, one a line, in the model's order>"
        )
    if len(names) != count or not all(isinstance(name, str) and name for name in names):
        raise InferenceError(
            f"{path}: {source} has {len(names)} entries for the model's {count} classes; expected {count} "
            "non-empty names"
        )
    first_seen: dict[str, int] = {}
    for index, name in enumerate(names):
        if name in first_seen:
            raise InferenceError(
                f"{path}: {source} names {shown(name)} twice (entries {first_seen[name]} and {index}); "
                "expected distinct class names"
            )
        first_seen[name] = index
    return names


def import_released(
    fmt: str,
    path: str | Path,
    classes: Sequence[str] | None = None,
    image_size: int | None = None,
    lam: float | None = None,
    vectors: str | Path | None = None,
) -> dict[str, Any]:
    """The mlcls checkpoint (``model``, ``classes``, ``preprocess``, ``config`` with its ``model`` and
    ``dataset`` sections, ``released``) of the authors' file ``path`` in format ``fmt`` (:data:`FORMATS`);
    ``classes``, ``image_size`` and CSRA's ``lam`` replace what the format gives. Its dataset config is
    COCO's, VOC 2007's or Open Images' for 80, 20 or 9,605 classes, else the CSV dataset's with these
    classes, with the authors' squash-resize and [0, 1] pixels (mean 0, std 1).

    ``mldecoder_zsl`` needs ``classes`` and ``vectors``, a word-vector file (GloVe's text format,
    ``text=vectors``): the file holds neither, its queries being word vectors set at run time. Each class's
    query is its unit vector (:func:`mlcls.text.class_embeddings`); the checkpoint's text source is that
    file, so that ``mlcls-predict classes=`` and ``mlcls-eval`` embed other names alike."""
    text_query = FORMATS[fmt].head in TEXT_HEADS if fmt in FORMATS else False
    if text_query and (classes is None or vectors is None):
        raise InferenceError(
            f"format {fmt} holds no class and no word vector (its queries are set at run time); give "
            "classes=<file of names, one a line> and vectors=<word-vector file, GloVe's text format>"
        )
    if not text_query and vectors is not None:
        raise InferenceError(
            f"vectors= is for the zero-shot format mldecoder_zsl; format {fmt} has no queries"
        )
    weights, meta = read_released(path)
    model_config = released_model_config(fmt, weights, lam)
    text = None
    if text_query:
        names = released_classes(len(classes), classes, meta, path)
        text = vectors_record(vectors)
        embeddings = class_embeddings(text["config"], names)
        width = int(weights[FORMATS[fmt].classes_key].shape[1])
        if embeddings.shape[1] != width:
            raise InferenceError(
                f"the word vectors of {vectors} are {embeddings.shape[1]} wide; the file's "
                f"{FORMATS[fmt].classes_key} takes {width}"
            )
        state_dict = convert_weights(fmt, weights, model_config, embeddings)
    else:
        state_dict = convert_weights(fmt, weights, model_config)
        names = released_classes(int(weights[FORMATS[fmt].classes_key].shape[0]), classes, meta, path)
    dataset = DATASETS.get(len(names), "csv")
    dataset_config = OmegaConf.to_container(OmegaConf.load(config_dir() / "dataset" / f"{dataset}.yaml"))
    dataset_config.update(
        # train_zsl_nus.py trains any backbone at its --image-size default, 448
        image_size=image_size or (448 if text_query else TRESNET_SIZES.get(model_config["name"], 448)),
        transform=FORMATS[fmt].transform,
        mean=[0.0, 0.0, 0.0],
        std=[1.0, 1.0, 1.0],
    )
    if dataset == "csv":
        dataset_config["classes"] = list(names)
    config = {"model": model_config, "dataset": dataset_config}
    return {
        "model": state_dict,
        "classes": names,
        "preprocess": preprocess_spec(dataset_config),
        "config": config if text is None else {**config, "text": text["config"]},
        "released": {"format": fmt, "file": Path(path).name},
        **({} if text is None else {"text": text}),
    }


def vectors_record(path: str | Path) -> dict[str, Any]:
    """The text record (:func:`mlcls.engine.checkpoint.text_record`'s form) of ``text=vectors`` at
    ``path``, made absolute: the configs/text/vectors.yaml config and its encoder's source."""
    config = OmegaConf.to_container(OmegaConf.load(config_dir() / "text" / "vectors.yaml"))
    config["path"] = str(Path(path).expanduser().resolve())
    return {"source": build_encoder(config).source, "config": config}
