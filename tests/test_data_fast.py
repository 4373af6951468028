"""The fast pipeline against independent references: torchvision's transforms and PIL's full-size decoding."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from data_fixtures import PhotoFiles, decode_rgb, write_photos, write_ramp
from PIL import Image
from scipy.stats import ks_2samp
from torch.utils.data import default_collate
from torchvision import transforms as T

from mlcls.bench.pipeline_bench import make_jpegs
from mlcls.data import build_backend_transform
from mlcls.data.images import read_image_bytes, to_rgb
from mlcls.data.loader import DeviceStage, build_train_loader, collate_batch
from mlcls.data.pipeline import fast
from mlcls.data.pipeline.fast import (
    HALF_PRECISION_LEVELS,
    AugmentedImage,
    FastTrainTransform,
    PlannedCrop,
    colour_lighting_normalise,
    decode_jpeg,
    draft_reduction,
    load_reduced,
    side_stream,
)
from mlcls.data.pipeline.transforms import (
    IMAGENET_MEAN,
    IMAGENET_PCA_EIGVAL,
    IMAGENET_PCA_EIGVEC,
    IMAGENET_STD,
)
from mlcls.data.pipeline.transforms import build_transform as plain_transform

SIZE = 64
# ``dataset.mean`` / ``dataset.std`` pairs: ImageNet's (the default), none ([0, 1] pixels, the ML-Decoder
# presets') and one with a different value per channel.
NORMALISATIONS = {
    "imagenet": (IMAGENET_MEAN, IMAGENET_STD),
    "none": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
    "custom": ((0.5, 0.25, 0.0), (0.5, 0.25, 1.0)),
}


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_photos(tmp_path_factory.mktemp("jpegs"), 4)


@pytest.fixture(scope="module")
def ramp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ramp(tmp_path_factory.mktemp("ramp"))


def fast_output(
    transform: FastTrainTransform, path: Path, seed: int, stage: DeviceStage | None = None
) -> tuple[torch.Tensor, PlannedCrop]:
    """Fast pipeline under ``seed``: CPU stage (reduced-scale decoding), then the device stage on the CPU
    (``stage``, default ImageNet's normalisation)."""
    torch.manual_seed(seed)
    planned = transform.decode_bytes(read_image_bytes(path))
    sample = transform(planned)
    stage = DeviceStage("cpu") if stage is None else stage
    return stage(collate_batch([sample]))[0], planned


@pytest.mark.parametrize("normalisation", ["imagenet", "custom"])
def test_same_seed_gives_the_plain_pipelines_image_and_statistics(jpegs, normalisation):
    """Under one seed both pipelines draw the same crop, flip, jitter order and factors and lighting: the
    outputs differ only by PIL's uint8 rounding in ColorJitter and, for large crops, the DCT-scaled decode.
    Hence per-channel means and standard deviations over all outputs agree closely. With the dataset's
    ``mean`` and ``std`` given to both (``build_backend_transform`` and the trainer's ``DeviceStage``), the
    device stage normalises as the plain transform does; the differences are compared in units of ImageNet's
    normalised pixels, so that the tolerances below hold for any ``std``."""
    mean, std = NORMALISATIONS[normalisation]
    plain = build_backend_transform("torchvision", "paper", SIZE, train=True, mean=mean, std=std)
    fast = build_backend_transform("fast", "paper", SIZE, train=True, mean=mean, std=std)
    stage = DeviceStage("cpu", mean=mean, std=std)
    expected, got, reduced = [], [], 0
    for path, seed in itertools.product(jpegs, range(16)):
        torch.manual_seed(seed)
        with Image.open(path) as img:
            expected.append(plain(img.convert("RGB")))
        output, planned = fast_output(fast, path, seed, stage)
        got.append(output)
        reduced += isinstance(planned.image, Image.Image)
    assert reduced >= 4, "no sample exercised the reduced-scale decoding"
    # (x - mean) / std -> (x - ImageNet mean) / ImageNet std: an exact affine map, the same for both.
    scale = (torch.tensor(std) / torch.tensor(IMAGENET_STD)).view(1, 3, 1, 1)
    shift = ((torch.tensor(mean) - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)).view(1, 3, 1, 1)
    expected_stack, got_stack = (torch.stack(images) * scale + shift for images in (expected, got))
    assert got_stack.shape == expected_stack.shape == (64, 3, SIZE, SIZE)
    # One uint8 level is 1 / (255 * 0.225) = 0.017 after normalisation; a different crop or flip gives > 0.3.
    per_image = (got_stack - expected_stack).abs().mean((1, 2, 3))
    assert per_image.max() < 0.06 and per_image.mean() < 0.04, per_image
    # PIL's ColorJitter truncates to uint8 after each of its 3 steps (-0.45 level each, -0.024 here).
    torch.testing.assert_close(got_stack.mean((0, 2, 3)), expected_stack.mean((0, 2, 3)), atol=0.035, rtol=0)
    torch.testing.assert_close(got_stack.std((0, 2, 3)), expected_stack.std((0, 2, 3)), atol=0, rtol=0.02)
    brightness_spread = got_stack.mean((1, 2, 3)).std().item()
    assert brightness_spread == pytest.approx(expected_stack.mean((1, 2, 3)).std().item(), rel=0.03)


def _geometry(pixels: np.ndarray, width: int, height: int) -> tuple[float, float, bool]:
    """(area fraction, log aspect ratio, flipped) of a crop of the ramp image, read from its pixels."""
    red, green = pixels[..., 0].astype(float), pixels[..., 1].astype(float)
    x_first, x_last = red[:, 0].mean() * (width - 1) / 255, red[:, -1].mean() * (width - 1) / 255
    y_first, y_last = green[0].mean() * (height - 1) / 255, green[-1].mean() * (height - 1) / 255
    span_x, span_y = abs(x_last - x_first) + 1e-6, abs(y_last - y_first) + 1e-6
    return span_x * span_y / (width * height), math.log(span_x / span_y), x_last < x_first


@pytest.mark.slow  # over 2 s of the fast run's time
def test_crop_scale_aspect_and_flip_distribution_match_torchvision(ramp):
    """Crop area, aspect ratio and flip rate read off the output pixels of a coordinate-ramp image, against
    torchvision's RandomResizedCrop + RandomHorizontalFlip (independent seeds); the reductions 2, 4 and 8
    all occur, so a wrong coordinate map for a reduced-scale decode would shift the distribution."""
    size, count = 32, 300
    fast = FastTrainTransform(size)
    reference = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()])
    with Image.open(ramp) as img:
        full = img.convert("RGB")
    ours, theirs, reductions = [], [], set()
    for k in range(count):
        torch.manual_seed(k)
        planned = fast.decode_bytes(read_image_bytes(ramp))
        width = planned.image.width if isinstance(planned.image, Image.Image) else planned.image.shape[-1]
        reductions.add(round(512 / width))
        ours.append(_geometry(fast(planned).pixels.permute(1, 2, 0).numpy(), 512, 384))
        torch.manual_seed(100_000 + k)
        theirs.append(_geometry(np.asarray(reference(full)), 512, 384))
    assert reductions >= {2, 4, 8}
    ours_a, theirs_a = np.array(ours), np.array(theirs)
    for column in (0, 1):  # area fraction, log aspect ratio
        assert ks_2samp(ours_a[:, column], theirs_a[:, column]).pvalue > 1e-3
    assert ours_a[:, 0].min() / 0.08 > 0.4 and ours_a[:, 0].max() < 1.05
    assert abs(ours_a[:, 2].mean() - 0.5) < 0.1 and abs(theirs_a[:, 2].mean() - 0.5) < 0.1


