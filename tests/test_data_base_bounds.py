"""Data files read in bounded time and memory: an image that is a pipe or a device, a decompression bomb,
JPEGs claiming more pixels than their bytes encode or padding their header with fill bytes, label files
whose rows and classes would make a label table far larger than the file, a deflated labels
sidecar, CUB files of many lines; duplicate class names; packing again after the labels changed; control
characters in ``mlcls-data stats``. Each hostile read runs under :func:`hostile.bounded`."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hostile import bounded
from PIL import Image

from mlcls.cli.data import main as data_main
from mlcls.data import build_backend_transform
from mlcls.data.datasets.base import DatasetFormatError, check_class_names
from mlcls.data.datasets.coco import COCO
from mlcls.data.datasets.csv_dataset import CSVDataset
from mlcls.data.datasets.cub import CUB, NUM_ATTRIBUTES
from mlcls.data.datasets.labels import SparseLabels
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.images import PIXELS_PER_BYTE, open_image, read_image
from mlcls.data.pipeline.fast import image_header
from mlcls.data.shards.pack import pack_split, write_sidecars
from mlcls.io import NotRegularFileError

MEMORY_MB = 512  # far under what the old code took for each crafted file (see each test)


def one_line(outcome, error: str, *needles: str) -> None:
    """The bounded call refused with ``error``, in one line holding every needle, without an escape."""
    assert not outcome.escaped, outcome
    assert outcome.error == error, outcome
    assert "\n" not in outcome.message and all(n in outcome.message for n in needles), outcome.message


def csv_root(tmp_path: Path, rows: list[str], header: str = "image,labels") -> Path:
    """A CSV dataset folder: ``train.csv`` of ``rows`` under ``header``, image ``img/a.jpg`` (8 x 8)."""
    (tmp_path / "img").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "img/a.jpg")
    (tmp_path / "train.csv").write_text("\n".join([header, *rows]) + "\n")
    return tmp_path


def csv_dataset(root: Path, **kwargs) -> CSVDataset:
    return CSVDataset("train", root=str(root), val_fraction=0, **kwargs)


# ------------------------------------------------------------------------------------------------- images
@pytest.fixture
def pipe_root(tmp_path: Path) -> Path:
    """A CSV whose second image is a FIFO with no writer (old: read blocked for ever) and third /dev/zero."""
    root = csv_root(tmp_path, ["img/a.jpg,cat", "img/pipe.jpg,dog", "img/zero.jpg,cat"])
    os.mkfifo(root / "img/pipe.jpg")
    (root / "img/zero.jpg").symlink_to("/dev/zero")
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("index", "kind"), [(1, "a pipe (FIFO)"), (2, "a character device")])
def test_an_image_that_is_a_pipe_or_a_device_is_refused_at_once(
    pipe_root: Path, index: int, kind: str
) -> None:
    dataset = csv_dataset(pipe_root)
    outcome = bounded(dataset.load_image, index, memory_mb=MEMORY_MB, seconds=5)
    one_line(outcome, "NotRegularFileError", dataset.samples[index].path, kind, "expected a regular file")
    outcome = bounded(dataset.read_sample, index, dataset.load_image, memory_mb=MEMORY_MB, seconds=5)
    one_line(outcome, "BadImageError", f"cannot read image {dataset.samples[index].path}", kind)


def skip_and_pop(dataset: CSVDataset) -> tuple[int, list[str]]:
    _, served = dataset.read_sample(1, dataset.load_image)
    return served, dataset.pop_bad_images()


@pytest.mark.slow
def test_on_bad_image_skip_counts_a_pipe_and_serves_the_next_image(pipe_root: Path) -> None:
    dataset = csv_dataset(pipe_root, on_bad_image="skip")
    outcome = bounded(skip_and_pop, dataset, memory_mb=MEMORY_MB, seconds=5)
    assert not outcome.escaped and outcome.error is None, outcome
    # the pipe and /dev/zero skipped, image 0 (after wrapping around) served
    assert outcome.value == (0, sorted([str(pipe_root / "img/pipe.jpg"), str(pipe_root / "img/zero.jpg")]))


def stats_check(root: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = data_main(["stats", "--check", "--workers=1", "dataset=csv", f"dataset.root={root}",
                            "dataset.val_fraction=0", "--split", "train"])  # fmt: skip
    return status, out.getvalue()


@pytest.mark.slow
def test_mlcls_data_stats_check_lists_a_pipe_and_a_device_at_once(pipe_root: Path) -> None:
    """Old: ``mlcls-data stats --check`` blocked on the FIFO (killed by a 30 s timeout)."""
    outcome = bounded(stats_check, pipe_root, memory_mb=MEMORY_MB, seconds=30)
    assert not outcome.escaped and outcome.error is None, outcome
    status, text = outcome.value
    assert status == 1 and "images checked: 3, unreadable: 2" in text, text
    assert f"{pipe_root}/img/pipe.jpg: NotRegularFileError: " in text and "a pipe (FIFO)" in text


@pytest.mark.slow
def test_an_image_of_more_pixels_than_pil_allows_is_an_error(tmp_path: Path) -> None:
    """10,000 x 10,000 pixels (PIL's MAX_IMAGE_PIXELS is 89,478,485): old, a warning, then 300 MB decoded."""
    root = csv_root(tmp_path, ["img/a.jpg,cat", "img/big.png,dog"])
    Image.new("1", (10_000, 10_000)).save(root / "img/big.png")
    assert (root / "img/big.png").stat().st_size < 1 << 20
    dataset = csv_dataset(root)
    outcome = bounded(dataset.read_sample, 1, dataset.load_image, memory_mb=MEMORY_MB, seconds=10)
    one_line(outcome, "BadImageError", "big.png", "10000 x 10000 = 100000000 pixels", "at most 89478485")
    outcome = bounded(read_image, root / "img/big.png", memory_mb=MEMORY_MB, seconds=10)
    one_line(outcome, "DecompressionBombError", "100000000 pixels")


def test_read_image_reads_a_regular_image() -> None:
    data = io.BytesIO()
    Image.new("RGB", (5, 3), (1, 2, 3)).save(data, "PNG")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mlcls-bounds-{os.getpid()}.png"
    path.write_bytes(data.getvalue())
    try:
        with read_image(path) as img:
            assert img.size == (5, 3) and img.convert("RGB").getpixel((4, 2)) == (1, 2, 3)
    finally:
        path.unlink()


def test_a_missing_image_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_image(tmp_path / "none.png")
    with pytest.raises(NotRegularFileError):
        read_image(tmp_path)


def jpeg_bytes(image: Image.Image, **options) -> bytes:
    data = io.BytesIO()
    image.save(data, "JPEG", **options)
    return data.getvalue()


def claiming(data: bytes, width: int, height: int) -> bytes:
    """The JPEG ``data`` with its frame header (SOF0) claiming ``width`` x ``height``."""
    crafted, frame = bytearray(data), data.index(b"\xff\xc0")
    crafted[frame + 5 : frame + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(crafted)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torchvision", "fast"])
def test_jpegs_claiming_more_pixels_than_their_bytes_encode_are_skipped_from_their_header(
    tmp_path: Path, backend: str
) -> None:
    """Eight 16 x 16 JPEGs of ~630 bytes whose header claims 9000 x 9000 (81 M pixels, within PIL's cap).
    Old: each decoded at full size (243 MB as RGB), a MemoryError under a 128 MB cap on both paths."""
    root = csv_root(tmp_path, [f"img/liar{k}.jpg,cat" for k in range(8)] + ["img/a.jpg,dog"])
    liar = claiming(jpeg_bytes(Image.new("RGB", (16, 16), (90, 120, 30))), 9000, 9000)
    for k in range(8):
        (root / f"img/liar{k}.jpg").write_bytes(liar)
    transform = build_backend_transform(backend, "paper", 32, True)
    dataset = csv_dataset(root, transform=transform, on_bad_image="skip")

    def first_sample() -> tuple[int, list[str]]:
        return dataset.read_sample(0, dataset.transformed_image)[1], dataset.pop_bad_images()

    outcome = bounded(first_sample, memory_mb=128, seconds=5)
    assert not outcome.escaped and outcome.error is None, outcome
    assert outcome.value == (8, [str(root / f"img/liar{k}.jpg") for k in range(8)])
    outcome = bounded(open_image, liar, memory_mb=128, seconds=5)
    one_line(outcome, "DecompressionBombError", f"claims 9000 x 9000 pixels in {len(liar)} bytes")


@pytest.mark.parametrize(
    ("mode", "options", "pixels_per_byte"),
    [
        ("L", {}, 85),  # the standard tables: 3 bits a block at best
        ("L", {"optimize": True}, 255),  # 2 bits a block: 256 pixels a byte less the header's
        ("RGB", {"optimize": True}, 170),  # 4:2:0, 6 blocks of 2 bits per 16 x 16 pixels: 170.7
        ("RGB", {"optimize": True, "subsampling": 0}, 85),  # 4:4:4, 3 blocks per 8 x 8: 85.3
    ],
)
def test_the_flattest_jpegs_libjpeg_writes_pass_and_their_bytes_claiming_more_rows_do_not(
    mode: str, options: dict, pixels_per_byte: int
) -> None:
    """A flat 4096 x 4096 JPEG is as few bytes a pixel as libjpeg writes; the bound derived from the
    format (at least 1 bit per DC and end-of-block code, 8 x 8 blocks) holds it, and the same bytes claiming
    ``PIXELS_PER_BYTE // pixels_per_byte + 1`` times the rows are refused."""
    data = jpeg_bytes(Image.new(mode, (4096, 4096), 128), **options)
    assert int(4096 * 4096 / len(data)) == pixels_per_byte <= PIXELS_PER_BYTE
    assert image_header(data) == (4096, 4096, True)
    with open_image(data) as img:
        assert img.size == (4096, 4096)
    rows = 4096 * (PIXELS_PER_BYTE // pixels_per_byte + 1)
    for read in (image_header, open_image):
        refusal = f"claims 4096 x {rows} pixels in {len(data)} bytes"
        with pytest.raises(Image.DecompressionBombError, match=refusal):
            read(claiming(data, 4096, rows))


def test_a_photograph_passes_the_size_and_header_checks() -> None:
    """scikit-learn's sample photograph (640 x 427), as it is and enlarged to 1600 x 1067 (1.7 M pixels)."""
    sklearn = Path(importlib.util.find_spec("sklearn").origin).parent  # found, not imported (1.5 s)
    data = (sklearn / "datasets" / "images" / "china.jpg").read_bytes()
    with open_image(data) as photo:
        assert photo.size == (640, 427)
        enlarged = jpeg_bytes(photo.resize((1600, 1067), Image.Resampling.BILINEAR), quality=75)
    assert image_header(enlarged) == (1600, 1067, True)
    with open_image(enlarged) as img:
        assert img.size == (1600, 1067)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("padding", "needle"),
    [
        (b"\xff" * (4 << 20), "more than 1024 fill or stray bytes before its first scan"),
        (b"\xff\xfe\x00\x02" * 2000, "more than 1024 markers before its first scan"),
    ],
)
def test_a_jpeg_header_padded_beyond_what_encoders_write_is_refused_at_once(
    padding: bytes, needle: str
) -> None:
    """4 MB of fill bytes after SOI (old: PIL's parser took them one at a time, 2.6 s, and opened the file),
    2,000 empty comments; a few fill bytes, as some encoders write, still open."""
    data = jpeg_bytes(Image.new("RGB", (16, 16), (90, 120, 30)))
    start = time.perf_counter()
    outcome = bounded(open_image, data[:2] + padding + data[2:], memory_mb=MEMORY_MB, seconds=1)
    one_line(outcome, "OSError", needle)
    assert time.perf_counter() - start < 1
    with open_image(data[:2] + b"\xff" * 16 + data[2:]) as img:
        assert img.size == (16, 16)


# ------------------------------------------------------------------------------------------ label tables
@pytest.mark.slow
def test_a_small_csv_of_many_distinct_labels_is_refused_before_its_table(tmp_path: Path) -> None:
    """36,000 rows, each its own class: a 0.7 MB file asking for a 36,000 x 36,000 float32 table (5.2 GB).
    Old: 6.2 GB peak RSS, then MemoryError (under a 12 GB address-space cap)."""
    rows = ["img/a.jpg,x"] + [f"img/a{i}.jpg,{i:x}" for i in range(1, 36_000)]
    root = csv_root(tmp_path, rows)
    assert (root / "train.csv").stat().st_size < 1 << 20
    outcome = bounded(csv_dataset, root, memory_mb=MEMORY_MB, seconds=30)
    one_line(outcome, "DatasetFormatError", "train.csv", "36000 samples x 36000 classes", "label table")


def test_a_csv_within_the_bound_still_reads(tmp_path: Path) -> None:
    root = csv_root(tmp_path, ["img/a.jpg,cat dog", "img/b.jpg,dog"])
    dataset = csv_dataset(root)
    assert dataset.classes == ["cat", "dog"] and dataset.labels.tolist() == [[1.0, 1.0], [0.0, 1.0]]


def write_coco(root: Path, images: int, categories: int) -> Path:
    """A COCO 2014 train layout: ``images`` images, ``categories`` categories, image i annotated with
    category i (when there is one)."""
    (root / "annotations").mkdir(parents=True)
    (root / "train2014").mkdir()
    data = {
        "images": [{"id": i, "file_name": f"{i}.jpg"} for i in range(images)],
        "categories": [{"id": i, "name": f"c{i}"} for i in range(categories)],
        "annotations": [{"id": i, "image_id": i, "category_id": i} for i in range(min(images, categories))],
    }
    (root / "annotations/instances_train2014.json").write_text(json.dumps(data, separators=(",", ":")))
    return root


@pytest.mark.slow
def test_a_small_coco_file_of_many_images_and_categories_is_refused_before_its_table(tmp_path: Path) -> None:
    """28,000 images x 28,000 categories from 2.8 MB of JSON: a 3.1 GB table."""
    root = write_coco(tmp_path, 28_000, 28_000)
    outcome = bounded(COCO, "train", root=str(root), memory_mb=MEMORY_MB, seconds=30)
    one_line(outcome, "DatasetFormatError", "instances_train2014.json", "28000 samples x 28000 classes")


def write_cub(root: Path, image_lines: list[str], label_lines: list[str]) -> Path:
    folder = root / "CUB_200_2011"
    (folder / "attributes").mkdir(parents=True)
    (root / "attributes.txt").write_text("".join(f"{i} a{i}\n" for i in range(1, NUM_ATTRIBUTES + 1)))
    (folder / "images.txt").write_text("\n".join(image_lines) + "\n")
    (folder / "train_test_split.txt").write_text("".join(f"{line.split()[0]} 1\n" for line in image_lines))
    (folder / "attributes/image_attribute_labels.txt").write_text("\n".join(label_lines) + "\n")
    return root


@pytest.mark.slow
def test_cub_refuses_many_images_with_a_small_label_file_before_sizing_its_tables(tmp_path: Path) -> None:
    """200,000 images listed (2.3 MB), a label file of one line: tables of 200,000 x 312 sized first."""
    root = write_cub(tmp_path, [f"{i} a/{i}.jpg" for i in range(1, 200_001)], ["1 1 1"])
    outcome = bounded(CUB, "train", root=str(root), memory_mb=MEMORY_MB, seconds=30)
    one_line(outcome, "DatasetFormatError", "image_attribute_labels.txt is 6 bytes", "200000 images x 312")


@pytest.mark.slow
def test_cub_finds_a_repeated_image_id_in_linear_time(tmp_path: Path) -> None:
    """60,000 ids, the last a repeat of the one before: old, 60,000 list.count calls (quadratic)."""
    ids = [*range(1, 60_000), 59_999]
    root = write_cub(tmp_path, [f"{i} a/{i}.jpg" for i in ids], ["1 1 1"])
    start = time.perf_counter()
    outcome = bounded(CUB, "train", root=str(root), memory_mb=MEMORY_MB, seconds=10)
    one_line(outcome, "DatasetFormatError", "image_id 59999 is listed twice")
    assert time.perf_counter() - start < 5


def deflated_sidecar(rows: int) -> bytes:
    """An ``.npz`` of SparseLabels arrays, members deflated, ``rows`` rows of no entry: offsets of
    ``8 * (rows + 1)`` bytes of zeros that deflate about 1000 times."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        arrays = {
            "offsets": np.zeros(rows + 1, np.int64),
            "columns": np.zeros(0, np.int32),
            "values": np.zeros(0, np.int8),
            "shape_fill": np.array([rows, 3, 0], np.int64),
        }
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array)
    return buffer.getvalue()


@pytest.mark.slow
def test_a_deflated_sidecar_is_bounded_by_its_size_not_by_the_announced_shape() -> None:
    """A manifest announcing 150,000,000 samples allows 1.2 GB of offsets: old, the bytes were inflated."""
    data = deflated_sidecar(5_000_000)  # 40 MB of offsets
    assert len(data) < 1 << 20
    outcome = bounded(SparseLabels.from_bytes, data, (150_000_000, 3), memory_mb=MEMORY_MB, seconds=20)
    one_line(outcome, "ValueError", "offsets.npy declares 40000136 bytes", "more than 32 times")


def test_a_stored_sidecar_still_reads() -> None:
    labels = SparseLabels.from_dense(np.array([[1, 0, -1], [0, 0, 1]]))
    assert SparseLabels.from_bytes(labels.to_bytes(), (2, 3)) == labels


# ---------------------------------------------------------------------------------- duplicate classes
def test_duplicate_class_names_are_refused_in_one_line(tmp_path: Path) -> None:
    root = csv_root(tmp_path, ["img/a.jpg,cat dog"])
    with pytest.raises(
        DatasetFormatError, match=r"^dataset.classes: class name 'cat' is given twice \(classes 0 and 1\)"
    ):
        csv_dataset(root, classes=["cat", "cat", "dog"])
    one_hot = csv_root(tmp_path / "one_hot", ["img/a.jpg,1,0,1"], header="image,cat,cat,dog")
    with pytest.raises(
        DatasetFormatError, match=r"train.csv \(its header\): class name 'cat' is given twice"
    ):
        csv_dataset(one_hot, labels_column=None)
    with pytest.raises(DatasetFormatError, match="class 1 is ''; expected a non-empty class name"):
        check_class_names(["a", ""], "classes.json")
    dataset = SyntheticMultiLabel("train", train_size=2)
    with pytest.raises(
        DatasetFormatError, match=r"SyntheticMultiLabel \(train split\): class name 'x' is given"
    ):
        dataset.classes = ["x", "y", "x"]


# -------------------------------------------------------------------------------------------------- pack
def test_packing_again_after_the_labels_changed_writes_the_shards_again(tmp_path: Path) -> None:
    """Old: "0 written, 3 kept", the shards holding the old labels (verify then found them differ)."""
    dataset = SyntheticMultiLabel("train", train_size=9, canvas_size=32)
    out = tmp_path / "packed"
    first = pack_split(dataset, out, "train", shard_size=3, max_side=32, progress=False)
    again = pack_split(dataset, out, "train", shard_size=3, max_side=32, progress=False)
    assert (first.written, again.written, again.kept) == (3, 0, 3)
    dataset.labels = 1 - dataset.labels  # every label corrected
    report = pack_split(dataset, out, "train", shard_size=3, max_side=32, progress=False)
    assert (report.written, report.kept) == (3, 0)
    write_sidecars(out, dataset, {"train": "train"}, [report], max_side=32, quality=90)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert data_main(["verify", str(out)]) == 0, printed.getvalue()


# ----------------------------------------------------------------------------------------- printing
def test_mlcls_data_stats_escapes_control_characters(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = csv_root(tmp_path, ["img/a.jpg,\x1b[31mred\x07"])
    assert (
        data_main(
            ["stats", "dataset=csv", f"dataset.root={root}", "dataset.val_fraction=0", "--split", "train"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[31mred\\x07" in out
