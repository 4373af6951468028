"""Checkpoints come through one guarded door (``mlcls.torchfile.open_checkpoint``): opened once without
blocking, regular on that same descriptor, zip members stored (not deflated) and declaring no more bytes
than the file holds, and ``torch.load`` given the open file. Every hostile read runs under a memory cap
and a time limit (tests/hostile.py).

Old behaviour, measured on the code before the door: a 0.26 MB checkpoint whose members were deflated
loaded a 256 MB tensor (maxrss 994 MB, rc 0; the issue's probe: +2.8 GB from 3 MB through predict, eval,
export, resume and import); a symbolic link flipped to a FIFO between ``is_file()`` and ``torch.load``
blocked for ever in 1 of 12 tries.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from hostile import (
    bounded,
    empty_dicts_pickle,
    nested_list_pickle,
    nested_tuple_key_pickle,
    rezip,
    two_directories,
    with_pickle,
)

from mlcls.engine.checkpoint import load_checkpoint, save_checkpoint
from mlcls.engine.state import CheckpointError
from mlcls.errors import ConfigError, InferenceError
from mlcls.inference.predictor import load_inference_model
from mlcls.inference.released import read_released
from mlcls.io import FileTooLargeError, NotRegularFileError, UnsafeFileError, open_regular, read_regular_bytes
from mlcls.models.factory import create_model
from mlcls.text.clip import load_weights
from mlcls.torchfile import MAX_NESTING, PICKLE_OBJECTS, check_nesting, check_pickle, open_checkpoint

ENTRY = struct.Struct("<4s6H3L5H2L")  # a zip central-directory entry
STATE = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "classes": ["a", "b", "c"], "format": 2}


def saved(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def load_outcome(path: Path) -> str:
    """The one-line error of loading ``path``, or "loaded"."""
    try:
        load_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_a_genuine_checkpoint_loads_through_the_door(tmp_path):
    path = tmp_path / "best.pt"
    save_checkpoint(STATE, path)
    state = load_checkpoint(path)
    assert torch.equal(state["model"]["w"], STATE["model"]["w"]) and state["classes"] == STATE["classes"]
    # stored by torch.save: the door's member check holds for every file mlcls writes
    with zipfile.ZipFile(path) as archive:
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}


@pytest.mark.slow
def test_deflated_members_are_refused_in_bounded_memory(tmp_path):
    """256 MB of zeros deflated to about 0.26 MB: refused before torch.load, within 64 MB of memory."""
    path = tmp_path / "last.pt"
    path.write_bytes(rezip(saved({"model": {"w": torch.zeros(2**26)}}), zipfile.ZIP_DEFLATED))
    assert path.stat().st_size < 2**20
    outcome = bounded(load_outcome, path, memory_mb=64, seconds=20)
    assert not outcome.escaped, outcome
    assert "is compressed" in outcome.value and "stores members uncompressed" in outcome.value
    assert "\n" not in outcome.value


def test_members_declaring_more_than_the_file_holds_are_refused(tmp_path):
    """Three more central-directory entries pointing at the largest stored member: the declared sizes add
    up to more than the file, which only overlapping members can do."""
    data = saved({"model": {"w": torch.zeros(4096)}})
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
        largest = max(dst.infolist(), key=lambda info: info.file_size)
        for copy in range(3):
            alias = copy_info(largest, f"{largest.filename}.{copy}")
            dst.filelist.append(alias)
    path = tmp_path / "overlap.pt"
    path.write_bytes(out.getvalue())
    with zipfile.ZipFile(path) as archive:
        assert sum(info.file_size for info in archive.infolist()) > path.stat().st_size
    message = load_outcome(path)
    assert "declare" in message and "in a file of" in message, message


def copy_info(info: zipfile.ZipInfo, name: str) -> zipfile.ZipInfo:
    """A central-directory entry named ``name`` for the same stored bytes as ``info``."""
    alias = zipfile.ZipInfo(name, info.date_time)
    for field in ("compress_type", "file_size", "compress_size", "CRC", "header_offset", "external_attr"):
        setattr(alias, field, getattr(info, field))
    return alias


@pytest.mark.parametrize("content", [b"", b"not a zip at all", b"PK\x03\x04" + bytes(40)])
def test_files_that_are_not_torch_archives_are_one_line(tmp_path, content):
    path = tmp_path / "best.pt"
    path.write_bytes(content)
    message = load_outcome(path)
    assert message.startswith(f"checkpoint {path}") and "\n" not in message, message


@pytest.mark.slow
def test_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    fifo = tmp_path / "best.pt"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        outcome = bounded(load_outcome, path, memory_mb=64, seconds=5)
        assert not outcome.escaped, outcome
        assert "expected a regular file" in outcome.value, outcome.value


def test_a_socket_is_refused_as_a_socket(tmp_path):
    """A socket cannot be opened at all (ENXIO): before, the open's own OSError was the line."""
    import socket

    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "best.pt"))
        with pytest.raises(NotRegularFileError) as error:
            open_regular(tmp_path / "best.pt")
    assert str(error.value) == f"{tmp_path / 'best.pt'} is a socket; expected a regular file"


