"""``data.backend=gpu`` against independent references: torchvision's random draws, the fast pipeline's
pixels, torchvision's evaluation transform on PIL's decode; its CPU path, its decode chunks, and the host
reads of its device stage (none). The same code runs on the CPU (``decode_jpeg(device="cpu")``) and, where
CUDA exists, on the GPU (nvJPEG)."""

from __future__ import annotations

import io
import weakref
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from data_fixtures import PhotoFiles, decode_rgb, write_photos
from hostile import bounded
from PIL import Image
from torchvision import transforms as T

from mlcls.data import build_backend_transform
from mlcls.data.datasets.base import BadImageError
from mlcls.data.loader import (
    DevicePrefetcher,
    DeviceStage,
    EvalBatches,
    build_eval_loader,
    build_train_loader,
    collate_batch,
)
from mlcls.data.pipeline import device_decode, gpu, jpeg
from mlcls.data.pipeline.fast import FastTrainTransform
from mlcls.data.pipeline.gpu import (
    FLIP,
    HEIGHT,
    LEFT,
    TOP,
    WIDTH,
    EncodedBatch,
    GpuEvalTransform,
    GpuTrainTransform,
    chunks,
    decode_on_device,
)
from mlcls.data.pipeline.transforms import IMAGENET_STD, build_transform, eval_resize
from mlcls.data.sampling import SeededSamples

# torchvision 0.29 deprecates its codecs; mlcls.data.pipeline.gpu ignores the warning, pytest shows it.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding:DeprecationWarning")
SIZE = 64
CPU = torch.device("cpu")
# Measured here (2026-11, 8 images of 320 x 240, seeds 100-107): the device path's pixels against the fast
# pipeline's full-size decoding + torch's antialiased uint8 resize differ by at most 1 grey level (mean
# 0.13: float weights here, 16-bit fixed point with a rounded intermediate pass there); against the fast
# pipeline's default reduced-scale decoding (libjpeg's DCT scaling when the crop is 2x the output or more)
# by a mean of 1.3 levels, at most ~20 at sharp edges.
FULL_SIZE_MAX_LEVELS, DRAFT_MEAN_LEVELS = 1, 2.0


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_photos(tmp_path_factory.mktemp("photos"), 8)


def _batch(dataset, seeds: range) -> tuple:
    """The collated batch of samples 0.. of ``dataset`` under ``seeds``, as a DataLoader worker makes it."""
    samples = SeededSamples(dataset)
    return collate_batch([samples[(k, seed)] for k, seed in enumerate(seeds)])


def _encoded(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, **{"format": "JPEG", **options})
    return out.getvalue()


def test_workers_draw_torchvisions_crop_flip_and_colour_as_the_fast_pipeline(photos):
    """Under one seed, the crop window, flip and colour parameters are torchvision's draws in the fast
    pipeline's order (RandomResizedCrop.get_params, the flip's rand, ColorJitter.get_params, the lighting
    randn), exactly, inside the sample's box when it has one; the colour parameters are the fast
    pipeline's."""
    dataset = PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE)))
    batch, _ = _batch(dataset, range(100, 108))
    fast_batch, _ = _batch(PhotoFiles(photos, FastTrainTransform(SIZE)), range(100, 108))
    assert isinstance(batch, EncodedBatch) and len(batch.pixels) == 0 and batch.params.shape == (8, 9)
    assert torch.equal(batch.params, fast_batch.params)
    jitter = T.ColorJitter(0.4, 0.4, 0.4)
    for k, seed in enumerate(range(100, 108)):
        box = dataset.samples[k].box
        left, top, width, height = (0, 0, 320, 240) if box is None else (20, 10, 200, 150)
        torch.manual_seed(seed)
        i, j, h, w = T.RandomResizedCrop.get_params(
            torch.empty(3, height, width), [0.08, 1.0], [3 / 4, 4 / 3]
        )
        flip = bool(torch.rand(1) < 0.5)
        order, *factors = jitter.get_params(jitter.brightness, jitter.contrast, jitter.saturation, None)
        alpha = torch.randn(3) * 0.1
        geometry = batch.geometry[k]
        assert (geometry[LEFT], geometry[TOP], geometry[WIDTH], geometry[HEIGHT]) == (left + j, top + i, w, h)
        assert bool(geometry[FLIP]) == flip
        assert batch.params[k, :3].tolist() == [c for c in order.tolist() if c != 3]
        assert batch.params[k, 3:6].tolist() == pytest.approx([f for f in factors[:3]])
        assert batch.params[k, 6:].tolist() == pytest.approx(alpha.tolist())


