"""The ``strong`` recipe: CutoutPIL's rectangle (the authors', pixel for pixel), the recipe's steps, a
squash-resize for evaluation, and an augmentation that is a function of the sample's seed on the
``torchvision`` and ``fast`` backends (exact resume); ``dali`` refuses it. The normalisation of every
transform: ``dataset.mean`` and ``dataset.std``, checked."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import PhotoFiles, write_photos
from PIL import Image, ImageDraw

from mlcls.data import DatasetConfigError, build_backend_transform, build_dataset
from mlcls.data.loader import DeviceStage, build_train_loader
from mlcls.data.pipeline.transforms import IMAGENET_MEAN, IMAGENET_STD, CutoutPIL, build_transform
from mlcls.data.sampling import seeded_call
from mlcls.errors import ConfigError
from mlcls.inference import preprocess_spec

SIZE = 48
GREY = (128, 128, 128)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_photos(tmp_path_factory.mktemp("jpegs"), 4)


def cut_region(image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """Mask (H, W) of the pixels that differ from the grey input, and its bounding box (l, t, r, b)."""
    changed = (np.asarray(image) != GREY).any(axis=-1)
    rows, cols = np.flatnonzero(changed.any(axis=1)), np.flatnonzero(changed.any(axis=0))
    return changed, (int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1)


def authors_cutout(image: Image.Image, cutout_factor: float) -> Image.Image:
    """The reference: ML-Decoder's ``CutoutPIL`` drawn as the authors draw it, ``ImageDraw.rectangle`` from
    ``c - k // 2`` to ``c + k // 2`` (both ends painted), ``k = int(f * side + 0.5)``, ends clipped to
    ``[0, side]``; the centre (column, row) and the colour taken from torch's generator in mlcls's order."""
    width, height = image.size
    k_columns, k_rows = int(cutout_factor * width + 0.5), int(cutout_factor * height + 0.5)
    x, y = int(torch.randint(width, (1,))), int(torch.randint(height, (1,)))
    colour = tuple(torch.randint(256, (3,)).tolist())
    box = [
        np.clip(x - k_columns // 2, 0, width),
        np.clip(y - k_rows // 2, 0, height),
        np.clip(x + k_columns // 2, 0, width),
        np.clip(y + k_rows // 2, 0, height),
    ]
    out = image.copy()
    ImageDraw.Draw(out).rectangle(box, fill=colour)
    return out


def test_cutout_paints_the_authors_rectangle() -> None:
    """At 448 px under ``torch.manual_seed(0)`` the centre is (172, 367) and the authors paint columns
    60-284 (225 columns, both ends of ``172 -+ 112``); over 200 draws at 448 px and at odd sizes and factors
    every painted image equals the authors' ``ImageDraw.rectangle`` (the old box, half-open and
    ``round(f * side)`` wide, differed in 383 of 400)."""
    grey = Image.new("RGB", (448, 448), GREY)
    torch.manual_seed(0)
    _, (left, top, right, bottom) = cut_region(CutoutPIL(0.5)(grey))
    assert (left, right - 1) == (60, 284) and (top, bottom - 1) == (367 - 112, 447)
    cases = [(448, 448, 0.5)] * 200 + [(45, 45, 0.3), (31, 31, 0.25), (9, 9, 1.0), (9, 9, 0.0)] * 25
    for seed, (width, height, factor) in enumerate(cases):
        image = Image.new("RGB", (width, height), GREY)
        torch.manual_seed(seed)
        ours = CutoutPIL(factor)(image)
        torch.manual_seed(seed)
        assert ours.tobytes() == authors_cutout(image, factor).tobytes(), (seed, factor)


def test_cutout_pastes_one_clipped_rectangle_of_one_colour() -> None:
    """On a 40 x 20 grey image, factor 0.5: a filled 21 x 11 rectangle (both ends of ``c -+ k // 2``),
    smaller only where it meets a border; its centre spreads over the whole image; the input is
    untouched."""
    grey = Image.new("RGB", (40, 20), GREY)
    cutout, centres, full_size = CutoutPIL(0.5), [], 0
    for seed in range(200):
        out = seeded_call(seed, cutout, grey)
        changed, (left, top, right, bottom) = cut_region(out)
        assert changed[top:bottom, left:right].all() and changed.sum() == (right - left) * (bottom - top)
        colours = np.asarray(out)[top:bottom, left:right].reshape(-1, 3)
        assert (colours == colours[0]).all()  # one colour
        width, height = right - left, bottom - top
        assert width <= 21 and height <= 11
        assert width == 21 or left == 0 or right == 40
        assert height == 11 or top == 0 or bottom == 20
        full_size += (width, height) == (21, 11)
        centres.append(((left + right) / 2, (top + bottom) / 2))
    assert np.asarray(grey).tolist() == np.full((20, 40, 3), 128).tolist()
    xs, ys = np.array(centres).T
    assert xs.min() < 8 and xs.max() > 32 and ys.min() < 4 and ys.max() > 16
    assert 10 < full_size < 190  # clipped at a border sometimes, not always
    with pytest.raises(ValueError, match=r"cutout_factor 1.5; expected a fraction"):
        CutoutPIL(1.5)


def test_strong_train_steps_are_the_recipe() -> None:
    """The order of the recipe's steps; its RandAugment is the package's
    (tests/test_engine_build_recipe.py)."""
    steps = build_transform("strong", SIZE, train=True).transforms
    assert [type(step).__name__ for step in steps] == [
        "Resize",
        "CutoutPIL",
        "RandAugment",
        "ToTensor",
        "Normalize",
    ]
    assert steps[0].size == (SIZE, SIZE) and steps[1].cutout_factor == 0.5
    assert type(steps[2]).__module__ == "randaugment.randaugment"
    assert tuple(steps[4].mean) == IMAGENET_MEAN and tuple(steps[4].std) == IMAGENET_STD


def test_strong_evaluates_on_a_squash_resize_without_crop() -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 150, 3), dtype=np.uint8))
    out = build_transform("strong", SIZE, train=False)(image)
    squashed = np.asarray(image.resize((SIZE, SIZE), Image.Resampling.BILINEAR), dtype=np.float32) / 255
    reference = (torch.from_numpy(squashed).permute(2, 0, 1) - torch.tensor(IMAGENET_MEAN)[:, None, None]) / (
        torch.tensor(IMAGENET_STD)[:, None, None]
    )
    assert out.shape == (3, SIZE, SIZE)
    torch.testing.assert_close(out, reference)


def test_crop_trains_on_torchvisions_random_resized_crop_and_flip_alone() -> None:
    """``crop`` (experiment=finetune): the draw of torchvision's own RandomResizedCrop (its default scales)
    and flip from the same seed, no colour change; evaluated on the whole image (EVAL_GEOMETRY)."""
    from torchvision import transforms as T

    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (90, 150, 3), dtype=np.uint8))
    reference = T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.ToTensor()])
    for seed in range(4):
        torch.manual_seed(seed)
        out = build_transform("crop", SIZE, train=True, mean=[0, 0, 0], std=[1, 1, 1])(image)
        torch.manual_seed(seed)
        assert torch.equal(out, reference(image))


@pytest.mark.parametrize("backend", ["torchvision", "fast"])
def test_strong_is_a_function_of_the_sample_seed(backend: str, jpegs: list[Path]) -> None:
    """Same seed, same tensor (whatever the generators held before); another seed, another tensor; the
    batches of a loader resumed mid-epoch are the tail of the uninterrupted epoch's."""
    dataset = PhotoFiles(jpegs * 2, build_backend_transform(backend, "strong", SIZE, train=True))
    first = seeded_call(7, dataset.__getitem__, 1)[0]
    torch.manual_seed(123)  # what the generators held before the call does not matter
    np.random.seed(123)
    random.seed(123)
    again = seeded_call(7, dataset.__getitem__, 1)[0]
    assert first.shape == (3, SIZE, SIZE) and torch.equal(first, again)
    others = [seeded_call(seed, dataset.__getitem__, 1)[0] for seed in (8, 9, 10)]
    assert not any(torch.equal(first, other) for other in others)

    def batches(start: int) -> list[torch.Tensor]:
        loader = build_train_loader(dataset, 2, 0, 0, 1, 3, torch.device("cpu"), backend=backend)
        loader.sampler.set_epoch(2)
        loader.sampler.set_start(start)
        return [images for images, _ in loader]

    epoch, resumed = batches(0), batches(2)
    assert len(epoch) == 4 and len(resumed) == 3
    assert all(torch.equal(a, b) for a, b in zip(epoch[1:], resumed, strict=True))


def test_dali_refuses_strong(jpegs: list[Path]) -> None:
    dataset = PhotoFiles(jpegs, build_backend_transform("dali", "strong", SIZE, train=True))
    with pytest.raises(DatasetConfigError, match="dali does the paper's augmentation only"):
        build_train_loader(dataset, 2, 0, 0, 1, 3, torch.device("cpu"), backend="dali")


# The evaluation geometry of a 150 x 90 image at SIZE 48, from torchvision's documented rules: ``paper``
# resizes the shorter side to round(48 / 0.875) = 55 (the longer to int(55 * 150 / 90) = 91), then crops
# 48 x 48 at (round(43 / 2), round(7 / 2)) = (22, 4); ``light`` and ``strong`` squash to 48 x 48.
EVAL_GEOMETRY = {
    "paper": ((91, 55), (22, 4, 70, 52)),
    "light": ((SIZE, SIZE), None),
    "strong": ((SIZE, SIZE), None),
    "crop": ((SIZE, SIZE), None),
}


@pytest.mark.parametrize("kind", ["paper", "light", "strong", "crop"])
def test_eval_transform_with_mean_0_and_std_1_gives_the_pixels_over_255(kind: str) -> None:
    """``dataset.mean=[0,0,0] dataset.std=[1,1,1]`` (the ML-Decoder presets): the network sees the resized
    pixels scaled to [0, 1], exactly, against PIL's resize and NumPy's division."""
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (90, 150, 3), dtype=np.uint8))
    resized_size, crop = EVAL_GEOMETRY[kind]
    resized = image.resize(resized_size, Image.Resampling.BILINEAR)
    pixels = np.asarray(resized.crop(crop) if crop else resized, dtype=np.float32) / np.float32(255)
    out = build_transform(kind, SIZE, train=False, mean=[0, 0, 0], std=[1, 1, 1])(image)
    assert out.dtype == torch.float32 and out.shape == (3, SIZE, SIZE)
    assert torch.equal(out, torch.from_numpy(pixels).permute(2, 0, 1))
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0


