"""Reading the files inside packed shards as ``tarfile`` and ``np.load`` do, at a fraction of their cost per
member (docs/performance.md, "Packed shards"). Shards come from others: whatever their bytes, reading ends
in bounded time and memory, in the data or in a :class:`DatasetFormatError` naming the shard and the member
(no size is trusted before the bytes exist).
"""

from __future__ import annotations

import functools
import io
import math
import re
import struct
import tarfile
import tokenize
import zipfile
from collections.abc import Iterator
from typing import IO

import numpy as np

from mlcls.data.datasets.base import DatasetFormatError

TAR_BLOCK = 512
TAR_END = bytes(TAR_BLOCK)
TAR_REGULAR = (b"0", b"\0", b"7")  # tarfile's regular files (REGTYPE, AREGTYPE, CONTTYPE)
TAR_META = (b"x", b"g", b"L", b"K")  # pax headers and GNU long names (their data: records or a name)
TAR_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders, FIFOs: no data blocks
TAR_SPARSE = b"S"
READ_CHUNK = 1 << 20  # a member larger than this is read in pieces: memory follows the bytes that exist
PAX_RECORD = re.compile(rb"([0-9]{1,19}) ")  # "<length> <key>=<value>\n", the length counting it all
NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_DIMS = 64  # numpy's NPY_MAXDIMS
NPY_MAX_HEADER = 12 + 10_000  # prefix and numpy's default max_header_size: a longer header is refused
NPY_HEADER_READERS = {
    b"\x01": np.lib.format.read_array_header_1_0,
    b"\x02": np.lib.format.read_array_header_2_0,
}


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


def check_npz_member(info: zipfile.ZipInfo, file_size: int) -> None:
    """ValueError unless the member ``info`` of an ``.npz`` file of ``file_size`` bytes is as ``np.savez``
    (or ``np.savez_compressed``) writes it: stored or deflated, not encrypted, within the file, a stored one
    declaring the bytes it occupies."""
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 1:
        raise ValueError(f"{info.filename} is encrypted or compressed with method {info.compress_type}")
    stored = info.compress_type == zipfile.ZIP_STORED
    if info.compress_size > file_size or (stored and info.file_size != info.compress_size):
        raise ValueError(
            f"{info.filename} declares {info.compress_size} bytes stored, {info.file_size} unpacked, in a "
            f"file of {file_size} bytes"
        )


def npy_header(data: bytes, member: str = "the .npy file") -> tuple[np.dtype, tuple[int, ...], str, int]:
    """``(dtype, shape, order, offset of the data)`` of the ``.npy`` file whose bytes begin with ``data``
    (its first :data:`NPY_MAX_HEADER` bytes suffice): format versions 1 and 2, no objects, each distinct
    header parsed once (every sample of a shard has the same). Anything else raises
    :class:`DatasetFormatError` naming ``member``."""
    version = data[6:7] if data.startswith(NPY_MAGIC) else b""
    if version not in NPY_HEADER_READERS:
        raise DatasetFormatError(f"{member} is not a .npy array (format version 1 or 2)")
    end = (
        10 + int.from_bytes(data[8:10], "little")
        if version == b"\x01"
        else 12 + int.from_bytes(data[8:12], "little")
    )
    try:
        return (*_npy_layout(data[:end]), end)
    except (ValueError, TypeError, SyntaxError, tokenize.TokenError) as exc:  # numpy's header parser's
        raise DatasetFormatError(f"{member} has no valid .npy header ({exc})") from None
    except (MemoryError, RecursionError):  # Python's parser on thousands of nested unary minuses
        raise DatasetFormatError(f"{member} has no valid .npy header (nested too deeply)") from None


def npy_array(data: bytes, member: str = "the .npy file") -> np.ndarray:
    """The array of ``.npy`` file bytes (:func:`npy_header`), as ``np.load`` reads it, read-only, a view of
    ``data``."""
    dtype, shape, order, end = npy_header(data, member)
    count = math.prod(shape)
    if len(data) - end < count * dtype.itemsize:
        raise DatasetFormatError(
            f"{member} holds {len(data) - end} bytes of data; its header declares {shape} {dtype}"
        )
    return np.frombuffer(data, dtype, count=count, offset=end).reshape(shape, order=order)


@functools.lru_cache(maxsize=16)
def _npy_layout(header: bytes) -> tuple[np.dtype, tuple[int, ...], str]:
    """``(dtype, shape, order)`` of a ``.npy`` header; ValueError for one that np.load would not read
    without pickles."""
    stream = io.BytesIO(header)
    np.lib.format.read_magic(stream)
    shape, fortran_order, dtype = NPY_HEADER_READERS[header[6:7]](stream)
    if dtype.hasobject:
        raise ValueError("an object array")
    if dtype.itemsize == 0:
        raise ValueError(f"dtype {dtype} has items of 0 bytes")
    # numpy's limits on an array's dimensions and size, zero-length dimensions aside: (0, 2**62) is none
    if (
        len(shape) > NPY_MAX_DIMS
        or any(size < 0 for size in shape)
        or math.prod(max(size, 1) for size in shape) * dtype.itemsize >= 2**63
    ):
        raise ValueError(f"shape {shape}, beyond what numpy holds")
    return dtype, shape, "F" if fortran_order else "C"