def test_pixels_agree_with_the_fast_pipeline_within_the_stated_tolerance(photos):
    """The device path (on the CPU here) against the fast pipeline under the same seeds: within
    FULL_SIZE_MAX_LEVELS of its full-size decoding, within DRAFT_MEAN_LEVELS on average of its default
    reduced-scale decoding; the finished batches then differ by that much over the colour stage."""
    seeds = range(100, 108)
    batch, _ = _batch(PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE))), seeds)
    pixels = decode_on_device(batch, CPU)
    full, _ = _batch(PhotoFiles(photos, FastTrainTransform(SIZE, draft=False)), seeds)
    draft, _ = _batch(PhotoFiles(photos, FastTrainTransform(SIZE)), seeds)
    assert pixels.shape == (8, 3, SIZE, SIZE) and pixels.dtype == torch.uint8
    difference = (pixels.int() - full.pixels.int()).abs()
    assert difference.max() <= FULL_SIZE_MAX_LEVELS and difference.float().mean() < 0.3
    assert (pixels.int() - draft.pixels.int()).abs().float().mean() < DRAFT_MEAN_LEVELS
    stage = DeviceStage(CPU)  # one level, through at most three jitter factors of 1.4, over the std
    torch.testing.assert_close(stage(batch), stage(full), atol=1.4**3 / 255 / min(IMAGENET_STD), rtol=0)


@pytest.mark.parametrize("kind", ["paper", "light"])
def test_evaluation_matches_the_plain_evaluation_transform(photos, kind):
    """Resize + centre crop (``paper``) or the squash-resize (``light``) on the device path against
    torchvision's transform on PIL's decode (of the box's crop for the samples with one): within one level
    before normalisation, through the loader the trainer evaluates with."""
    dataset = PhotoFiles(photos, build_backend_transform("gpu", kind, SIZE, train=False))
    assert isinstance(dataset.transform, GpuEvalTransform)
    loader = build_eval_loader(dataset, 4, 0, 0, 1, CPU)
    assert isinstance(loader, EvalBatches) and len(loader) == 2 and loader.dataset is dataset
    got = torch.cat([images for images, _ in loader])
    plain = build_transform(kind, SIZE, False)
    expected = []
    for sample in dataset.samples:
        image = decode_rgb(Path(sample.path))
        if sample.box is not None:
            image = image.crop((20, 10, 220, 160))
        expected.append(plain(image))
    tolerance = 1.01 / 255 / min(IMAGENET_STD)
    torch.testing.assert_close(got, torch.stack(expected), atol=tolerance, rtol=0)
    if kind == "paper":
        assert eval_resize(SIZE) == 73 and dataset.transform.grid(320, 240) == (97, 73, 16, 4)


def test_the_trainers_evaluation_reads_the_gpu_evaluation_loader(photos):
    """``evaluate`` (the trainer's and mlcls-eval's) over the loader ``build_eval_loader`` gives a dataset of
    the gpu evaluation transform: the images come decoded and normalised on the device, the targets from
    the host, every sample scored once; the same scores as over the plain transform within rounding."""
    from mlcls.engine.evaluate import evaluate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 2))
    scores = {}
    for backend in ("gpu", "fast"):
        dataset = PhotoFiles(photos, build_backend_transform(backend, "paper", SIZE, train=False))
        evaluation = evaluate(model, build_eval_loader(dataset, 3, 0, 0, 1, CPU), CPU, dataset.classes)
        assert evaluation.scores.shape == (8, 2) and torch.equal(
            evaluation.labels, dataset.labels.to(torch.int8)
        )
        scores[backend] = evaluation.scores
    torch.testing.assert_close(scores["gpu"], scores["fast"], atol=0.02, rtol=0)