@pytest.mark.slow
def test_a_link_flipped_to_a_fifo_never_blocks(tmp_path):
    """The path is opened once: whatever the link names at that moment is what is checked and read."""
    regular = tmp_path / "real.pt"
    save_checkpoint(STATE, regular)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "best.pt"
    link.symlink_to(regular)

    def flip_and_load() -> set[str]:
        stop = threading.Event()

        def flip() -> None:
            targets = [fifo, regular]
            i = 0
            while not stop.is_set():
                tmp = tmp_path / f"link{i % 2}"
                tmp.unlink(missing_ok=True)
                tmp.symlink_to(targets[i % 2])
                os.replace(tmp, link)
                i += 1

        flipper = threading.Thread(target=flip)
        flipper.start()
        try:
            return {"loaded" if load_outcome(link) == "loaded" else "refused" for _ in range(60)}
        finally:
            stop.set()
            flipper.join()

    outcome = bounded(flip_and_load, memory_mb=256, seconds=30)
    assert not outcome.escaped, outcome
    assert outcome.value <= {"loaded", "refused"} and outcome.value


def test_open_checkpoint_names_what_it_reads(tmp_path):
    path = tmp_path / "weights.pth"
    path.write_bytes(rezip(saved(STATE), zipfile.ZIP_DEFLATED))
    with pytest.raises(UnsafeFileError, match="released file|stores members uncompressed"):
        open_checkpoint(path, what="released file")
    path.write_bytes(b"x")
    with pytest.raises(UnsafeFileError, match="is not a released file written by torch.save"):
        open_checkpoint(path, what="released file")


# ------------------------------------------------------------------------- one zip reader, bounded pickles
def reader_outcome(reader: str, path: Path) -> str:
    """The one-line refusal of ``path`` by one of mlcls's checkpoint readers, or "loaded"."""
    readers = {
        "checkpoint": load_checkpoint,
        "predict": load_inference_model,
        "released": read_released,
        "clip": load_weights,
        "weights": lambda path: create_model(
            "test_resnet", 2, checkpoint_path=str(path)
        ),  # model.checkpoint_path
    }
    try:
        readers[reader](Path(path))
    except (CheckpointError, InferenceError, ConfigError, UnsafeFileError, NotRegularFileError) as exc:
        assert "\n" not in str(exc), exc
        return str(exc)
    return "loaded"


READERS = ["checkpoint", "predict", "released", "clip", "weights"]


