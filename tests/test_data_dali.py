"""The DALI backend's graph with CPU operators, against PIL's decode and resize, and its sampling against the
fast pipeline's. The graph tests need NVIDIA DALI (``pip install 'mlcls[dali]'``; not installed in CI) and are
skipped without it; the crop plans (pure Python) are tested everywhere, the loader with CUDA and DALI.

The GPU graph differs only in the decoder's device (nvJPEG, ``mixed``) and in running resize and flip on
the GPU; that, and the copy into torch (``feed_ndarray``), are not covered here.
"""

from __future__ import annotations

import re
import sys
import types
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from data_fixtures import PhotoFiles, corrupt, decode_rgb, truncate, write_photos, write_ramp
from PIL import Image
from torch.utils.data import DataLoader

from mlcls.data.datasets.base import BadImageError
from mlcls.data.images import read_image_bytes
from mlcls.data.pipeline.dali import (
    CropPlans,
    DaliUnavailableError,
    _build_pipeline,
    collate_plans,
    encoded_image_size,
    require_dali,
)
from mlcls.data.pipeline.fast import FastTrainTransform, resized_crop
from mlcls.data.sampling import SeededSamples, sample_seed

# Batches waiting for the CPU graph's source (``run_graph`` puts one, the graph takes it).
_QUEUED: deque[tuple[list, list, list]] = deque()

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
    return write_photos(tmp_path_factory.mktemp("jpegs"), 3)


@pytest.fixture(scope="module")
def ramp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ramp(tmp_path_factory.mktemp("ramp"))


def _queued_batch() -> tuple[list, list, list]:
    if not _QUEUED:
        raise StopIteration
    return _QUEUED.popleft()


@pytest.fixture(scope="module")
def dali() -> Any:
    return pytest.importorskip("nvidia.dali")


@pytest.fixture(scope="module")
def cpu_graph(dali: Any) -> Any:
    """The backend's DALI graph with CPU operators (batches of at most BATCH), built once."""
    pipeline = _build_pipeline(dali, BATCH, SIZE, _queued_batch, 1, "cpu", prefetch_depth=1)
    pipeline.build()
    return pipeline


def run_graph(pipeline: Any, encoded: list[np.ndarray], windows: list[np.ndarray], flips: list) -> Any:
    """The DALI ``TensorList`` of the graph's output for one batch."""
    _QUEUED.append((encoded, windows, [np.array(flip, dtype=np.int32) for flip in flips]))
    (images,) = pipeline.run()
    return images


def run_cpu(pipeline: Any, paths: list[Path], windows: list[tuple], flips: list[bool]) -> np.ndarray:
    """uint8 (B, SIZE, SIZE, 3) output of the graph for the files, ``(x, y, w, h)`` windows and flips."""
    encoded = [np.fromfile(path, dtype=np.uint8) for path in paths]
    images = run_graph(pipeline, encoded, [np.array(w, dtype=np.float32) for w in windows], flips)
    assert images.layout() == "HWC"
    return images.as_array()


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
        image = decode_rgb(path)
        expected = pil_window(image, window, flip).astype(int)
        error = np.abs(got[k] - expected)
        assert error[1:-1, 1:-1].max() <= 1, (window, error[1:-1, 1:-1].max())
        ring_errors.append(error.max())
        clamped = pil_window(image, window, flip, clamp=True).astype(int)
        assert np.abs(got[k] - clamped).max() <= 1, window
        assert np.abs(got[k] - expected[:, ::-1]).mean() > 10  # the opposite flip is far off
    x, y, _, _ = WINDOWS[-1]
    window_pixels = np.asarray(decode_rgb(paths[-1]))[y : y + SIZE, x : x + SIZE]
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
    decode_rgb(jpegs[0]).save(tagged, quality=90, exif=exif)
    with Image.open(tagged) as img:
        assert img.getexif()[0x0112] == 6 and img.size == (320, 240)
    window = (200, 20, 110, 210)  # would be out of range (and fail) in the rotated 240x320 image
    got = run_cpu(cpu_graph, [tagged], [window], [False])[0].astype(int)
    assert np.abs(got - pil_window(decode_rgb(tagged), window, False, clamp=True).astype(int)).max() <= 1


def test_crop_plans_draw_the_fast_pipelines_window_flip_and_colour(jpegs):
    """Under a sample's seed, ``CropPlans`` (as ``SeededSamples`` runs it) picks the crop window, flip and
    colour parameters the fast pipeline picks for that sample: its window is the full-size crop region
    ``FastTrainTransform.decode_bytes`` chooses, its flip whether the fast output is the mirrored crop, its
    parameters the fast output's."""
    dataset = PhotoFiles(jpegs * 2)
    fast = FastTrainTransform(SIZE, draft=False)  # full-size decoding: the region is in the file's pixels
    plans = SeededSamples(CropPlans(dataset, FastTrainTransform(SIZE)))
    flips = []
    for index in range(len(dataset)):
        for epoch in range(4):
            seed = sample_seed(7, epoch, index)
            encoded, window, flip, params, target = plans[(index, seed)]
            sample = dataset.samples[index]
            torch.manual_seed(seed)
            planned = fast.decode_bytes(read_image_bytes(sample.path), sample.box)
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
    dataset = PhotoFiles(jpegs * 2)
    plans = SeededSamples(CropPlans(dataset, FastTrainTransform(SIZE)))
    keys = [(index, sample_seed(3, 0, index)) for index in range(len(dataset))]
    loader = DataLoader(plans, batch_size=BATCH, sampler=keys, num_workers=1, collate_fn=collate_plans)
    ((encoded, windows, flips, params, targets),) = list(loader)
    assert params.shape == (BATCH, 9) and torch.equal(targets, dataset.labels)
    got = run_graph(cpu_graph, encoded, windows, flips).as_array().astype(int)
    for k, (window, flip) in enumerate(zip(windows, flips, strict=True)):
        expected = pil_window(
            decode_rgb(jpegs[k % len(jpegs)]), tuple(int(v) for v in window), flip, clamp=True
        )
        assert np.abs(got[k] - expected.astype(int)).max() <= 1, window


