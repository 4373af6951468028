"""The DALI backend's graph with CPU operators, against PIL's decode and resize, and its sampling against the
fast pipeline's. Needs NVIDIA DALI (``pip install 'mlcls[dali]'``; not installed in CI): skipped without it.

The GPU graph differs only in the decoder's device (nvJPEG, ``mixed``) and in running resize and flip on
the GPU; that, and the copy into torch (``feed_ndarray``), are not covered here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from mlcls.bench.pipeline_bench import make_jpegs
from mlcls.data.base import MultiLabelDataset, Sample
from mlcls.data.dali import (
    CropPlans,
    DaliUnavailableError,
    _build_pipeline,
    _collate,
    _run_pipeline,
    require_dali,
)
from mlcls.data.fast import FastTrainTransform, resized_crop
from mlcls.data.loader import SeededSamples, sample_seed

dali = pytest.importorskip("nvidia.dali")

SIZE = 48
BATCH = 6
# (x, y, w, h) windows of a 320x240 image: the whole image, inner and corner windows, shrunk 1.7-6.7x,
# stretched up to 1.6x (upscaling, at most 2x so that only the outer output ring reads past the window), and a
# SIZE x SIZE window at odd offsets, where the resize is the identity and the output is the decoded window.
WINDOWS = [(0, 0, 320, 240), (10, 20, 100, 80), (200, 100, 120, 140), (37, 5, 30, 40), (271, 191, 49, 49),
           (151, 61, SIZE, SIZE)]  # fmt: skip
FLIPS = [False, True, False, True, True, False]


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return make_jpegs(tmp_path_factory.mktemp("jpegs"), 3, size=(320, 240))


@pytest.fixture(scope="module")
def ramp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """512x384 JPEG whose red channel encodes x and green channel y (255 at the far edge)."""
    width, height = 512, 384
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 / (width - 1), y * 255 / (height - 1), np.full(x.shape, 128.0)], -1)
    path = tmp_path_factory.mktemp("ramp") / "ramp.jpg"
    Image.fromarray(pixels.round().astype(np.uint8)).save(path, quality=95)
    return path


@pytest.fixture(scope="module")
def cpu_graph() -> Any:
    """The backend's DALI graph with CPU operators (batches of at most BATCH), built once."""
    pipeline = _build_pipeline(dali, BATCH, SIZE, 1, "cpu")
    pipeline.build()
    return pipeline


def run_cpu(pipeline: Any, paths: list[Path], windows: list[tuple], flips: list[bool]) -> np.ndarray:
    """uint8 (B, SIZE, SIZE, 3) output of the graph for the files, ``(x, y, w, h)`` windows and flips."""
    encoded = [np.fromfile(path, dtype=np.uint8) for path in paths]
    images = _run_pipeline(pipeline, encoded, [np.array(w, dtype=np.float32) for w in windows], flips)
    assert images.layout() == "HWC"
    return images.as_array()


def full_decode(path: Path) -> Image.Image:
    with Image.open(path) as img:
        return img.convert("RGB")


def pil_window(image: Image.Image, window: tuple, flip: bool, clamp: bool = False) -> np.ndarray:
    """PIL's BILINEAR resize of the ``(x, y, w, h)`` window of ``image`` to SIZE x SIZE, mirrored if ``flip``.

    The filter reads the pixels around the window; with ``clamp``, the window's edge pixels repeated instead
    (DALI decodes the window only and its resize extends it so).
    """
    x, y, w, h = window
    if clamp:
        pad = max(w, h) // SIZE + 2  # beyond the filter's reach: half the scale factor, plus one pixel
        pixels = np.pad(np.asarray(image)[y : y + h, x : x + w], ((pad, pad), (pad, pad), (0, 0)), "edge")
        image, x, y = Image.fromarray(pixels), pad, pad
    out = np.asarray(image.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(x, y, x + w, y + h)))
    return out[:, ::-1] if flip else out


