"""Checkpoints come through one guarded door (``mlcls.io.open_checkpoint``): opened once without blocking,
regular on that same descriptor, zip members stored (not deflated) and declaring no more bytes than the file
holds, and ``torch.load`` given the open file. Every hostile read runs under a memory cap and a time limit
(tests/hostile.py).

Old behaviour, measured on the code before the door: a 0.26 MB checkpoint whose members were deflated
loaded a 256 MB tensor (maxrss 994 MB, rc 0; the issue's probe: +2.8 GB from 3 MB through predict, eval,
export, resume and import); a symbolic link flipped to a FIFO between ``is_file()`` and ``torch.load``
blocked for ever in 1 of 12 tries.
"""

from __future__ import annotations

import io
import os
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from hostile import bounded

from mlcls.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mlcls.io import UnsafeFileError
from mlcls.torchfile import open_checkpoint

STATE = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "classes": ["a", "b", "c"]}


def rezip(data: bytes, compression: int, edit=None) -> bytes:
    """The zip archive ``data`` written again with ``compression``; ``edit(name, bytes)`` may change a
    member's bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", compression) as dst:
        for info in src.infolist():
            member = src.read(info.filename)
            dst.writestr(info.filename, edit(info.filename, member) if edit else member)
    return out.getvalue()


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
