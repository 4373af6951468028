"""NUS-WIDE's zero-shot split (925 seen tags / 81 unseen concepts) from files written here in the release's
format: NUS_WID_Tags/TagList1k.txt and {Train,Test}_Tags1k.dat (tab-separated 0/1, a tab ending each line,
CRLF), beside the 81-concept layout of tests/data_fixtures.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_config
from data_fixtures import NUSWIDE_CONCEPTS, NUSWIDE_LISTS, write_nuswide
from omegaconf import OmegaConf

from mlcls.data import build_dataset
from mlcls.data.datasets.base import DatasetFormatError
from mlcls.data.datasets.nuswide import NUSWIDE
from mlcls.engine.config_checks import check_config
from mlcls.metrics import zero_shot_metrics
from mlcls.metrics.zero_shot import ZERO_SHOT_TOP_K
from mlcls.models.heads import TEXT_HEADS

# 1,000 tags: 925 plain ones and 75 of the concept names (the release's TagList1k shares 75 with Concepts81),
# interleaved so that the seen order must follow the file's.
OVERLAP = NUSWIDE_CONCEPTS[:75]
TAGS = [f"tag{j:03d}" for j in range(925)]
for position, concept in enumerate(OVERLAP):
    TAGS.insert(13 * position, concept)
SEEN = [tag for tag in TAGS if tag not in NUSWIDE_CONCEPTS]
# Positive tags of each image, in list order (the beach image: a tag but no concept; water: none at all).
TAG_POSITIVES = {
    "Train": [["tag000", "person"], ["animal"], ["tag500"], ["tag924", "tag001"]],
    "Test": [["tag002"], []],
}


def write_tags(root: Path) -> Path:
    tags = root / "NUS_WID_Tags"
    tags.mkdir(parents=True)
    (tags / "TagList1k.txt").write_bytes("".join(f"{t}\r\n" for t in TAGS).encode())
    for part, positives in TAG_POSITIVES.items():
        lines = ["".join(f"{int(tag in row)}\t" for tag in TAGS) + "\r\n" for row in positives]
        (tags / f"{part}_Tags1k.dat").write_bytes("".join(lines).encode())
    return root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return write_tags(write_nuswide(tmp_path / "nuswide"))


def expected_row(tags: list[str], concepts: list[str]) -> list[float]:
    return [float(t in tags) for t in SEEN] + [float(c in concepts) for c in NUSWIDE_CONCEPTS]


def test_classes_are_925_seen_tags_then_81_concepts(root: Path) -> None:
    assert len(TAGS) == 1000 and len(SEEN) == 925
    train = NUSWIDE("train", root=str(root), label_set="zero_shot")
    assert train.classes == SEEN + NUSWIDE_CONCEPTS and len(train.classes) == 1006
    concepts = list(NUSWIDE_LISTS["Train"].values())
    tags = TAG_POSITIVES["Train"]
    # the second image (animal) has no seen tag ("animal" is a concept): dropped from training; the third
    # (beach, no concept) has one: kept
    kept = [0, 2, 3]
    assert train.labels.tolist() == [expected_row(tags[i], concepts[i]) for i in kept]
    assert [Path(train.samples[k].path).name for k in range(3)] == [
        "0001_2124494179.jpg",
        "0003_11.jpg",
        "0004_5.jpg",
    ]
    test = NUSWIDE("test", root=str(root), label_set="zero_shot")
    test_concepts = list(NUSWIDE_LISTS["Test"].values())
    assert test.labels.tolist() == [expected_row(TAG_POSITIVES["Test"][i], test_concepts[i]) for i in (0, 1)]


def test_the_config_trains_on_the_seen_tags_and_evaluates_all(root: Path) -> None:
    cfg = compose_config(["dataset=nuswide_zsl", f"dataset.root={root}", "dataset.image_size=16"]).dataset
    train, test = build_dataset(cfg, train=True), build_dataset(cfg, train=False)
    assert train.classes == SEEN and len(test.classes) == 1006
    targets = np.stack([train.target(i).numpy() for i in range(len(train))])
    assert targets.shape == (3, 925) and targets.sum() == 4  # tag000; tag500; tag924 + tag001


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("0\t" * 999 + "\r\n", "line 1 does not hold 1000 values"),
        ("0\t" * 998 + "10\t\r\n", "line 1 does not hold 1000 values"),
        ("0\t" * 999 + "2\t\r\n", "line 1 does not hold 1000 values"),
    ],
)
def test_a_malformed_tag_file_is_one_line(root: Path, line: str, message: str) -> None:
    path = root / "NUS_WID_Tags" / "Test_Tags1k.dat"
    path.write_bytes((line + "0\t" * 1000 + "\r\n").encode())
    with pytest.raises(DatasetFormatError) as error:
        NUSWIDE("test", root=str(root), label_set="zero_shot")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_tag_file_of_another_length_is_one_line(root: Path) -> None:
    (root / "NUS_WID_Tags" / "Test_Tags1k.dat").write_bytes(("0\t" * 1000 + "\r\n").encode())
    with pytest.raises(DatasetFormatError, match="1 lines; expected 2"):
        NUSWIDE("test", root=str(root), label_set="zero_shot")


# ---- experiment=zsl_nuswide_lesa and experiment=zsl_nuswide_mldecoder: each preset's images, classes and
# figures against its source, the values typed from the sources' code:
# LESA (hbdat/cvpr20_LESA at e40a7f2): zeroshot_experiments/NUS_WIDE_zs_rank_Visual_Word_Attention.py
#   (seen = TagList1k minus Concepts81, unseen = the 81; evaluate / evaluate_k with exclude=False: every
#   test image; k = 3 and 5 for ZSL and GZSL), extract_data/extract_full_NUS_WIDE_images_VGG_feature_2_
#   TFRecord.py (every image of the split's list, labelled or not; VGG-19 at its 224 px default).
# ML-Decoder (Alibaba-MIIL/ML_Decoder at 8a9e984): train_zsl_nus.py (TResNet-L, 448 px, Adam lr 1e-4,
#   weight decay 1e-2, OneCycle pct_start 0.2, 40 epochs, batch 56, EMA 0.9997, ASL gamma_neg 4, gamma_pos
#   0, clip 0.05, disable_torch_grad_focal_loss, decoder embedding 768, 925 classes), helper_functions.py
#   (get_relevant_samples: an image of a split is kept when one of its labels is among the split's classes).
LESA = {
    "dataset.name": "nuswide_zsl",
    "dataset.label_set": "zero_shot",
    "dataset.keep_empty": True,
    "dataset.image_size": 224,
    "metrics.zsl_images": "all",
    "text._target_": "mlcls.text.vectors.WordVectorsEncoder",  # GloVe 300-d (glove-wiki-gigaword-300)
}
MLDECODER = {
    "dataset.name": "nuswide_zsl",
    "dataset.label_set": "zero_shot",
    "dataset.keep_empty": False,
    "dataset.image_size": 448,
    "metrics.zsl_images": "unseen_positive",
    "text._target_": "mlcls.text.vectors.WordVectorsEncoder",
    "model.name": "tresnet_v2_l.miil_in21k",
    "model.head.name": "mldecoder_zsl",
    "model.head.embed_dim": 768,
    "optim._target_": "torch.optim.Adam",
    "optim.lr_head": 1e-4,
    "optim.lr_backbone": 1e-4,
    "optim.weight_decay": 1e-2,
    "sched.pct_start": 0.2,
    "trainer.epochs": 40,
    "trainer.batch_size": 56,
    "trainer.ema_decay": 0.9997,
    "loss.gamma_neg": 4.0,
    "loss.gamma_pos": 0.0,
    "loss.clip": 0.05,
    "loss.detach_weight": True,
}
# The training images each source keeps (list order; the animal image has no seen tag) and the test
# images it scores in ZSL once the sky image's concepts are cleared (it keeps a seen tag only).
PRESETS = {
    "zsl_nuswide_lesa": (LESA, [0, 1, 2, 3], [0, 1]),
    "zsl_nuswide_mldecoder": (MLDECODER, [0, 2, 3], [1]),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_each_zero_shot_preset_is_its_sources_protocol(root: Path, preset: str) -> None:
    from test_metrics_zero_shot import relevant_rows

    expected, train_rows, scored = PRESETS[preset]
    for concept in ("sky", "clouds"):
        (root / "Groundtruth" / "TrainTestLabels" / f"Labels_{concept}_Test.txt").write_bytes(b"0\r\n0\r\n")
    cfg = compose_config([f"experiment={preset}", f"dataset.root={root}", "text.path=glove.txt"])
    assert {key: OmegaConf.select(cfg, key) for key in expected} == expected
    assert cfg.model.head.name in TEXT_HEADS and ZERO_SHOT_TOP_K == (3, 5)
    check_config(cfg, world_size=1)
    full_train = NUSWIDE("train", root=str(root), label_set="zero_shot", keep_empty=True)
    train, test = build_dataset(cfg.dataset, train=True), build_dataset(cfg.dataset, train=False)
    assert len(train.classes) == 925 and len(test.classes) == 1006
    assert [sample.path for sample in train.samples] == [full_train.samples[i].path for i in train_rows]
    unseen = torch.tensor([name in set(NUSWIDE_CONCEPTS) for name in test.classes])
    assert int(unseen.sum()) == 81 and test.classes[-81:] == NUSWIDE_CONCEPTS
    labels = torch.as_tensor(test.labels)
    figures = zero_shot_metrics(torch.randn(labels.shape), labels, unseen, cfg.metrics.zsl_images)
    kept = relevant_rows(labels.numpy()[:, unseen.numpy()], list(range(81)))
    assert (
        figures["zsl"]["images"] == len(scored) == (len(test) if preset == "zsl_nuswide_lesa" else kept.sum())
    )
    assert figures["gzsl"]["images"] == len(test)
