"""The shard tar reader (:mod:`mlcls.data.shards.tario`) and the sample checks of :func:`iter_shard` on shards
from others: links, missing members, damaged headers, pax records and sizes, label rows of the wrong
length, and seeded byte mutations of real shards all end in the data or in a one-line DatasetFormatError
naming the shard and the member, in bounded time and memory."""

from __future__ import annotations

import io
import random
import re
import tarfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mlcls.cli.data import main as data_main
from mlcls.data import DatasetFormatError
from mlcls.data.datasets.labels import npy_array
from mlcls.data.sampling import sample_seed
from mlcls.data.shards.pack import IMAGE_EXT, LABELS_EXT
from mlcls.data.shards.reader import iter_shard
from mlcls.data.shards.tario import TAR_BLOCK, tar_files

pytest.importorskip("webdataset")

CLASSES = 12  # the synthetic dataset's


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def packed_shard(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A training shard of 6 samples, as ``mlcls-data pack`` writes it (ustar headers)."""
    out = tmp_path_factory.mktemp("tiny_pack")
    options = ["dataset.train_size=6", "dataset.val_size=2", f"out={out}", "shard_size=6", "max_side=16"]
    assert data_main(["pack", *options]) == 0
    return out / "train-000000.tar"


@pytest.fixture(scope="module")
def pax_shard(packed_shard: Path) -> Path:
    """The same samples with pax headers (float mtimes and a long name: what webdataset's writer makes)."""
    path = packed_shard.with_name("pax.tar")
    with tarfile.open(packed_shard) as source, tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for member in source.getmembers():
            member.mtime = 1.5
            tar.addfile(member, source.extractfile(member))
    return path


def write_members(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]], tar_format: int) -> None:
    with tarfile.open(path, "w", format=tar_format) as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))


def read_all(path: Path) -> list[tuple[str, dict[str, bytes]]]:
    """What training reads of a shard: every sample, checked, its label row parsed, its key made the
    number that seeds its augmentation."""
    samples = list(iter_shard(str(path), CLASSES))
    for key, fields in samples:
        npy_array(fields[LABELS_EXT])
        sample_seed(0, 0, int(key))
    return samples


def test_the_packed_shards_read_as_tarfile_reads_them(packed_shard: Path, pax_shard: Path) -> None:
    for path in (packed_shard, pax_shard):
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
            expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
        with open(path, "rb") as f:
            assert list(tar_files(f, str(path))) == expected
        assert len(read_all(path)) == 6


@pytest.mark.parametrize("link", [tarfile.SYMTYPE, tarfile.LNKTYPE, None])
def test_a_linked_or_missing_image_names_the_shard_and_member(tmp_path: Path, link: bytes | None) -> None:
    labels = (f"000000007.{LABELS_EXT}", npy(np.array([[0, 1]], np.int32)))
    members: list = [("000000006.jpg", b"jpeg"), (f"000000006.{LABELS_EXT}", labels[1]), labels]
    if link is not None:
        info = tarfile.TarInfo("000000007.jpg")
        info.type, info.linkname = link, "000000006.jpg"
        members.insert(2, info)
    path = tmp_path / "train-000000.tar"
    write_members(path, members, tarfile.USTAR_FORMAT)
    with pytest.raises(DatasetFormatError, match=f"shard {path}: no regular file 000000007.{IMAGE_EXT}"):
        read_all(path)


@pytest.mark.parametrize(
    "pairs",
    [
        np.array([[CLASSES, 1]], np.int32),  # a class past the last
        np.array([[-1, 1]], np.int32),
        np.array([[3, 2]], np.int32),  # not a label value
        np.array([3, 1], np.int32),  # not (class, value) pairs
        np.array([[3.0, 1.0]], np.float32),
    ],
)
def test_label_entries_outside_the_classes_name_the_member(tmp_path: Path, pairs: np.ndarray) -> None:
    path = tmp_path / "train-000000.tar"
    members = [("000000003.jpg", b"jpeg"), (f"000000003.{LABELS_EXT}", npy(pairs))]
    write_members(path, members, tarfile.USTAR_FORMAT)
    with pytest.raises(DatasetFormatError, match=f"member 000000003.{LABELS_EXT}: labels are not"):
        read_all(path)
    truncated = [("000000003.jpg", b"jpeg"), (f"000000003.{LABELS_EXT}", npy(pairs)[:-4])]
    write_members(path, truncated, tarfile.USTAR_FORMAT)
    with pytest.raises(DatasetFormatError, match=f"member 000000003.{LABELS_EXT} holds"):
        read_all(path)


def npy_with_header(header: str, data: bytes = b"") -> bytes:
    """``.npy`` (version 1) bytes of the header dict text ``header``, padded as np.save pads, then
    ``data``."""
    text = header.encode() + b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