@pytest.mark.slow
def test_a_second_directory_that_zipfile_reads_is_refused_by_every_reader(tmp_path):
    """torch's reader follows the end record to the deflated directory (64 MiB of zeros in 65 kB) while
    Python's zipfile reads a stored copy just before the end record: refused by each reader, within 48 MB.
    Before: zipfile's view passed the member checks and torch unpacked the 64 MiB tensor, "can't allocate
    memory" under the cap in every reader (the issue's mlcls-predict: 2.68 GB RSS from a 2 MB file); the
    weights of model.checkpoint_path, read by timm's torch.load, the same "can't allocate" of 64 MiB."""
    path = tmp_path / "best.pt"
    path.write_bytes(
        two_directories(rezip(saved({"model": {"w": torch.zeros(2**24)}}), zipfile.ZIP_DEFLATED))
    )
    with zipfile.ZipFile(path) as archive:  # what Python's zipfile sees: stored members only
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
    for reader in READERS:
        outcome = bounded(reader_outcome, reader, path, memory_mb=48, seconds=20)
        assert not outcome.escaped, (reader, outcome)
        assert "a second directory" in outcome.value, (reader, outcome.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data_pkl", "refusal"),
    [
        (empty_dicts_pickle(3_000_000), f"builds or stores more than {PICKLE_OBJECTS} objects"),
        (nested_list_pickle(10_000), f"nests containers more than {MAX_NESTING} deep"),
        (nested_tuple_key_pickle(10_000), f"nests tuples more than {MAX_NESTING} deep"),
    ],
    ids=["empty-dicts", "nested-list", "nested-tuple-key"],
)
def test_a_pickle_that_builds_more_than_it_holds_is_refused_by_every_reader(tmp_path, data_pkl, refusal):
    """Before: 3 MB of empty dicts built 3 million (a MemoryError under 160 MB; the issue's 30 MB of them
    3.14 GB); a list nested 10,000 deep in the config (the issue's: 300,000) loaded, then a RecursionError
    traceback in its deep copy; a tuple key nested 10,000 deep a RecursionError too (300,000 deep: a
    segmentation fault hashing it). As model.checkpoint_path (timm's torch.load, before): a MemoryError for
    the dicts, the nested list and tuple loaded."""
    path = tmp_path / "best.pt"
    path.write_bytes(with_pickle(saved(STATE), data_pkl))
    for reader in READERS:
        outcome = bounded(reader_outcome, reader, path, memory_mb=160, seconds=20)
        assert not outcome.escaped, (reader, outcome)
        assert refusal in outcome.value, (reader, outcome.value)


def aliased_storages(keys: list[str], member: str, numel: int) -> bytes:
    """A ``torch.save`` archive whose one stored member ``data/<member>`` (``numel`` float32 zeros) its
    ``data.pkl`` refers to under each of ``keys``: torch reads a storage once per key, its reader finds the
    member for each key that equals the name ignoring case or up to a NUL."""

    class Storage:
        def __init__(self, key: str) -> None:
            self.key = key

    class Tensor:
        def __init__(self, key: str) -> None:
            self.key = key

        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (Storage(self.key), 0, (numel,), (1,), False, {})

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, Storage):
                return ("storage", torch.FloatStorage, obj.key, "cpu", numel)
            return None

    data_pkl = io.BytesIO()
    Pickler(data_pkl, protocol=2).dump({"model": {f"w{i}": Tensor(key) for i, key in enumerate(keys)}})
    out = io.BytesIO()
    template = io.BytesIO(saved({"model": {"w": torch.zeros(1)}}))
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            folder, _, name = info.filename.rpartition("/")
            if name == "data.pkl":
                dst.writestr(info.filename, data_pkl.getvalue())
            elif folder.endswith("/data"):
                dst.writestr(f"{folder}/{member}", bytes(4 * numel))
            else:
                dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize(
    "keys",
    [["abcde", "ABCDE", "aBcDe", "AbCdE"] * 4, ["abcde"] + [f"abcde\0{i}" for i in range(15)]],
    ids=["case", "nul"],
)
def test_keys_that_name_one_stored_member_many_times_are_refused_by_every_reader(tmp_path, keys):
    """torch loads a storage once per key of data.pkl, and its reader (miniz) finds a member ignoring case
    and up to a NUL: 16 keys for one 16 MiB member read it 16 times. Before: the door passed both files;
    the NUL keys could not be allocated under 160 MB, and 32 case variants made mlcls-import hold 520 MiB
    more from a 16 MiB file; model.checkpoint_path's (timm's torch.load, before) could not allocate 16 MiB
    under 160 MB. The single key passes the door."""
    path = tmp_path / "best.pt"
    path.write_bytes(aliased_storages(["abcde"], "abcde", 2**22))
    open_checkpoint(path).close()
    path.write_bytes(aliased_storages(keys, "abcde", 2**22))
    for reader in READERS:
        outcome = bounded(reader_outcome, reader, path, memory_mb=160, seconds=20)
        assert not outcome.escaped, (reader, outcome)
        assert "refers to a storage" in outcome.value and "by that exact name" in outcome.value, outcome.value