def test_datasets_normalise_with_their_config_keys() -> None:
    """``dataset.mean`` / ``dataset.std`` of a composed config reach the transform ``build_dataset`` builds
    for either split; a config without them (a checkpoint's of before the keys) normalises as ImageNet."""
    from conftest import compose_config
    from omegaconf import OmegaConf

    sizes = ["dataset.val_size=2", "dataset.train_size=2"]
    cfg = compose_config(["dataset=synthetic", "dataset.mean=[0.5,0.25,0]", "dataset.std=[0.5,2,1]", *sizes])
    cfg = cfg.dataset
    for dataset in (build_dataset(cfg, train=True), build_dataset(cfg, train=False)):
        normalize = dataset.transform.transforms[-1]
        assert (list(normalize.mean), list(normalize.std)) == ([0.5, 0.25, 0.0], [0.5, 2.0, 1.0])
    old = {k: v for k, v in OmegaConf.to_container(cfg).items() if k not in ("mean", "std")}
    normalize = build_dataset(old, train=False).transform.transforms[-1]
    assert (tuple(normalize.mean), tuple(normalize.std)) == (IMAGENET_MEAN, IMAGENET_STD)


@pytest.mark.parametrize(
    ("mean", "std", "message"),
    [
        ([0.5, 0.5], IMAGENET_STD, r"dataset.mean=\[0.5, 0.5\]; expected 3 numbers \(R, G, B\)$"),
        ("0.5", IMAGENET_STD, r"dataset.mean='0.5'; expected 3 numbers"),
        ([0.5, "x", 0.5], IMAGENET_STD, r"dataset.mean=\[0.5, 'x', 0.5\]; expected 3 numbers"),
        ([0.5, float("nan"), 0.5], IMAGENET_STD, r"dataset.mean=\[0.5, nan, 0.5\]; expected 3 numbers"),
        (IMAGENET_MEAN, [0.2, 0, 0.2], r"dataset.std=\[0.2, 0, 0.2\]; expected 3 numbers > 0 \(R, G, B\)$"),
        (IMAGENET_MEAN, [0.2, -1, 0.2], r"dataset.std=\[0.2, -1, 0.2\]; expected 3 numbers > 0"),
        (IMAGENET_MEAN, [1, 1, 1, 1], r"dataset.std=\[1, 1, 1, 1\]; expected 3 numbers > 0"),
        (IMAGENET_MEAN, [1] * 10_000, r"dataset.std=\[(1, ){18}1,\.\.\.; expected 3 numbers > 0"),
    ],
)
def test_bad_mean_or_std_is_a_one_line_config_error_everywhere(mean, std, message) -> None:
    """The torchvision transforms, the fast pipeline's device stage, ``build_dataset`` (before any image is
    read) and the preprocess spec of predict and export all refuse it, with the same line."""
    synthetic = {
        "_target_": "mlcls.data.datasets.synthetic.SyntheticMultiLabel",
        "image_size": 8,
        "val_size": 1,
        "mean": mean,
        "std": std,
    }
    for build in (
        lambda: build_transform("paper", SIZE, train=False, mean=mean, std=std),
        lambda: build_backend_transform("fast", "paper", SIZE, train=True, mean=mean, std=std),
        lambda: DeviceStage("cpu", mean=mean, std=std),
        lambda: build_dataset(synthetic, train=False),
        lambda: preprocess_spec({"image_size": SIZE, "mean": mean, "std": std}),
    ):
        with pytest.raises(ConfigError, match=message) as error:
            build()
        assert "\n" not in str(error.value)