def test_files_the_device_does_not_take_go_through_the_fast_cpu_path(photos, tmp_path):
    """PNG, progressive, greyscale and CMYK JPEGs: the fast pipeline's own output, bit for bit, under the
    same seed, placed among the device samples of their batch; a JPEG cut short raises the fast pipeline's
    OSError, so ``dataset.on_bad_image=skip`` serves the next sample."""
    with Image.open(photos[0]) as img:
        rgb = img.convert("RGB")
    files = {
        "png": _encoded(rgb, format="PNG"),
        "progressive": _encoded(rgb, progressive=True),
        "grey": _encoded(rgb.convert("L")),
        "cmyk": _encoded(rgb.convert("CMYK")),
    }
    paths = []
    for name, data in files.items():
        paths.append(tmp_path / f"{name}.img")
        paths[-1].write_bytes(data)
    paths = [photos[1], *paths, photos[2]]
    seeds = range(7, 7 + len(paths))
    batch, _ = _batch(PhotoFiles(paths, GpuTrainTransform(FastTrainTransform(SIZE))), seeds)
    assert batch.lengths.tolist()[1:-1] == [0, 0, 0, 0] and min(batch.lengths[[0, -1]]) > 0
    fast, _ = _batch(PhotoFiles(paths, FastTrainTransform(SIZE)), seeds)
    assert torch.equal(batch.pixels, fast.pixels[1:-1])
    pixels = decode_on_device(batch, CPU)
    assert torch.equal(pixels[1:-1], fast.pixels[1:-1]) and torch.equal(batch.params, fast.params)
    truncated = tmp_path / "cut.jpg"
    truncated.write_bytes(photos[3].read_bytes()[:4000])
    with pytest.raises(BadImageError, match="cut.jpg"):
        PhotoFiles([truncated, photos[4]], GpuTrainTransform(FastTrainTransform(SIZE)))[0]
    skipping = PhotoFiles([truncated, photos[4]], GpuTrainTransform(FastTrainTransform(SIZE)), "skip")
    assert len(skipping[0][0].data) > 0 and skipping.pop_bad_images() == [str(truncated)]


def test_a_jpeg_only_the_decoder_finds_damaged_is_decoded_by_pil(photos, monkeypatch):
    """A batched decode that fails (damage past the header) is retried image by image; the image the
    decoder refuses is decoded by PIL, as the fast pipeline's fallback: the batch comes out whole."""
    batch, _ = _batch(PhotoFiles(photos[:4], GpuTrainTransform(FastTrainTransform(SIZE))), range(4))
    expected = decode_on_device(batch, CPU)
    refused = photos[2].read_bytes()
    real = device_decode.decode_jpeg

    def refusing(data, **options):
        files = data if isinstance(data, list) else [data]
        if any(f.numpy().tobytes() == refused for f in files):
            raise RuntimeError("nvjpeg: bitstream error")
        return real(data, **options)

    monkeypatch.setattr(device_decode, "decode_jpeg", refusing)
    assert torch.equal(decode_on_device(batch, CPU), expected)


def test_chunks_bound_the_decoded_and_padded_pixels_and_keep_the_batch_order(photos, monkeypatch):
    """Every chunk of more than one image stays within the budget (decoded pixels, count x tallest x widest
    window, twice its resize weights); chunks cover each sample once; a batch decoded in chunks of two
    images (its budget read when called: a default argument bound at import made this vacuous) equals the
    batch decoded at once within one grey level at 1 pixel in 1,000 at most (the products' float sums run
    over the group's padded size, in another order; measured: 1 level at 3e-5 of the values)."""
    generator = np.random.default_rng(0)
    geometry = np.zeros((50, 12), dtype=np.int64)
    geometry[:, 0], geometry[:, 1] = generator.integers(50, 400, 50), generator.integers(50, 400, 50)
    geometry[:, WIDTH], geometry[:, HEIGHT], geometry[:, gpu.SIZE] = (
        geometry[:, 0] // 2,
        geometry[:, 1] // 2,
        64,
    )
    budget = 200_000
    parts = chunks(geometry, budget)
    assert sorted(np.concatenate(parts).tolist()) == list(range(50)) and len(parts) > 3
    for part in parts:
        rows = geometry[part]
        tallest, widest = rows[:, HEIGHT].max(), rows[:, WIDTH].max()
        weights = len(part) * 64 * (tallest + widest)
        assert len(part) == 1 or (
            int((rows[:, 0] * rows[:, 1]).sum()) <= budget
            and len(part) * tallest * widest <= budget
            and 2 * weights <= budget
        )
    batch, _ = _batch(PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE))), range(20, 28))
    whole = decode_on_device(batch, CPU)
    decoded, real = [], gpu.decode_images
    monkeypatch.setattr(
        gpu, "decode_images", lambda files, device: decoded.append(len(files)) or real(files, device)
    )
    monkeypatch.setattr(gpu, "DECODE_PIXELS", 2 * 320 * 240)
    difference = (decode_on_device(batch, CPU).int() - whole.int()).abs()
    assert decoded == [2, 2, 2, 2] and difference.max() <= 1 and (difference > 0).float().mean() < 1e-3


