"""A resize bomb (a 1 x 30000 PNG that Resize(256) would make 256 x 7.68 M) and transform errors: refused as
bad images, within bounded memory, by the datasets (error / skip, training and evaluation), the fast
pipeline, the readability check and the predictor."""

from __future__ import annotations

import contextlib
import re
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from data_fixtures import BLUE, RED, write_csv
from PIL import Image
from torch import nn

from mlcls.data.datasets.base import BadImageError, find_unreadable
from mlcls.data.datasets.csv_dataset import CSVDataset
from mlcls.data.images import read_image_bytes
from mlcls.data.pipeline.dali import CropPlans
from mlcls.data.pipeline.fast import FastTrainTransform
from mlcls.data.pipeline.preprocess import build_eval_transform, preprocess_spec
from mlcls.data.pipeline.transforms import build_transform
from mlcls.data.shards.pack import packed_image
from mlcls.inference.predictor import InferenceModel, predict_images

# What the tests let a call allocate beyond what the process holds already; the bomb needs 7.9 GB.
MEMORY_HEADROOM = 768 * 2**20
THIN_MESSAGE = "an image of 1 x 30000 pixels: one side is over 100 times the other (too thin to resize)"


def write_thin_png(path: Path, size: tuple[int, int] = (1, 30000)) -> Path:
    """A black RGB PNG of ``size`` (width, height): 1 x 30000 by default, a file of about 140 bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size).save(path, optimize=True)
    return path


def data_in_use() -> int:
    """Bytes of this process's data segment (heap and private anonymous mappings): ``VmData``."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))


@contextlib.contextmanager
def memory_cap(headroom: int = MEMORY_HEADROOM) -> Iterator[None]:
    """Cap the data segment (``RLIMIT_DATA``, which every large allocation counts against) at what the
    process holds plus ``headroom``: an allocation beyond raises ``MemoryError`` instead of taking the
    machine's memory. The soft limit is restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_in_use() + headroom
    resource.setrlimit(
        resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard)
    )
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")


@pytest.mark.slow  # over 2 s of the fast run's time
def test_the_cap_stops_the_resize_of_the_bomb(tmp_path: Path) -> None:
    """The cap the other tests run under is real: PIL cannot make the 256 x 7.68 M resize under it."""
    with Image.open(write_thin_png(tmp_path / "thin.png")) as img:
        image = img.convert("RGB")
    with memory_cap(), pytest.raises(MemoryError):
        image.resize((256, 7_680_000))
    assert image.resize((256, 2560)).size == (256, 2560)  # the limit restored: 2 MB are fine anywhere


def test_the_paper_eval_transform_refuses_a_thin_image_before_resizing(tmp_path: Path) -> None:
    """Old code: the Resize(256) of a 1 x 30000 image allocated 7.9 GB (MemoryError under the cap)."""
    path = write_thin_png(tmp_path / "thin.png")
    assert path.stat().st_size < 300
    with Image.open(path) as img:
        image = img.convert("RGB")
    transform = build_transform("paper", 224, train=False)
    with memory_cap(), pytest.raises(ValueError, match=re.escape(THIN_MESSAGE)):
        transform(image)
    # 1:100 is read: Resize(256) makes it 256 x 25600, the crop 224 x 224
    with Image.open(write_thin_png(tmp_path / "edge.png", (3, 300))) as img:
        edge = img.convert("RGB")
    with memory_cap():
        assert transform(edge).shape == (3, 224, 224)


def thin_dataset(root: Path, on_bad_image: str, split: str = "val") -> CSVDataset:
    """Three images, the paper's transform of ``split``: 0 red, 1 the thin PNG, 2 blue; classes a, b, c."""
    write_csv(root, "image,a,b,c\n0.jpg,1,0,0\n1.png,0,1,0\n2.jpg,0,0,1\n", images=["0.jpg", "2.jpg"])
    Image.new("RGB", (24, 16), RED).save(root / "0.jpg")
    Image.new("RGB", (24, 16), BLUE).save(root / "2.jpg")
    write_thin_png(root / "1.png")
    return CSVDataset(
        split,
        transform=build_transform("paper", 224, train=split == "train"),
        root=str(root),
        labels_column=None,
        val_file="train.csv" if split == "val" else None,
        val_fraction=0.0,
        on_bad_image=on_bad_image,
    )


@pytest.mark.parametrize("split", ["train", "val"])
def test_skip_mode_skips_a_thin_image_in_training_and_evaluation(tmp_path: Path, split: str) -> None:
    """Old code: evaluation (Resize 256 of 1 x 30000) ran out of memory; training read it."""
    dataset = thin_dataset(tmp_path, "skip", split)
    with memory_cap():
        image, target = dataset[1]
    assert image.shape == (3, 224, 224)
    assert target.tolist() == [0, 0, 1]  # sample 2 served instead
    assert dataset.pop_bad_images() == [str(tmp_path / "1.png")]
    assert [dataset[i][1].argmax().item() for i in (0, 2)] == [0, 2]
    assert dataset.pop_bad_images() == []