@pytest.mark.parametrize(
    ("descr", "shape", "expected"),
    [
        ("<i4", "(" + "-" * 9000 + "1, 2)", "nested too deeply"),  # was a MemoryError of Python's parser
        ("|S0", "(1, 2)", "dtype |S0 has items of 0 bytes"),  # was a ValueError of np.frombuffer
        ("<i4", f"(0, {2**62})", f"shape \\(0, {2**62}\\), beyond what numpy holds"),  # of reshape
        ("<i4", str((1,) * 65), "beyond what numpy holds"),  # 65 dimensions: numpy holds 64
    ],
    ids=["unary-minuses", "S0", "2**62", "65-dimensions"],
)
def test_npy_headers_numpy_cannot_hold_name_the_member(
    tmp_path: Path, descr: str, shape: str, expected: str
) -> None:
    labels = npy_with_header(f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}", bytes(8))
    path = tmp_path / "train-000000.tar"
    members = [("000000003.jpg", b"jpeg"), (f"000000003.{LABELS_EXT}", labels)]
    write_members(path, members, tarfile.USTAR_FORMAT)
    started = time.perf_counter()
    with pytest.raises(DatasetFormatError, match=f"000000003.{LABELS_EXT} has no valid .npy header") as error:
        read_all(path)
    assert time.perf_counter() - started < 1
    assert re.search(expected, str(error.value)) and str(path) in str(error.value)
    assert "\n" not in str(error.value)


LABELS = npy(np.array([[3, 1]], np.int32))


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        # int(key) in the training loader was a ValueError
        ([("xxxxxxxxx.jpg", b"jpeg"), (f"xxxxxxxxx.{LABELS_EXT}", LABELS)], "'xxxxxxxxx.jpg': not named"),
        # one sample of a/K and b/K: the image of one and the labels of the other
        (
            [("a/000000003.jpg", b"jpeg"), (f"b/000000003.{LABELS_EXT}", LABELS)],
            "'a/000000003.jpg': not named",
        ),
        # the second image replaced the first
        (
            [("000000003.jpg", b"one"), (f"000000003.{LABELS_EXT}", LABELS), ("000000003.jpg", b"two")],
            "'000000003.jpg': a second jpg member of sample 000000003",
        ),
        # sample 3 read twice, sample 4 between
        (
            [
                member
                for key in ("000000003", "000000004", "000000003")
                for member in ((f"{key}.jpg", b"jpeg"), (f"{key}.{LABELS_EXT}", LABELS))
            ],
            "'000000003.jpg': sample 000000003 already came earlier",
        ),
    ],
    ids=["not-a-number", "folders", "duplicate-member", "repeated-sample"],
)
def test_members_not_named_as_packed_name_the_member(tmp_path: Path, members: list, expected: str) -> None:
    path = tmp_path / "train-000000.tar"
    write_members(path, members, tarfile.USTAR_FORMAT)
    with pytest.raises(DatasetFormatError, match=f"shard {path}, member {expected}") as error:
        read_all(path)
    assert "\n" not in str(error.value)


def header_with(header: bytes, field: slice, value: bytes) -> bytes:
    """``header`` with ``value`` in ``field`` and its checksum made right again (tarfile's definition)."""
    block = bytearray(header)
    block[field] = value.ljust(field.stop - field.start, b"\0")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


SIZE = slice(124, 136)


@pytest.mark.parametrize(
    ("size_field", "expected"),
    [
        (b"\x80" + (1 << 60).to_bytes(11, "big"), "truncated"),  # 1 EiB declared (base-256): MemoryError
        (b"\xff" * 12, "negative size -1"),  # base-256 -1: read(-1) read the whole stream
        (b"12x4", "is not an octal number"),
    ],
    ids=["huge", "negative", "garbage"],
)
def test_bad_member_sizes_end_in_bounded_memory(
    packed_shard: Path, tmp_path: Path, size_field: bytes, expected: str
) -> None:
    data = packed_shard.read_bytes()
    path = tmp_path / "train-000000.tar"
    path.write_bytes(header_with(data[:TAR_BLOCK], SIZE, size_field) + data[TAR_BLOCK:])
    tracemalloc.start()
    try:
        with pytest.raises(DatasetFormatError, match=expected) as error:
            read_all(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(error.value)
    assert peak < 4 << 20


def pax_member(records: bytes, name: str = "000000001.jpg", data: bytes = b"jpeg") -> bytes:
    """A pax header carrying ``records`` (raw bytes, valid or not) and the regular file after it."""
    pax = tarfile.TarInfo("PaxHeader/" + name)
    pax.type, pax.size = tarfile.XHDTYPE, len(records)
    info = tarfile.TarInfo(name)
    info.size = len(data)
    padded = records + bytes(-len(records) % TAR_BLOCK)
    body = data + bytes(-len(data) % TAR_BLOCK)
    return pax.tobuf(tarfile.USTAR_FORMAT) + padded + info.tobuf(tarfile.USTAR_FORMAT) + body + bytes(1024)


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        (b"0 path=x\n", "declares a length of 0"),  # looped forever
        (b"30 mtime=1.5\n", "declares a length of 30"),
        (b"no records\n", "no '<length> '"),
        (b"13 mtime:1.5\n", "has no '='"),
        (b"11 size=-5\n", "pax size '-5' is not a byte count"),
        (b"12 size=1e9\n", "pax size '1e9' is not a byte count"),
    ],
    ids=["zero-length", "overlong", "no-length", "no-equals", "negative-size", "float-size"],
)
def test_bad_pax_records_name_the_member(tmp_path: Path, records: bytes, expected: str) -> None:
    path = tmp_path / "train-000000.tar"
    path.write_bytes(pax_member(records))
    started = time.perf_counter()
    with pytest.raises(DatasetFormatError, match=expected) as error, open(path, "rb") as f:
        list(tar_files(f, str(path)))
    assert time.perf_counter() - started < 1
    member = "000000001.jpg" if b"size=" in records else "PaxHeader/000000001.jpg"  # whose header is bad
    assert f"shard {path}, member {member!r}" in str(error.value)