def test_crop_stays_inside_the_sample_box(ramp):
    fast = FastTrainTransform(16)
    box, data = (100.0, 50.0, 200.0, 150.0), read_image_bytes(ramp)  # box: x, y, w, h
    for seed in range(20):
        torch.manual_seed(seed)
        pixels = fast(fast.decode_bytes(data, box)).pixels.permute(1, 2, 0).numpy().astype(float)
        x = pixels[..., 0] * 511 / 255
        y = pixels[..., 1] * 383 / 255
        assert x.min() >= 100 - 3 and x.max() <= 300 + 3
        assert y.min() >= 50 - 3 and y.max() <= 200 + 3


def _pil_pixels(path: Path) -> np.ndarray:
    return np.asarray(decode_rgb(path))


def test_full_size_decoding_gives_pils_pixels(jpegs, tmp_path):
    """libjpeg-turbo through simplejpeg against PIL's decode: the same pixels for colour and greyscale
    JPEGs; CMYK JPEGs (which it would convert differently) and other formats are left to PIL."""
    grey, cmyk = tmp_path / "grey.jpg", tmp_path / "cmyk.jpg"
    with Image.open(jpegs[1]) as img:
        img.convert("L").save(grey, quality=90)
        img.convert("CMYK").save(cmyk, quality=90)
    for path in (jpegs[0], grey):
        pixels = decode_jpeg(path.read_bytes())
        assert pixels.dtype == torch.uint8 and pixels.shape == (3, 240, 320)
        np.testing.assert_array_equal(pixels.permute(1, 2, 0).numpy(), _pil_pixels(path))
    fast = FastTrainTransform(SIZE, draft=False)
    planned = fast.decode_bytes(read_image_bytes(cmyk))
    np.testing.assert_array_equal(planned.image.permute(1, 2, 0).numpy(), _pil_pixels(cmyk))