def test_each_resize_groups_decoded_images_are_released_once_it_is_resized(photos, monkeypatch):
    """A chunk's decoded images are held only until their resize group has read them: when a group is
    resized, the images alive beside its own are those of the groups still to come, and ``resize_windows``
    empties the list it was given (before: the whole chunk stayed alive through every group's resize)."""
    batch, _ = _batch(PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE))), range(30, 38))
    monkeypatch.setattr(gpu, "MAX_PADDING", 1)  # a group per window size: several groups a chunk
    decoded, groups, emptied = [], [], []
    real_decode, real_resize = gpu.decode_images, gpu.resize_windows

    def decoding(files, device):
        images = real_decode(files, device)
        decoded.extend(weakref.ref(image) for image in images)
        return images

    def resizing(images, geometry, device):
        alive = sum(ref() is not None for ref in decoded)
        to_come = len(decoded) - sum(groups) - len(images)
        groups.append(len(images))
        assert alive - len(images) == to_come, (alive, len(images), to_come)
        out = real_resize(images, geometry, device)
        emptied.append(images == [])
        return out

    monkeypatch.setattr(gpu, "decode_images", decoding)
    monkeypatch.setattr(gpu, "resize_windows", resizing)
    assert decode_on_device(batch, CPU).shape == (8, 3, SIZE, SIZE)
    assert len(groups) > 2 and sum(groups) == len(decoded) == 8 and all(emptied)


def test_the_device_stage_reads_nothing_back(photos, host_reads):
    """The input stage as it runs on a GPU (batched colour work): decoding, cropping, resizing, flipping,
    colour and normalisation call no host-reading tensor method and copy no value from the host (on CUDA
    each would wait for the queued kernels); its host-side plan is NumPy's."""
    batch, _ = _batch(PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE))), range(8))
    evaluation, _ = _batch(PhotoFiles(photos, GpuEvalTransform(SIZE)), range(8))
    train_stage, eval_stage = DeviceStage(CPU, channels_last=True, batched=True), DeviceStage(CPU)
    host_reads.clear()  # making the batches and the stages' constants (once per run) reads values
    images, evaluated = train_stage(batch), eval_stage(evaluation)
    assert host_reads == []
    assert images.shape == evaluated.shape == (8, 3, SIZE, SIZE) and images.dtype == torch.float32


def test_build_backend_transform_gives_the_gpu_transforms():
    train = build_backend_transform("gpu", "paper", 224, train=True)
    assert isinstance(train, GpuTrainTransform) and train.size == 224 and train.torch_random_only
    evaluation = build_backend_transform("gpu", "strong", 96, train=False, mean=[0, 0, 0], std=[1, 1, 1])
    assert isinstance(evaluation, GpuEvalTransform) and evaluation.grid(500, 300) == (96, 96, 0, 0)
    assert (evaluation.mean, evaluation.std) == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    light = build_backend_transform("gpu", "light", 32, train=True)  # runs whole in the workers
    assert repr(light) == repr(build_transform("light", 32, True))