def test_cpu_graph_equals_pil_resize_of_the_window(cpu_graph, jpegs):
    """Against PIL's resize of the full decode: the identity-size window is PIL's decode exactly (the same
    libjpeg-turbo decoding); otherwise within 1 grey level (DALI's and PIL's triangle filters round their
    fixed-point weights and the intermediate uint8 image differently), except the outer ring of output
    pixels, whose filter footprint crosses the window's edge: PIL reads the pixels beyond the window (inside
    the image) or drops the missing ones (at the image's edge), DALI repeats the window's edge pixels. With
    the window edge-padded for PIL too, the whole output agrees within 1 level."""
    paths = [jpegs[k % len(jpegs)] for k in range(BATCH)]
    got = run_cpu(cpu_graph, paths, WINDOWS, FLIPS).astype(int)
    assert got.shape == (BATCH, SIZE, SIZE, 3)
    ring_errors = []
    for k, (path, window, flip) in enumerate(zip(paths, WINDOWS, FLIPS, strict=True)):
        image = full_decode(path)
        expected = pil_window(image, window, flip).astype(int)
        error = np.abs(got[k] - expected)
        assert error[1:-1, 1:-1].max() <= 1, (window, error[1:-1, 1:-1].max())
        ring_errors.append(error.max())
        clamped = pil_window(image, window, flip, clamp=True).astype(int)
        assert np.abs(got[k] - clamped).max() <= 1, window
        assert np.abs(got[k] - expected[:, ::-1]).mean() > 10  # the opposite flip is far off
    x, y, _, _ = WINDOWS[-1]
    window_pixels = np.asarray(full_decode(paths[-1]))[y : y + SIZE, x : x + SIZE]
    np.testing.assert_array_equal(got[-1], window_pixels)
    assert max(ring_errors) > 1  # the ring does differ: the model above is what the test verifies