def test_the_pickle_scan_passes_what_torch_save_writes_and_counts_what_it_builds():
    """A genuine pickle passes; the counts are the opcodes pickletools lists (an independent reading)."""
    check_pickle(pickle.dumps({"model": {"w": [1.0] * 1000, "t": (1, (2, (3,)))}}, protocol=2))
    check_pickle(empty_dicts_pickle(PICKLE_OBJECTS - 3))  # the outer dicts and list: 3 more
    with pytest.raises(ValueError, match="builds or stores"):
        check_pickle(empty_dicts_pickle(PICKLE_OBJECTS - 2))
    check_pickle(nested_tuple_key_pickle(MAX_NESTING - 1))  # the empty tuple is a level too
    with pytest.raises(ValueError, match="nests tuples"):
        check_pickle(nested_tuple_key_pickle(MAX_NESTING))
    with pytest.raises(ValueError, match="not a pickle"):
        check_pickle(b"\x80\x02}(X\x05\x00\x00\x00mod")


def test_nesting_is_measured_along_the_longest_path_without_recursion():
    shared: list = []
    deep = shared
    for _ in range(MAX_NESTING - 3):  # shared: MAX_NESTING - 2 lists deep
        deep.append([])
        deep = deep[0]
    check_nesting({"a": shared, "b": [shared]}, "x")  # b -> list -> shared: MAX_NESTING levels
    with pytest.raises(UnsafeFileError, match="more than"):
        check_nesting({"a": shared, "b": [[shared]]}, "x")
    loop: list = []
    loop.append([loop])
    with pytest.raises(UnsafeFileError, match="contains itself"):
        check_nesting({"a": loop}, "x")


# ------------------------------------------------------------------------- the declared size, one buffer
@pytest.mark.slow
@pytest.mark.parametrize("reader", ["checkpoint", "clip-safetensors"])
def test_a_file_that_declares_0_bytes_and_streams_is_refused_by_every_reader(tmp_path, reader):
    """/proc/self/pagemap is a regular file of st_size 0 that streams about 2^38 bytes. Before: as CLIP
    weights (safetensors, read whole) a MemoryError under 256 MB (the issue: 4.69 GB); as a checkpoint,
    "not a zip archive" (zipfile found no end record in what it read)."""
    path = tmp_path / ("weights.safetensors" if reader == "clip-safetensors" else "best.pt")
    path.symlink_to("/proc/self/pagemap")
    outcome = bounded(reader_outcome, reader.partition("-")[0], path, memory_mb=256, seconds=20)
    assert not outcome.escaped, outcome
    assert "declares 0 bytes and yet streams" in outcome.value, outcome.value