@pytest.mark.slow
def test_the_header_walk_of_a_jpeg_padded_with_fill_bytes_is_bounded(photos):
    """A JPEG with 32 MiB of 0xFF fill bytes after its start marker (libjpeg skips them: a valid file): the
    workers' walk to its frame marker stops after MAX_HEADER_MARKERS markers, within 5 s and 512 MB, and
    leaves the file to the CPU path (walking the whole fill took 9.9 s here)."""
    crafted = b"\xff\xd8" + b"\xff" * 2**25 + photos[0].read_bytes()[2:]
    outcome = bounded(gpu.device_jpeg_size, crafted, memory_mb=512, seconds=5)
    assert not outcome.escaped, outcome
    assert outcome.error is None and outcome.value is None
    assert gpu.device_jpeg_size(photos[0].read_bytes()) == (320, 240)


@pytest.mark.slow
def test_batches_are_the_same_with_worker_processes_and_when_read_again(photos):
    """DataLoader workers (their batches' files in shared memory) give the batches of the main process,
    so resume is exact whatever the workers."""
    dataset = PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE)))

    def batches(workers: int) -> list[torch.Tensor]:
        loader = build_train_loader(dataset, 4, workers, 0, 1, 3, CPU, backend="gpu")
        loader.sampler.set_epoch(1)
        return [images for images, _ in DevicePrefetcher(loader, DeviceStage(CPU))]

    first, parallel = batches(0), batches(2)
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, parallel, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decoding_agrees_with_the_cpu_without_host_syncs(photos):
    """nvJPEG on the GPU against libjpeg-turbo on the CPU, through the side-stream prefetcher, under
    ``torch.cuda.set_sync_debug_mode("error")``: the same draws, pixels within a few levels (nvJPEG's IDCT
    and chroma upsampling are not libjpeg's), no synchronisation with the host; the input stage's peak
    memory for this batch is printed for the GPU check's log."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    dataset = PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE)))
    batch, _ = _batch(dataset, range(8))
    expected = decode_on_device(batch, CPU)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(cuda)
    before = torch.cuda.memory_allocated(cuda)
    loader = build_train_loader(dataset, 8, 0, 0, 1, 3, cuda, backend="gpu")
    stage, got = DeviceStage(cuda), []  # its constants copied to the device once, before the loop
    torch.cuda.set_sync_debug_mode("error")
    try:
        for images, _ in DevicePrefetcher(loader, stage):
            got.append(images * 1.0)
        pixels = decode_on_device(batch, cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"input stage peak: {(torch.cuda.max_memory_allocated(cuda) - before) / 2**20:.1f} MiB")
    difference = (pixels.cpu().int() - expected.int()).abs().float()
    assert difference.mean() < 1.5 and difference.quantile(0.99) <= 8, (difference.mean(), difference.max())
    assert len(got) == 1 and got[0].device == cuda and got[0].shape == (8, 3, SIZE, SIZE)


def _jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """``(marker, position, length)`` of the segments of ``data`` before its first scan."""
    out, position = [], 2
    while data[position + 1] != 0xDA:
        length = (data[position + 2] << 8) | data[position + 3]
        out.append((data[position + 1], position, length))
        position += 2 + length
    return out


def _bad_scan_jpeg(kind: str) -> bytes:
    """A 16 x 16 YCbCr JPEG of 600-750 bytes whose baseline (SOF0) header simplejpeg reads as sound, bad in
    a way only decoding finds: 12-bit samples, no quantisation table, or progressive scans."""
    noise = np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    data = bytearray(_encoded(Image.fromarray(noise), quality=50, progressive=kind == "progressive scans"))
    for marker, position, length in reversed(_jpeg_segments(bytes(data))):
        if marker == 0xC0 and kind == "12-bit":
            data[position + 4] = 12
        elif marker == 0xC2:
            data[position + 1] = 0xC0
        elif marker == 0xDB and kind == "no DQT":
            del data[position : position + 2 + length]
    return bytes(data)


@pytest.mark.parametrize("kind", ["12-bit", "no DQT", "progressive scans"])
def test_a_jpeg_only_decoding_finds_bad_is_skipped_or_refused_in_one_line(photos, tmp_path, kind):
    """A sound SOF0 header over a file the decoders refuse: the workers send it to the CPU path, where
    ``dataset.on_bad_image`` applies as with the fast backend: with ``skip`` the next sample is served (its
    target with it) and the file is reported; with ``error``, one line naming it. (Before: the workers
    handed it to the device, whose decode stopped the batch with ``skip`` too, or decoded it.)"""
    data = _bad_scan_jpeg(kind)
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    assert 550 < len(data) < 800 and (width, height, colorspace) == (16, 16, "YCbCr")
    path = tmp_path / f"{kind.replace(' ', '_')}.jpg"
    path.write_bytes(data)
    paths = [photos[0], path, photos[1]]
    skipping = PhotoFiles(paths, GpuTrainTransform(FastTrainTransform(SIZE)), "skip")
    batch, targets = _batch(skipping, range(3))
    assert decode_on_device(batch, CPU).shape == (3, 3, SIZE, SIZE)
    assert skipping.pop_bad_images() == [str(path)]
    assert targets.tolist() == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # sample 2 (even: [1, 0]) for sample 1
    with pytest.raises(BadImageError, match=f"cannot read image {path}") as refused:
        _batch(PhotoFiles(paths, GpuTrainTransform(FastTrainTransform(SIZE))), range(3))
    assert "\n" not in str(refused.value)


def test_the_end_of_image_check_reads_the_tail_as_the_whole_file_would():
    """:func:`jpeg.ends_after_its_last_scan` against its definition over the whole file (the last EOI marker
    after the last SOS marker): whole, cut short, with trailing bytes shorter and longer than the tail
    searched, with a scan after the end marker."""
    data = _encoded(Image.new("RGB", (64, 48), (90, 120, 30)))
    variants = [
        data,
        data[:-2],
        data[: len(data) // 2],
        data + b"\x00" * 100,
        data + b"\x00" * (2 * jpeg.EOI_TAIL),
        data + b"\xff\xda\x00\x08" + b"\x00" * 100,
        data + b"\xff\xda" + b"\x00" * (2 * jpeg.EOI_TAIL),
    ]
    got = [jpeg.ends_after_its_last_scan(variant) for variant in variants]
    assert got == [v.rfind(b"\xff\xd9") > v.rfind(b"\xff\xda") for v in variants]
    assert got == [True, False, False, True, True, False, False]


def _decode_claimed_size(paths: list[Path]) -> tuple[tuple[int, ...], list[str]]:
    dataset = PhotoFiles(paths, GpuTrainTransform(FastTrainTransform(SIZE)), "skip")
    batch, _ = _batch(dataset, range(len(paths)))
    return tuple(decode_on_device(batch, CPU).shape), dataset.pop_bad_images()


@pytest.mark.slow
def test_a_jpeg_header_claiming_more_pixels_than_its_bytes_encode_is_refused(photos, tmp_path):
    """A 1.6 kB baseline JPEG whose frame header says 4096 x 4096: refused by the workers from its header
    (:func:`mlcls.data.images.check_encoded_size`), skipped with ``on_bad_image=skip``, in bounded memory.
    (Before: the device path decoded each at full size, 48 MB a file; four in a batch escaped 768 MB.)"""
    data = bytearray(_encoded(Image.new("RGB", (64, 64), (200, 30, 90))))
    frame = next(position for marker, position, _ in _jpeg_segments(bytes(data)) if marker == 0xC0)
    data[frame + 5 : frame + 9] = (4096).to_bytes(2, "big") * 2
    assert simplejpeg.decode_jpeg_header(bytes(data))[:2] == (4096, 4096) and len(data) < 2000
    with pytest.raises(Image.DecompressionBombError, match=f"4096 x 4096 pixels in {len(data)} bytes"):
        gpu.device_jpeg_size(bytes(data))
    claims = []
    for k in range(4):
        claims.append(tmp_path / f"claim{k}.jpg")
        claims[-1].write_bytes(bytes(data))
    outcome = bounded(_decode_claimed_size, [*claims, photos[0]], memory_mb=768, seconds=20)
    assert not outcome.escaped, outcome
    assert outcome.value == ((5, 3, SIZE, SIZE), sorted(map(str, claims)))


def test_resize_groups_bound_their_padding_and_cover_the_chunk():
    """Every group :func:`gpu.window_groups` makes of random windows pads at most MAX_PADDING times its
    windows' pixels (or holds one window); the groups cover each window once."""
    generator = np.random.default_rng(1)
    geometry = np.zeros((200, 12), dtype=np.int64)
    geometry[:, WIDTH] = generator.integers(20, 640, 200)
    geometry[:, HEIGHT] = generator.integers(20, 480, 200)
    groups = gpu.window_groups(geometry)
    assert sorted(np.concatenate(groups).tolist()) == list(range(200)) and 1 < len(groups) < 40
    for group in groups:
        rows = geometry[group]
        padded = len(group) * rows[:, HEIGHT].max() * rows[:, WIDTH].max()
        assert len(group) == 1 or padded <= gpu.MAX_PADDING * (rows[:, HEIGHT] * rows[:, WIDTH]).sum()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_encoded_files_are_not_pinned_and_pixels_are(photos):
    """The DataLoader's pinning (``EncodedBatch.pin_memory``) pins the pixel tensors, not the files, which
    nvJPEG reads on the host and copies itself."""
    batch, _ = _batch(PhotoFiles(photos, GpuTrainTransform(FastTrainTransform(SIZE))), range(2))
    pinned = torch.utils.data._utils.pin_memory.pin_memory(batch)
    assert isinstance(pinned, EncodedBatch) and not pinned.encoded.is_pinned()
    assert pinned.params.is_pinned() and len(pinned.pixels) == 0  # every sample here is the device's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decoding_under_a_delayed_stage_stream_gives_every_pixel_of_an_idle_decode(photos, monkeypatch):
    """The stream race: 3 batches of 8 in 2 decode chunks each, made beside the step while the stage's
    stream is held back before every decode (``torch.cuda._sleep``) and the consumer's before every read:
    every finished pixel equals the same batch finished alone on an idle device (nvJPEG writes on its own
    stream; a block it writes must not be one the stage stream still reads)."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    dataset = PhotoFiles(photos * 3, GpuTrainTransform(FastTrainTransform(SIZE)))
    monkeypatch.setattr(gpu, "DECODE_PIXELS", 4 * 320 * 240)  # 2 chunks of 4 images a batch
    loader = build_train_loader(dataset, 8, 0, 0, 1, 3, cuda, backend="gpu")
    loader.sampler.set_epoch(0)
    stage, expected = DeviceStage(cuda), []
    for batch in loader:
        images, targets = stage.finish(batch)
        torch.cuda.synchronize()
        expected.append(images.cpu())
    real, decodes = gpu.decode_images, []

    def held_back(files, device):
        torch.cuda._sleep(50_000_000)  # on the stage's stream: its resize of the last chunk waits
        decodes.append(len(files))
        return real(files, device)

    monkeypatch.setattr(gpu, "decode_images", held_back)
    loader.sampler.set_epoch(0)
    got = []
    for images, _ in DevicePrefetcher(loader, stage):
        torch.cuda._sleep(20_000_000)
        got.append((images * 1.0).cpu())
    assert len(got) == len(expected) == 3 and decodes == [4, 4] * 3
    for images, want in zip(got, expected, strict=True):
        assert torch.equal(images, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_call_returns_once_the_calling_stream_has_run_what_it_queued_before_the_last(photos):
    """The decode stream's pool holds two calls' images at most: before it decodes, a call waits until the
    calling stream has run what it had queued at the previous call (held back here by a sleep). The calling
    stream is a high-priority one of its own: nothing else (nvJPEG's stream, the legacy default stream's
    implicit syncs) waits for its sleep."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    files = [torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8) for path in photos[:2]]
    with torch.cuda.stream(torch.cuda.Stream(cuda, priority=-1)):
        device_decode.decode_images(files, cuda)  # the decoder made
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s on the calling stream
        slept = torch.cuda.current_stream(cuda).record_event()
        device_decode.decode_images(files, cuda)  # waits for what was queued at the call before: done
        after_one_call = slept.query()
        device_decode.decode_images(files, cuda)  # waits for the sleep, queued at the call before
        assert not after_one_call and slept.query()