def test_build_pipeline_rejects_an_unknown_device(dali):
    with pytest.raises(ValueError, match="device='tpu'; expected one of gpu, cpu"):
        _build_pipeline(dali, 1, SIZE, _queued_batch, 1, "tpu")


def test_require_dali_names_what_is_missing(monkeypatch):
    # DALI importable (a stand-in where it is not installed), no CUDA device
    nvidia = sys.modules.get("nvidia") or types.ModuleType("nvidia")
    dali_module = sys.modules.get("nvidia.dali") or types.ModuleType("nvidia.dali")
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.dali", dali_module)
    monkeypatch.setattr(nvidia, "dali", dali_module, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DaliUnavailableError, match="needs a CUDA device; use data.backend=fast"):
        require_dali()
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import fails as if DALI were not installed
    with pytest.raises(DaliUnavailableError, match=r"needs NVIDIA DALI: pip install 'mlcls\[dali\]'"):
        require_dali()


def test_encoded_image_size_reads_headers_and_rejects_a_cut_jpeg(jpegs, tmp_path):
    """A cut JPEG's header still reads (PIL opens it, the old plans served it and the GPU decoder failed
    on one rank); the missing end-of-image marker gives it away. Bytes after the marker are allowed."""
    data = jpegs[0].read_bytes()
    assert encoded_image_size(data) == (320, 240)
    assert encoded_image_size(data + b"trailing camera data") == (320, 240)
    with pytest.raises(OSError, match="truncated"):
        encoded_image_size(data[: len(data) // 2])
    png = tmp_path / "x.png"
    decode_rgb(jpegs[0]).resize((50, 30)).save(png)
    assert encoded_image_size(png.read_bytes()) == (50, 30)
    with pytest.raises(OSError):
        encoded_image_size(b"this is not an image" * 10)


def _plan_files(tmp_path: Path, jpegs: list[Path], on_bad_image: str) -> tuple[PhotoFiles, list[Path]]:
    """Six copies of the photos; the second is corrupt, the third cut in half."""
    paths = []
    for k in range(6):
        path = tmp_path / f"{k}.jpg"
        path.write_bytes(jpegs[k % len(jpegs)].read_bytes())
        paths.append(path)
    corrupt(paths[1])
    truncate(paths[2])
    return PhotoFiles(paths, on_bad_image=on_bad_image), paths


def test_crop_plans_skip_unreadable_files_as_the_other_backends(jpegs, tmp_path):
    """``on_bad_image=skip``: samples 1 (corrupt) and 2 (cut) are served by sample 3, bytes and target,
    and both files are recorded, as the dataset's own reading does."""
    dataset, paths = _plan_files(tmp_path, jpegs, "skip")
    plans = SeededSamples(CropPlans(dataset, FastTrainTransform(SIZE)))
    for index, served in ((0, 0), (1, 3), (2, 3), (3, 3)):
        plan = plans[(index, sample_seed(0, 0, index))]
        assert np.array_equal(plan.encoded, np.fromfile(paths[served], dtype=np.uint8)), index
        assert torch.equal(plan.target, dataset.labels[served])
    assert dataset.pop_bad_images() == [str(paths[1]), str(paths[2])]


def test_crop_plans_name_an_unreadable_file_with_on_bad_image_error(jpegs, tmp_path):
    dataset, paths = _plan_files(tmp_path, jpegs, "error")
    plans = CropPlans(dataset, FastTrainTransform(SIZE))
    for index in (1, 2):
        with pytest.raises(BadImageError, match=f"cannot read image {re.escape(str(paths[index]))}"):
            plans[index]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the DALI loader needs CUDA")
def test_dali_loader_prefetches_and_restarts_after_an_early_stop(dali, jpegs):
    """With 2 batches decoded ahead: every epoch gives len(loader) batches whose targets follow the sampler,
    also after an epoch stopped early (the batches still scheduled are dropped)."""
    from mlcls.data.loader import build_train_loader

    dataset = PhotoFiles(jpegs * 4, FastTrainTransform(SIZE))  # 12 samples: 4 batches of 3
    loader = build_train_loader(dataset, 3, 0, 0, 1, seed=5, device=torch.device("cuda"), backend="dali")
    assert len(loader) == 4
    for stop in (1, None, 2, None):
        loader.sampler.set_epoch(0)
        order = [index for index, _ in loader.sampler]
        batches = []
        for images, targets in loader:
            batches.append((images, targets))
            if len(batches) == stop:
                break
        assert len(batches) == (stop or 4)
        for k, (images, targets) in enumerate(batches):
            assert images.pixels.shape == (3, 3, SIZE, SIZE) and images.pixels.is_cuda
            assert torch.equal(targets, dataset.labels[order[3 * k : 3 * k + 3]])