def test_error_mode_names_a_thin_image_in_one_line(tmp_path: Path) -> None:
    dataset = thin_dataset(tmp_path, "error")
    with memory_cap(), pytest.raises(BadImageError) as info:
        dataset[1]
    assert str(info.value).startswith(f"cannot read image {tmp_path / '1.png'}: {THIN_MESSAGE}")
    assert "\n" not in str(info.value)
    with memory_cap():
        checked, bad = find_unreadable(dataset, workers=1)  # mlcls-data stats --check lists it
    assert checked == 3 and [path for path, _ in bad] == [str(tmp_path / "1.png")]
    assert THIN_MESSAGE in bad[0][1]


def test_the_fast_pipeline_refuses_the_images_the_datasets_refuse(tmp_path: Path) -> None:
    """Old code: the fast pipeline read the 1 x 30000 image (the plain pipeline did not)."""
    fast = FastTrainTransform(32)
    with pytest.raises(ValueError, match=re.escape(THIN_MESSAGE)):
        fast.decode_bytes(read_image_bytes(write_thin_png(tmp_path / "thin.png")))
    # a 1:100 box of a square image is read; 1:101 is not
    square = tmp_path / "square.png"
    Image.new("RGB", (400, 400), RED).save(square)
    assert fast(fast.decode_bytes(read_image_bytes(square), (0, 0, 300, 3))).pixels.shape == (3, 32, 32)
    with pytest.raises(ValueError, match="an image of 303 x 3 pixels"):
        fast.decode_bytes(read_image_bytes(square), (0, 0, 303, 3))


def test_dali_plans_and_packing_refuse_the_images_the_datasets_refuse(tmp_path: Path) -> None:
    """Old code: DALI's crop plans drew a window of the 1 x 30000 image and packing packed it (1 x 16)."""
    dataset = thin_dataset(tmp_path, "error")  # sample 1: the thin PNG
    with pytest.raises(ValueError, match=re.escape(THIN_MESSAGE)):
        CropPlans(dataset, FastTrainTransform(32)).plan(1)
    with pytest.raises(ValueError, match=re.escape(THIN_MESSAGE)):
        packed_image(dataset, 1, max_side=16, quality=90)
    assert CropPlans(dataset, FastTrainTransform(32)).plan(0).window[2:].min() >= 1
    assert packed_image(dataset, 0, max_side=16, quality=90)[:2] == b"\xff\xd8"  # a JPEG


class RedRefused:
    """A transform that fails with ``OSError`` on a red image and makes the others a (3,) mean colour."""

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if image.getpixel((0, 0))[0] > 200:
            raise OSError("cannot transform a red image")
        return torch.tensor(image.resize((1, 1)).getpixel((0, 0)), dtype=torch.float32)


def test_transform_errors_are_handled_as_unreadable_images(tmp_path: Path) -> None:
    """Old code: the transform ran outside the skip handling; its OSError escaped as it was."""
    dataset = thin_dataset(tmp_path / "skip", "skip")
    dataset.transform = RedRefused()
    image, target = dataset[0]
    assert target.tolist() == [0, 0, 1] and image.tolist()[2] > 200  # the blue sample 2, after 1 (thin)
    assert dataset.pop_bad_images() == [str(tmp_path / "skip" / n) for n in ("0.jpg", "1.png")]
    dataset = thin_dataset(tmp_path / "error", "error")
    dataset.transform = RedRefused()
    with pytest.raises(BadImageError, match=r"cannot read image .*0\.jpg: cannot transform a red image"):
        dataset[0]


def test_predict_reports_a_thin_image_as_unreadable_and_keeps_the_others(tmp_path: Path) -> None:
    """Old code: a MemoryError out of predict_images, every prediction lost."""
    paths = [tmp_path / "red.jpg", write_thin_png(tmp_path / "thin.png"), tmp_path / "blue.jpg"]
    Image.new("RGB", (40, 30), RED).save(paths[0])
    Image.new("RGB", (30, 40), BLUE).save(paths[2])
    spec = preprocess_spec({"image_size": 224})  # the paper's: Resize 256, CenterCrop 224
    torch.manual_seed(0)
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)).eval()
    inference = InferenceModel(model, ["x", "y"], spec, None, {}, tmp_path / "model.pt", torch.device("cpu"))
    with memory_cap():
        predictions, unreadable = predict_images(inference, paths, batch_size=3, top_k=2)
    assert unreadable == [(paths[1], f"ValueError: {THIN_MESSAGE}")]
    transform = build_eval_transform(spec)
    with torch.no_grad():
        for prediction, path in zip(predictions, (paths[0], paths[2]), strict=True):
            with Image.open(path) as img:
                probabilities = torch.sigmoid(model(transform(img.convert("RGB"))[None]).double())[0]
            assert prediction.image == str(path)
            expected = dict(zip(["x", "y"], probabilities.tolist(), strict=True))
            assert dict(prediction.labels) == pytest.approx(expected)
    assert len(predictions) == 2