@pytest.mark.slow
def test_a_whole_file_is_read_into_one_buffer_of_its_size(tmp_path):
    """A sparse 256 MiB file read whole within 1.1 times its size. Before: a bytearray and then its bytes()
    copy, twice its size (a MemoryError under the same cap)."""
    path = tmp_path / "labels.csv"
    with path.open("wb") as file:
        file.truncate(2**28)
    outcome = bounded(lambda: len(read_regular_bytes(path, 2**29, "label file")), memory_mb=int(1.1 * 2**8))
    assert outcome.error is None and outcome.value == 2**28, outcome


def test_a_file_is_read_no_further_than_the_size_it_had_when_opened(tmp_path):
    """Bytes appended after the door opened the file are never returned: the byte that shows growth is one
    line. Before: the appended bytes were read as if they had been there."""
    path = tmp_path / "results.json"
    path.write_bytes(b"[1, 2]")
    for mode in ("rb", "r"):
        with open_regular(path, mode, what="results file") as file:
            with path.open("ab") as grow:
                grow.write(b" " * 10)
            with pytest.raises(FileTooLargeError, match="grew past the 6 bytes it had when opened"):
                file.read()
        path.write_bytes(b"[1, 2]")
    with open_regular(path, what="results file") as file:
        assert file.read(4) == b"[1, " and file.read() == b"2]"  # within the size: read as it is


def test_sizes_held_in_zip64_fields_are_read_as_torch_reads_them(tmp_path):
    """A member over 4 GiB keeps its sizes in its entry's zip64 field (0xFFFFFFFF in the entry): the same
    checkpoint with every stored member's sizes moved there loads as torch reads it, and a field too short
    for what the entry defers is refused."""
    archive = rezip(saved(STATE), zipfile.ZIP_STORED)
    end = archive.rfind(b"PK\x05\x06")
    entries, offset = struct.unpack_from("<H4xL", archive, end + 10)
    directory, at = bytearray(), offset
    for _ in range(entries):
        fields = list(ENTRY.unpack_from(archive, at))
        name_end = at + ENTRY.size + fields[10]
        sizes = struct.pack("<HHQQ", 1, 16, fields[9], fields[8])  # uncompressed, then compressed
        fields[8] = fields[9] = 0xFFFFFFFF
        fields[11] += len(sizes)
        directory += ENTRY.pack(*fields) + archive[at + ENTRY.size : name_end] + sizes
        at = name_end + fields[11] - len(sizes) + fields[12]
    end_record = bytearray(archive[end:])
    struct.pack_into("<L", end_record, 12, len(directory))
    path = tmp_path / "zip64.pt"
    path.write_bytes(archive[:offset] + directory + end_record)
    assert torch.equal(load_checkpoint(path)["model"]["w"], STATE["model"]["w"])
    short = directory.replace(struct.pack("<HH", 1, 16), struct.pack("<HH", 1, 8))
    path.write_bytes(archive[:offset] + short + end_record)
    assert "a zip64 field is shorter than its entry needs" in load_outcome(path)


@pytest.mark.slow
def test_a_member_named_twice_ignoring_case_is_refused(tmp_path):
    """torch's reader looks names up ignoring case: a second ``data.pkl`` in capitals may be the one it
    unpickles, not the one the scan read. Before: the 3 MB of empty dicts it holds were what torch loaded,
    a MemoryError under 160 MB, in one of the two orders."""
    genuine = saved(STATE)
    for first, second in ((None, empty_dicts_pickle(3_000_000)), (empty_dicts_pickle(3_000_000), None)):
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(genuine)) as src, zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                data = src.read(info)
                is_pickle = info.filename.endswith("/data.pkl")
                dst.writestr(info.filename, first if is_pickle and first else data)
                if is_pickle:
                    dst.writestr(info.filename.removesuffix("data.pkl") + "DATA.PKL", second or data)
        path = tmp_path / "best.pt"
        path.write_bytes(out.getvalue())
        outcome = bounded(load_outcome, path, memory_mb=160, seconds=20)
        assert not outcome.escaped, outcome
        assert "twice (ignoring case" in outcome.value, outcome.value