def test_files_libjpeg_turbo_does_not_decode_go_through_pil(jpegs, tmp_path):
    """A PNG of the same pixels gives the same output (PIL's decode); a truncated JPEG raises the OSError
    that ``dataset.on_bad_image`` handles."""
    fast = FastTrainTransform(SIZE, draft=False)
    png = tmp_path / "same.png"
    with Image.open(jpegs[0]) as img:
        img.save(png)
    outputs = []
    for path in (jpegs[0], png):
        torch.manual_seed(5)
        outputs.append(fast(fast.decode_bytes(read_image_bytes(path))).pixels)
    assert torch.equal(outputs[0], outputs[1])
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(jpegs[0].read_bytes()[:3000])
    with pytest.raises(OSError):
        fast.decode_bytes(read_image_bytes(truncated))


@pytest.mark.parametrize("reduction", [2, 4, 8])
def test_draft_decoding_equals_full_decoding_downscaled(jpegs, reduction):
    """DCT-scaled decoding at 1/r against PIL's full decode averaged over r x r blocks (BOX resize)."""
    path = jpegs[0]
    with Image.open(path) as img:
        full = img.convert("RGB")
    with Image.open(path) as img:
        reduced, scale_x, scale_y = load_reduced(img, reduction)
    assert reduced.size == (320 // reduction, 240 // reduction) and scale_x == scale_y == reduction
    expected = np.asarray(full.resize(reduced.size, Image.Resampling.BOX)).astype(float)
    got = np.asarray(reduced).astype(float)
    error = np.abs(got - expected).mean()
    shifted_error = np.abs(np.roll(got, 1, axis=1) - expected).mean()  # a one-pixel misalignment
    assert error < 4.5 and error < 0.35 * shifted_error


def test_collate_batch_stacks_channels_last_and_equals_default_collate(jpegs):
    fast = FastTrainTransform(SIZE)
    samples = []
    for seed, path in enumerate(jpegs):
        torch.manual_seed(seed)
        samples.append((fast(fast.decode_bytes(read_image_bytes(path))), torch.tensor([seed, 1.0])))
    images, labels = collate_batch(samples)
    expected_images, expected_labels = default_collate(samples)
    assert images.pixels.shape == (4, 3, SIZE, SIZE)
    assert images.pixels.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(images.pixels, expected_images.pixels) and torch.equal(
        images.params, expected_images.params
    )
    assert torch.equal(labels, expected_labels)


def test_draft_reduction_keeps_at_least_the_output_size():
    assert draft_reduction(447, 900, 224, 224) == 1
    assert draft_reduction(448, 448, 224, 224) == 2
    assert draft_reduction(900, 1000, 224, 224) == 4
    assert draft_reduction(1792, 1800, 224, 224) == 8
    assert draft_reduction(5000, 5000, 224, 224) == 8
    assert draft_reduction(900, 1000, 224, 300) == 2  # each side against its own output side


def _reference_device_stage(
    pixels: torch.Tensor, params: torch.Tensor, mean: tuple = IMAGENET_MEAN, std: tuple = IMAGENET_STD
) -> torch.Tensor:
    """torchvision functional ops, one image at a time, in each image's order, normalised by ``mean`` and
    ``std``."""
    adjust = {0: TF.adjust_brightness, 1: TF.adjust_contrast, 2: TF.adjust_saturation}
    out = []
    for image, p in zip(pixels, params, strict=True):
        x = image.float() / 255
        for code in p[:3].long().tolist():  # the factors are stored as (brightness, contrast, saturation)
            x = adjust[code](x, p[3 + code].item())
        x = x + (IMAGENET_PCA_EIGVEC @ (p[6:9] * IMAGENET_PCA_EIGVAL))[:, None, None]
        out.append(TF.normalize(x, mean, std))
    return torch.stack(out)


def _jitter_batch(batch_size: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (B, 3, 12, 10) pixels (the first image saturated: the clamps after each step matter) and their
    colour parameters, every jitter order twice."""
    generator = torch.Generator().manual_seed(0)
    orders = list(itertools.permutations(range(3)))
    pixels = torch.randint(0, 256, (batch_size, 3, 12, 10), dtype=torch.uint8, generator=generator)
    pixels[0] = 255
    params = torch.cat(
        [
            torch.tensor([orders[k % len(orders)] for k in range(batch_size)], dtype=torch.float32),
            0.6 + 0.8 * torch.rand(batch_size, 3, generator=generator),
            0.3 * torch.randn(batch_size, 3, generator=generator),
        ],
        dim=1,
    )
    return pixels, params


# The colour stage's paths: image by image and batched in float32 (the CPU's), batched in float16 (CUDA's
# default), and the tolerance against torchvision's float32 ops in grey levels (0: float32's rounding).
COLOUR_PATHS = {"per image": (False, None, 0.0), "batched": (True, torch.float32, 0.0)}
COLOUR_PATHS["batched float16"] = (True, torch.float16, HALF_PRECISION_LEVELS)


@pytest.mark.parametrize("normalisation", list(NORMALISATIONS))
@pytest.mark.parametrize("path", list(COLOUR_PATHS))
def test_device_stage_equals_torchvision_functional_ops(path, normalisation):
    """:func:`colour_lighting_normalise` with the constants of a ``DeviceStage`` of the dataset's mean and
    std, against torchvision's functional ops and ``TF.normalize`` of the same mean and std: within float32's
    rounding, and within HALF_PRECISION_LEVELS grey levels with the jitter in float16."""
    mean, std = NORMALISATIONS[normalisation]
    batched, dtype, levels = COLOUR_PATHS[path]
    pixels, params = _jitter_batch()
    constants = DeviceStage("cpu", mean=mean, std=std).constants
    got = colour_lighting_normalise(pixels, params, constants, batched=batched, dtype=dtype)
    assert got.dtype == torch.float32 and got.shape == (12, 3, 12, 10)
    atol = 2e-5 + levels / 255 / min(std)
    torch.testing.assert_close(got, _reference_device_stage(pixels, params, mean, std), atol=atol, rtol=0)


def test_the_colour_stage_keeps_the_memory_format_of_its_pixels():
    pixels, params = _jitter_batch()
    for images, memory_format in ((pixels, torch.contiguous_format), (pixels, torch.channels_last)):
        images = images.contiguous(memory_format=memory_format)
        for p in (params, params[:, :0]):  # training, evaluation
            out = colour_lighting_normalise(images, p, batched=True)
            assert out.is_contiguous(memory_format=memory_format)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_colour_stage_on_cuda_is_float16_within_its_tolerance_of_torchvision():
    pixels, params = _jitter_batch(48)
    cuda = torch.device("cuda", torch.cuda.current_device())
    got = colour_lighting_normalise(pixels.to(cuda), params.to(cuda), DeviceStage(cuda).constants)
    expected = _reference_device_stage(pixels, params)
    atol = HALF_PRECISION_LEVELS / 255 / min(IMAGENET_STD)
    torch.testing.assert_close(got.cpu(), expected, atol=atol, rtol=0)
    with_float32 = colour_lighting_normalise(pixels, params, batched=True)
    assert (got.cpu() - with_float32).abs().max() > 0  # float16 ran: float32 on the CPU gives other values


def test_device_stage_copies_plain_tensors_and_sets_the_memory_format():
    images = torch.randn(2, 3, 8, 8)
    assert torch.equal(DeviceStage("cpu")(images), images)
    batch = AugmentedImage(
        torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.tensor([[0, 1, 2, 1, 1, 1, 0, 0, 0]] * 2)
    )
    contiguous = DeviceStage("cpu")(batch)
    channels_last = DeviceStage("cpu", channels_last=True)(batch)
    assert contiguous.is_contiguous() and channels_last.is_contiguous(memory_format=torch.channels_last)
    expected = (-torch.tensor(IMAGENET_MEAN) / torch.tensor(IMAGENET_STD)).view(1, 3, 1, 1).expand(2, 3, 8, 8)
    torch.testing.assert_close(contiguous, expected)
    # Black pixels, identity jitter, no lighting: (0 - mean) / std per channel, for the stage's mean and std.
    custom = DeviceStage("cpu", mean=[0.5, 0.25, 0.0], std=[0.5, 0.125, 1.0])(batch)
    assert torch.equal(custom, torch.tensor([-1.0, -2.0, 0.0]).view(1, 3, 1, 1).expand(2, 3, 8, 8))


def test_build_backend_transform_chooses_per_backend():
    assert isinstance(build_backend_transform("fast", "paper", 224, train=True), FastTrainTransform)
    assert isinstance(build_backend_transform("dali", "paper", 224, train=True), FastTrainTransform)
    for backend, kind, train in (
        ("torchvision", "paper", True),
        ("fast", "paper", False),
        ("fast", "light", True),
    ):
        transform = build_backend_transform(backend, kind, 32, train)
        assert repr(transform) == repr(plain_transform(kind, 32, train))
    with pytest.raises(ValueError, match="data.backend"):
        build_backend_transform("opencv", "paper", 224, train=True)


@pytest.mark.slow
def test_batches_are_a_function_of_the_sample_seeds(jpegs):
    """The same batches with 0 or 2 DataLoader workers, and when read again (resume is exact)."""
    dataset = PhotoFiles(jpegs * 2, FastTrainTransform(SIZE))  # the transform decodes the files itself

    def batches(workers: int) -> list[tuple[AugmentedImage, torch.Tensor]]:
        loader = build_train_loader(dataset, 4, workers, 0, 1, 3, torch.device("cpu"), backend="fast")
        loader.sampler.set_epoch(1)
        return list(loader)

    first, again, parallel = batches(0), batches(0), batches(2)
    assert len(first) == 2 and first[0][0].pixels.shape == (4, 3, SIZE, SIZE)
    assert first[0][0].params.shape == (4, 9)
    for a, b, c in zip(first, again, parallel, strict=True):
        for x, y, z in zip(a[0], b[0], c[0], strict=True):
            assert torch.equal(x, y) and torch.equal(x, z)
        assert torch.equal(a[1], c[1])
    assert not torch.equal(first[0][0].pixels, first[1][0].pixels)


@pytest.mark.slow
def test_trainer_trains_on_jpegs_with_the_fast_pipeline_compiled(tmp_path, monkeypatch):
    """``data.backend=fast`` end to end: uint8 batches finished by the device stage, ``trainer.compile``,
    checkpoints holding the plain module's weights (torch.compile with the quick eager backend here)."""
    from conftest import compose_config

    from mlcls.engine.trainer import Trainer

    names = [path.name for path in make_jpegs(tmp_path, 16, size=(96, 72))]
    rows = [f"{name},{'a b' if k % 3 == 0 else 'ab'[k % 2]}" for k, name in enumerate(names)]
    (tmp_path / "train.csv").write_text("\n".join(["image,labels", *rows]) + "\n")
    compiled = []

    def eager_compile(module: torch.nn.Module) -> torch.nn.Module:
        compiled.append(module)
        return original_compile(module, backend="eager")

    original_compile = torch.compile
    monkeypatch.setattr(torch, "compile", eager_compile)
    cfg = compose_config(
        ["dataset=csv", f"dataset.root={tmp_path}", "dataset.image_size=32", "data.backend=fast",
         "model.name=resnet10t", "model.pretrained=false", "trainer.epochs=1", "trainer.batch_size=4",
         "trainer.workers=0", "trainer.compile=true"]
    )  # fmt: skip
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    assert isinstance(trainer.data.train_set.transform, FastTrainTransform)
    assert isinstance(next(iter(trainer.train_loader))[0], AugmentedImage)
    results = trainer.fit()
    assert compiled == [trainer.model] and trainer.ddp_model is not trainer.model
    assert results["epochs_completed"] == 1 and math.isfinite(results["history"][0]["loss"])
    saved = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=False)["model"]
    assert saved.keys() == trainer.model.state_dict().keys()


def test_config_rejects_an_unknown_backend_and_dali_without_the_paper_transform():
    from conftest import TINY, compose_config

    from mlcls.engine.config_checks import check_config
    from mlcls.errors import ConfigError

    with pytest.raises(ConfigError, match="data.backend='opencv'; expected one of torchvision, fast, dali"):
        check_config(compose_config([*TINY, "data.backend=opencv"]))
    with pytest.raises(ConfigError, match="dataset.transform=paper"):
        check_config(compose_config([*TINY, "data.backend=dali"]))  # the synthetic set uses ``light``


def test_16_bit_greyscale_is_scaled_to_8_bits_by_both_decoders(tmp_path):
    """A 16-bit greyscale PNG (PIL mode I;16) decodes to v >> 8 in every channel, by the plain dataset's
    decode and by the fast pipeline's, where a plain convert("RGB") saturates nearly every pixel at 255;
    a mode-I image with 16-bit values, and one with 8-bit values, are scaled by their range."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2**16, size=(48, 64), dtype=np.uint16)
    path = tmp_path / "depth16.png"
    Image.fromarray(values).save(path)
    expected = np.repeat((values >> 8).astype(np.uint8)[..., None], 3, axis=2)
    with Image.open(path) as img:
        assert img.mode == "I;16"
    plain = PhotoFiles([path, path])  # sample 1: no crop box
    np.testing.assert_array_equal(np.asarray(plain.load_image(1)), expected)
    planned = FastTrainTransform(SIZE, draft=False).decode_bytes(read_image_bytes(path))
    np.testing.assert_array_equal(planned.image.permute(1, 2, 0).numpy(), expected)

    wide = Image.fromarray(values.astype(np.int32))  # mode I, 16-bit values
    narrow = Image.fromarray((values >> 8).astype(np.int32))  # mode I, 8-bit values
    assert wide.mode == narrow.mode == "I"
    np.testing.assert_array_equal(np.asarray(to_rgb(wide)), expected)
    np.testing.assert_array_equal(np.asarray(to_rgb(narrow)), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_side_streams_differ_when_torchs_pool_comes_around_to_the_stage_stream(monkeypatch):
    """torch hands out its pool's streams in turn: a decode stream drawn when the turn comes back to the stage
    stream's is drawn again (one stream for both would let nvJPEG write into blocks the stage still reads)."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(fast, "_SIDE_STREAMS", {})
    first, turn = torch.cuda.Stream(cuda), 1
    while torch.cuda.Stream(cuda).cuda_stream != first.cuda_stream and turn < 1024:
        turn += 1
    stage = side_stream(cuda, "stage")
    for _ in range(turn - 1):  # the next stream drawn would be the stage's
        torch.cuda.Stream(cuda)
    decode = side_stream(cuda, "decode")
    assert turn < 1024 and decode.cuda_stream != stage.cuda_stream
    assert side_stream(cuda, "stage") is stage and side_stream(cuda, "decode") is decode
