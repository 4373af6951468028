"""Reading the files inside packed shards, fast: tar archives member by member (:func:`tar_files`) and the
``.npy`` label rows (:func:`npy_array`). Python's ``tarfile`` and ``np.load`` read the same, at several
times the cost per member, which counts at thousands of samples per second and process
(docs/performance.md, "Packed shards")."""

from __future__ import annotations

import functools
import io
import math
import struct
import tarfile
from collections.abc import Iterator
from typing import IO

import numpy as np

from mlcls.data.base import DatasetFormatError

TAR_BLOCK = 512
TAR_END = bytes(TAR_BLOCK)
TAR_REGULAR = (b"0", b"\0", b"7")  # tarfile's regular files (REGTYPE, AREGTYPE, CONTTYPE)
TAR_META = (b"x", b"g", b"L", b"K")  # pax headers and GNU long names (their data: records or a name)
TAR_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, FIFOs: no data blocks
TAR_SPARSE = b"S"
NPY_MAGIC = b"\x93NUMPY"


def tar_files(stream: IO[bytes], url: str) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` of each regular file of the tar archive ``stream``, in order, then the rest of the
    stream read to its end.

    What ``tarfile.open(fileobj=stream, mode="r|")`` reads (ustar, GNU and pax archives; checksums
    checked; pax ``path``/``size`` records and GNU long names applied; links, folders and devices
    skipped), at a fraction of its cost per member: one read of the 512-byte header, one of the data.
    A stream that ends before the end-of-archive block raises :class:`DatasetFormatError`.
    """
    offset, long_name, pax, global_pax = 0, None, {}, {}
    while True:
        header = _read_exactly(stream, TAR_BLOCK, url, offset)
        if header == TAR_END:
            break
        _check_tar_header(header, url, offset)
        kind, size, name = header[156:157], _tar_number(header[124:136]), _tar_name(header)
        if kind not in TAR_META:  # pax records and a GNU long name describe the member after them
            records = {**global_pax, **pax}
            size = int(records.get("size", size))
            name = records.get("path", long_name or name)
        if kind == TAR_SPARSE:
            raise DatasetFormatError(f"shard {url} holds a sparse file ({name}); pack it again")
        stored = 0 if kind in TAR_NO_DATA else size
        data = _read_exactly(stream, stored, url, offset + TAR_BLOCK)
        _read_exactly(stream, -stored % TAR_BLOCK, url, offset + TAR_BLOCK + stored)
        offset += TAR_BLOCK + stored + -stored % TAR_BLOCK
        if kind == b"x":
            pax = _pax_records(data)
        elif kind == b"g":
            global_pax.update(_pax_records(data))
        elif kind == b"L":
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind != b"K":  # a GNU long link name: nothing to keep
            long_name, pax = None, {}
            if kind in TAR_REGULAR:
                yield name, data
    while stream.read(1 << 16):  # the end blocks' padding, to the end of the stream
        pass


def _read_exactly(stream: IO[bytes], size: int, url: str, offset: int) -> bytes:
    data = stream.read(size) if size else b""
    if len(data) != size:
        raise DatasetFormatError(f"shard {url} is truncated (at byte {offset + len(data)})")
    return data


def _check_tar_header(header: bytes, url: str, offset: int) -> None:
    """tarfile's check: the stored checksum is the sum of the header's bytes, those of the checksum field
    counted as spaces (unsigned, or signed as some old tars computed it)."""
    stored = _tar_number(header[148:156])
    if stored != 256 + sum(header[:148]) + sum(header[156:]) and stored != 256 + sum(
        struct.unpack_from("148b8x356b", header)
    ):
        raise DatasetFormatError(f"shard {url} is not a tar file or is damaged (bad header at byte {offset})")


def _tar_number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256
        return tarfile.nti(field)
    digits = field.split(b"\0", 1)[0].strip()
    return int(digits, 8) if digits else 0


def _tar_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:265] == b"ustar\x0000":  # POSIX: a name prefix
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax_records(data: bytes) -> dict[str, str]:
    """The ``key=value`` records of a pax header (``"%d %s=%s\\n"``, the length counting the whole record)."""
    records, position = {}, 0
    while position < len(data) and data[position] != 0:
        space = data.index(b" ", position)
        length = int(data[position:space])
        key, _, value = data[space + 1 : position + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position += length
    return records


def npy_array(data: bytes) -> np.ndarray:
    """The array of ``.npy`` file bytes, as ``np.load(io.BytesIO(data))`` reads it (read-only view of
    ``data``), its header parsed once per distinct header (every sample of a shard has the same)."""
    version = data[6:7] if data.startswith(NPY_MAGIC) else b""
    if version not in (b"\x01", b"\x02"):
        return np.load(io.BytesIO(data))  # its error, or a format version this does not parse
    end = (
        10 + int.from_bytes(data[8:10], "little")
        if version == b"\x01"
        else 12 + int.from_bytes(data[8:12], "little")
    )
    layout = _npy_layout(data[:end])
    if layout is None:
        return np.load(io.BytesIO(data))
    dtype, shape, order = layout
    count = math.prod(shape)
    if len(data) - end < count * dtype.itemsize:
        return np.load(io.BytesIO(data))  # its error for a short file
    return np.frombuffer(data, dtype, count=count, offset=end).reshape(shape, order=order)


@functools.lru_cache(maxsize=16)
def _npy_layout(header: bytes) -> tuple[np.dtype, tuple[int, ...], str] | None:
    """``(dtype, shape, order)`` of a ``.npy`` header, None for what :func:`npy_array` leaves to np.load."""
    stream = io.BytesIO(header)
    read = np.lib.format.read_array_header_1_0 if header[6] == 1 else np.lib.format.read_array_header_2_0
    try:
        np.lib.format.read_magic(stream)
        shape, fortran_order, dtype = read(stream)
    except ValueError:
        return None
    if dtype.hasobject:
        return None
    return dtype, shape, "F" if fortran_order else "C"