def _ramp_coordinates(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x per output column and y per output row (ramp pixel coordinates), averaged over the other axis."""
    return pixels[..., 0].mean(0) * 511 / 255, pixels[..., 1].mean(1) * 383 / 255


def test_cpu_graph_window_is_anchor_and_size_in_pixels_and_flip_mirrors_x(cpu_graph, ramp):
    """On the coordinate ramp, output column c must show x = x0 + (c + 0.5) * w / SIZE - 0.5 (pixel-centre
    sampling of the window) and row r y = y0 + (r + 0.5) * h / SIZE - 0.5; a line fitted over the inner
    columns (rows) recovers the anchor to 1 px and the window's size to 1 % (one grey level is 2 px). Flip
    reverses the columns only. The windows with x0 + w > 384 would be out of range if read in (y, x) order,
    and all would be fractions of the image if read as normalised."""
    windows = [(300, 40, 160, 120), (300, 40, 160, 120), (17, 250, 90, 130), (400, 0, 112, 384)]
    flips = [False, True, False, True]
    got = run_cpu(cpu_graph, [ramp] * len(windows), windows, flips).astype(float)
    inner = np.arange(1, SIZE - 1)
    for pixels, (x0, y0, w, h), flip in zip(got, windows, flips, strict=True):
        xs, ys = _ramp_coordinates(pixels)
        if flip:
            assert xs[0] > xs[-1]
            xs = xs[::-1]
        for coords, start, length in ((xs, x0, w), (ys, y0, h)):
            slope, intercept = np.polyfit(inner + 0.5, coords[inner], 1)
            assert abs(slope * SIZE - length) <= 0.01 * length, (x0, y0, w, h, slope * SIZE)
            assert abs(intercept + 0.5 - start) <= 1.0, (x0, y0, w, h, intercept + 0.5)
    np.testing.assert_allclose(got[1], got[0][:, ::-1])


def test_cpu_graph_ignores_exif_orientation(cpu_graph, jpegs, tmp_path):
    """The window is in the stored pixels' coordinates, as PIL's size and the other backends see them: an
    EXIF orientation tag (6: rotate 90 degrees to display) must not rotate DALI's decode."""
    tagged = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    full_decode(jpegs[0]).save(tagged, quality=90, exif=exif)
    with Image.open(tagged) as img:
        assert img.getexif()[0x0112] == 6 and img.size == (320, 240)
    window = (200, 20, 110, 210)  # would be out of range (and fail) in the rotated 240x320 image
    got = run_cpu(cpu_graph, [tagged], [window], [False])[0].astype(int)
    assert np.abs(got - pil_window(full_decode(tagged), window, False, clamp=True).astype(int)).max() <= 1


class _Files(MultiLabelDataset):
    """JPEG files, every other one with a crop box; no transform (``CropPlans`` reads the samples)."""

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self.classes = ["a", "b"]
        self.samples = [
            Sample(str(p), None if k % 2 else (20.0, 10.0, 200.0, 150.0)) for k, p in enumerate(paths)
        ]
        self.labels = torch.eye(2)[torch.arange(len(paths)) % 2]


def test_crop_plans_draw_the_fast_pipelines_window_flip_and_colour(jpegs):
    """Under a sample's seed, ``CropPlans`` (as ``SeededSamples`` runs it) picks the crop window, flip and
    colour parameters the fast pipeline picks for that sample: its window is the full-size crop region
    ``FastTrainTransform.decode`` chooses, its flip whether the fast output is the mirrored crop, its
    parameters the fast output's."""
    dataset = _Files(jpegs * 2)
    fast = FastTrainTransform(SIZE, draft=False)  # full-size decoding: the region is in the file's pixels
    plans = SeededSamples(CropPlans(dataset, FastTrainTransform(SIZE)))
    flips = []
    for index in range(len(dataset)):
        for epoch in range(4):
            seed = sample_seed(7, epoch, index)
            encoded, window, flip, params, target = plans[(index, seed)]
            sample = dataset.samples[index]
            torch.manual_seed(seed)
            planned = fast.decode(sample.path, sample.box)
            output = fast(planned)
            left, top, right, bottom = planned.region
            np.testing.assert_array_equal(window, [left, top, right - left, bottom - top])
            unflipped = resized_crop(planned.image, planned.region, SIZE)
            assert torch.equal(output.pixels, unflipped.flip(-1) if flip else unflipped)
            assert torch.equal(params, output.params)
            assert torch.equal(target, dataset.labels[index])
            assert np.array_equal(encoded, np.fromfile(sample.path, dtype=np.uint8))
            if sample.box is not None:
                assert left >= 20 and top >= 10 and right <= 220 and bottom <= 160
            flips.append(flip)
    assert 0 < sum(flips) < len(flips)


def test_loader_batches_run_through_the_cpu_graph(cpu_graph, jpegs):
    """A batch of plans as ``DaliTrainLoader`` feeds it (``SeededSamples(CropPlans)``, ``_collate``, a worker
    process) gives, per sample, PIL's resize of its window (edge-padded, see above), flipped as planned."""
    dataset = _Files(jpegs * 2)
    plans = SeededSamples(CropPlans(dataset, FastTrainTransform(SIZE)))
    keys = [(index, sample_seed(3, 0, index)) for index in range(len(dataset))]
    loader = DataLoader(plans, batch_size=BATCH, sampler=keys, num_workers=1, collate_fn=_collate)
    ((encoded, windows, flips, params, targets),) = list(loader)
    assert params.shape == (BATCH, 9) and torch.equal(targets, dataset.labels)
    got = _run_pipeline(cpu_graph, encoded, windows, flips).as_array().astype(int)
    for k, (window, flip) in enumerate(zip(windows, flips, strict=True)):
        expected = pil_window(
            full_decode(jpegs[k % len(jpegs)]), tuple(int(v) for v in window), flip, clamp=True
        )
        assert np.abs(got[k] - expected.astype(int)).max() <= 1, window


def test_build_pipeline_rejects_an_unknown_device():
    with pytest.raises(ValueError, match="device='tpu'; expected one of gpu, cpu"):
        _build_pipeline(dali, 1, SIZE, 1, "tpu")


def test_require_dali_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DaliUnavailableError, match="needs a CUDA device; use data.backend=fast"):
        require_dali()
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import fails as if DALI were not installed
    with pytest.raises(DaliUnavailableError, match=r"needs NVIDIA DALI: pip install 'mlcls\[dali\]'"):
        require_dali()