def test_valid_pax_records_apply_to_the_next_member(tmp_path: Path) -> None:
    path = tmp_path / "train-000000.tar"
    path.write_bytes(pax_member(b"20 path=renamed.jpg\n"))
    with open(path, "rb") as f:
        assert list(tar_files(f, str(path))) == [("renamed.jpg", b"jpeg")]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One seeded damage of ``data``: bytes flipped or overwritten (often in a header), a cut, a splice
    of one part of the file over another, or a sample's members renamed."""
    buffer = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:  # random bit flips anywhere
        for _ in range(rng.randint(1, 8)):
            buffer[rng.randrange(len(buffer))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # a header field overwritten (checksum kept or not)
        header = rng.randrange(len(buffer) // TAR_BLOCK) * TAR_BLOCK
        start = header + rng.choice([0, 100, 124, 136, 148, 156, 257, 345, rng.randrange(TAR_BLOCK)])
        buffer[start : start + rng.randint(1, 12)] = rng.randbytes(rng.randint(1, 12))
        if rng.random() < 0.5:
            block = bytes(buffer[header : header + TAR_BLOCK])
            buffer[header : header + TAR_BLOCK] = header_with(block, slice(0, 0), b"")
    elif kind == 2:  # truncated
        del buffer[rng.randrange(len(buffer)) :]
    elif kind == 3:  # a splice: a run of the file copied over another place
        length = rng.randint(1, 2 * TAR_BLOCK)
        source, target = rng.randrange(len(buffer)), rng.randrange(len(buffer))
        buffer[target : target + length] = buffer[source : source + length]
    elif kind == 4:  # a run of random bytes
        start = rng.randrange(len(buffer))
        buffer[start : start + rng.randint(1, 64)] = rng.randbytes(rng.randint(1, 64))
    else:  # a sample's members renamed, checksums right: to a word, into a folder, to another sample's key
        names = [bytes(buffer[at : at + 100]).split(b"\0", 1)[0] for at in range(0, len(buffer), TAR_BLOCK)]
        keys = sorted({name.split(b".")[0] for name in names if name.split(b".")[0].isdigit()})
        key, other = rng.sample(keys, 2)
        renamed = rng.choice([b"x" * len(key), b"a/" + key[2:], other])
        for at in range(0, len(buffer) - TAR_BLOCK + 1, TAR_BLOCK):
            if buffer[at : at + len(key) + 1] == key + b".":
                block = bytes(buffer[at : at + TAR_BLOCK])
                buffer[at : at + TAR_BLOCK] = header_with(block, slice(0, len(key)), renamed)
    return bytes(buffer)


def test_mutated_shards_read_or_fail_with_a_format_error(packed_shard: Path, pax_shard: Path, tmp_path: Path):
    """300 seeded mutations of two real shards: each read ends within 1 s, allocating less than 4 MiB,
    either with samples or with a DatasetFormatError naming the shard; never another exception."""
    outcomes = {"read": 0, "format error": 0}
    path = tmp_path / "train-000000.tar"
    tracemalloc.start()
    try:
        for seed in range(300):
            rng = random.Random(seed)
            source = (packed_shard, pax_shard)[seed % 2]
            path.write_bytes(mutate(source.read_bytes(), rng))
            tracemalloc.reset_peak()
            started = time.perf_counter()
            try:
                read_all(path)
                outcomes["read"] += 1
            except DatasetFormatError as exc:
                assert str(path) in str(exc) and "\n" not in str(exc), (seed, exc)
                outcomes["format error"] += 1
            assert time.perf_counter() - started < 1, seed
            assert tracemalloc.get_traced_memory()[1] < 4 << 20, seed
    finally:
        tracemalloc.stop()
    assert min(outcomes.values()) > 30, outcomes  # the mutations reach both outcomes
