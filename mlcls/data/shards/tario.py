"""Reading the files inside packed shards as ``tarfile`` does, at a fraction of its cost per member
(docs/performance.md, "Packed shards"; their ``.npy`` members: :func:`mlcls.data.datasets.labels.npy_array`).
Shards come from others: whatever their bytes, reading ends in bounded time and memory, in the data or in a
:class:`DatasetFormatError` naming the shard and the member (no size is trusted before the bytes exist).
"""

from __future__ import annotations

import re
import struct
import tarfile
from collections.abc import Iterator
from typing import IO

from mlcls.data.datasets.base import DatasetFormatError

TAR_BLOCK = 512
TAR_END = bytes(TAR_BLOCK)
TAR_REGULAR = (b"0", b"\0", b"7")  # tarfile's regular files (REGTYPE, AREGTYPE, CONTTYPE)
TAR_META = (b"x", b"g", b"L", b"K")  # pax headers and GNU long names (their data: records or a name)
TAR_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, FIFOs: no data blocks
TAR_SPARSE = b"S"
READ_CHUNK = 1 << 20  # a member larger than this is read in pieces: memory follows the bytes that exist
PAX_RECORD = re.compile(rb"([0-9]{1,19}) ")  # "<length> <key>=<value>\n", the length counting it all


def tar_files(stream: IO[bytes], url: str) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` of each regular file of the tar archive ``stream``, in order, then the rest of the
    stream read to its end: what ``tarfile.open(fileobj=stream, mode="r|")`` reads (ustar, GNU and pax, their
    long names and sizes applied; checksums checked; links, folders and devices skipped), one read of each
    header and member. A damaged header, pax record or size, or a stream cut before the end-of-archive
    block, raises :class:`DatasetFormatError` naming ``url`` and the member."""
    offset, long_name, pax, global_pax = 0, None, {}, {}
    while True:
        header = _read_exactly(stream, TAR_BLOCK, url, offset)
        if header == TAR_END:
            break
        name = _tar_name(header)
        try:
            _check_tar_header(header)
            kind, size = header[156:157], _tar_number(header[124:136])
            if kind not in TAR_META:  # pax records and a GNU long name describe the member after them
                records = {**global_pax, **pax}
                size = _pax_size(records["size"]) if "size" in records else size
                name = records.get("path", long_name or name)
            if size < 0:
                raise ValueError(f"negative size {size}")
            if kind == TAR_SPARSE:
                raise ValueError("a sparse file; pack it again")
        except ValueError as exc:
            raise DatasetFormatError(
                f"shard {url}, member {name!r} (header at byte {offset}): {exc}"
            ) from None
        stored = 0 if kind in TAR_NO_DATA else size
        data = _read_exactly(stream, stored, url, offset + TAR_BLOCK)
        _read_exactly(stream, -stored % TAR_BLOCK, url, offset + TAR_BLOCK + stored)
        if kind in (b"x", b"g"):
            try:
                records = _pax_records(data)
            except ValueError as exc:
                raise DatasetFormatError(
                    f"shard {url}, member {name!r} (header at byte {offset}): bad pax records ({exc})"
                ) from None
            if kind == b"x":
                pax = records
            else:
                global_pax.update(records)
        elif kind == b"L":
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind != b"K":  # a GNU long link name: nothing to keep
            long_name, pax = None, {}
            if kind in TAR_REGULAR:
                yield name, data
        offset += TAR_BLOCK + stored + -stored % TAR_BLOCK
    while stream.read(1 << 16):  # the end blocks' padding, to the end of the stream
        pass


def _read_exactly(stream: IO[bytes], size: int, url: str, offset: int) -> bytes:
    """``size`` bytes of ``stream``; never allocates more than ``READ_CHUNK`` beyond the bytes read."""
    if size <= READ_CHUNK:
        data = stream.read(size) if size else b""
    else:
        chunks, left = [], size
        while left:
            chunk = stream.read(min(left, READ_CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    if len(data) != size:
        raise DatasetFormatError(f"shard {url} is truncated (at byte {offset + len(data)})")
    return data


def _check_tar_header(header: bytes) -> None:
    """tarfile's check: the stored checksum is the sum of the header's bytes, those of the checksum field
    counted as spaces (unsigned, or signed as some old tars computed it)."""
    stored = _tar_number(header[148:156])
    if stored != 256 + sum(header[:148]) + sum(header[156:]) and stored != 256 + sum(
        struct.unpack_from("148b8x356b", header)
    ):
        raise ValueError("not a tar header (bad checksum): the shard is damaged or not a tar file")


def _tar_number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256
        return tarfile.nti(field)
    digits = field.split(b"\0", 1)[0].strip()
    if not digits:
        return 0
    if not digits.isdigit() or b"8" in digits or b"9" in digits:
        raise ValueError(f"{digits[:16]!r} is not an octal number")
    return int(digits, 8)


def _pax_size(value: str) -> int:
    if not value.isascii() or not value.isdigit():
        raise ValueError(f"pax size {value[:32]!r} is not a byte count")
    return int(value)


def _tar_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:265] == b"ustar\x0000":  # POSIX: a name prefix
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax_records(data: bytes) -> dict[str, str]:
    """The ``key=value`` records of a pax header (``"%d %s=%s\\n"``, the length counting the whole record);
    ValueError for a record that does not say so (every record moves forward: the loop ends)."""
    records, position = {}, 0
    while position < len(data) and data[position] != 0:
        match = PAX_RECORD.match(data, position)
        if match is None:
            raise ValueError(f"no '<length> ' at byte {position}")
        end = position + int(match[1])
        if not match.end() < end <= len(data) or data[end - 1] != ord("\n"):
            raise ValueError(f"the record at byte {position} declares a length of {int(match[1])}")
        key, equals, value = data[match.end() : end - 1].partition(b"=")
        if not equals:
            raise ValueError(f"the record at byte {position} has no '='")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position = end
    return records
