"""Label matrices too large to hold densely, and the per-class counts the trainer reads instead.

Open Images' training labels (~9 M x 9,605) would take ~350 GB as float32, so the training path never needs
the (N, C) matrix: the loss set-up, class statistics and results.json read a :class:`LabelCounts`
(:func:`label_counts`), and each target row is built on its own (:meth:`SparseLabels.row`). Such matrices are
stored as ``.npz`` files of ``.npy`` arrays, read here within bounds whatever their bytes (:func:`npy_array`;
packed shards' label members too).
"""

from __future__ import annotations

import functools
import io
import math
import tokenize
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Subset

from mlcls.data.datasets.base import LABEL_VALUES, DatasetConfigError, DatasetFormatError
from mlcls.data.datasets.observed import ALL_LABELS, ObservedLabels

NPZ_ARRAYS = ("offsets", "columns", "values", "shape_fill")  # the members of SparseLabels.to_bytes
NPY_HEADER_ROOM = 4096  # bytes an .npy member may take besides its data (np.save writes ~128)
# A deflated member may declare at most this many times its compressed bytes, plus NPY_HEADER_ROOM (mlcls
# stores the members; np.savez_compressed of label arrays gains far less).
MAX_DEFLATE_RATIO = 32
OBSERVED_CHUNK = 1 << 22  # label entries drawn at once when counting under a regime (observed_counts)
NPY_MAGIC = b"\x93NUMPY"
NPY_MAX_DIMS = 64  # numpy's NPY_MAXDIMS
NPY_MAX_HEADER = 12 + 10_000  # prefix and numpy's default max_header_size: a longer header is refused
NPY_HEADER_READERS = {
    b"\x01": np.lib.format.read_array_header_1_0,
    b"\x02": np.lib.format.read_array_header_2_0,
}


@dataclass(frozen=True)
class LabelCounts:
    """Per-class counts of an (N, C) label matrix: ``num_samples`` N, ``positives`` and ``negatives`` int64
    (C,), the 1 and 0 entries of each column."""

    num_samples: int
    positives: Tensor
    negatives: Tensor

    @classmethod
    def of(cls, labels: Tensor) -> LabelCounts:
        """The counts of a dense (N, C) matrix."""
        labels = torch.as_tensor(labels)
        return cls(labels.shape[0], (labels == 1).sum(0), (labels == 0).sum(0))

    @property
    def num_classes(self) -> int:
        return self.positives.shape[0]

    @property
    def unknown(self) -> int:
        """Number of -1 entries."""
        return self.num_samples * self.num_classes - int(self.positives.sum()) - int(self.negatives.sum())

    @property
    def positives_per_sample(self) -> float:
        """Mean number of 1 entries per row (0 for no row)."""
        return int(self.positives.sum()) / self.num_samples if self.num_samples else 0.0

    @property
    def unknown_share(self) -> float:
        """Share of -1 entries among all N * C entries (0 for an empty matrix)."""
        entries = self.num_samples * self.num_classes
        return self.unknown / entries if entries else 0.0

    def ranked(self, classes: list[str], count: int, most: bool) -> list[tuple[str, int]]:
        """The ``count`` most (or least) frequent classes as ``(name, positives)``; ties by class order."""
        order = sorted(range(len(classes)), key=lambda c: (-1 if most else 1) * int(self.positives[c]))
        return [(classes[c], int(self.positives[c])) for c in order[:count]]


class SparseLabels:
    """An (N, C) label matrix stored as its entries that differ from ``fill`` (compressed rows): row ``i``
    stores the classes ``columns[offsets[i]:offsets[i + 1]]`` (int32, ascending) with ``values`` (int8,
    1 / 0 / -1); ``offsets`` is int64 (N + 1,), from 0, non-decreasing. Open Images keeps its verified
    labels with ``fill = -1``; :meth:`from_dense` of a fully labelled matrix its positives with 0.
    """

    def __init__(
        self, offsets: np.ndarray, columns: np.ndarray, values: np.ndarray, num_classes: int, fill: int = -1
    ) -> None:
        self.offsets, self.columns, self.values = offsets, columns, values
        self.shape = (len(offsets) - 1, int(num_classes))
        self.fill = int(fill)

    @classmethod
    def from_dense(cls, labels: Tensor | np.ndarray) -> SparseLabels:
        """The sparse form of a dense (N, C) matrix, ``fill`` its most frequent value among 0 and -1."""
        dense = np.asarray(labels, dtype=np.int8)
        fill = 0 if (dense == 0).sum() >= (dense == -1).sum() else -1
        rows, columns = np.nonzero(dense != fill)
        offsets = np.zeros(dense.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=offsets[1:])
        return cls(offsets, columns.astype(np.int32), dense[rows, columns], dense.shape[1], fill)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.columns.nbytes + self.values.nbytes

    def row(self, index: int) -> Tensor:
        """float32 (C,): row ``index`` with 1 / 0 / -1."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return dense_row(self.columns[start:end], self.values[start:end], self.shape[1], self.fill)

    def stored_entries(self, index: int) -> np.ndarray:
        """int32 (K, 2): the stored entries of row ``index`` as ``(class, value)`` pairs, class ascending."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return np.stack([self.columns[start:end], self.values[start:end]], axis=1).astype(np.int32)

    @classmethod
    def from_stored_entries(cls, rows: list[np.ndarray], num_classes: int, fill: int) -> SparseLabels:
        """The matrix whose row ``i`` stores the pairs ``rows[i]`` (int (K_i, 2), :meth:`stored_entries`)."""
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(pairs) for pairs in rows], out=offsets[1:])
        pairs = np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.int32)
        return cls(offsets, pairs[:, 0].astype(np.int32), pairs[:, 1].astype(np.int8), num_classes, fill)

    def __eq__(self, other: object) -> bool:
        """The same matrix stored the same way (fill, rows and entries)."""
        return (
            isinstance(other, SparseLabels)
            and (self.shape, self.fill) == (other.shape, other.fill)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.columns, other.columns)
            and np.array_equal(self.values, other.values)
        )

    __hash__ = None  # mutable arrays: not hashable

    def rows(self, indices: np.ndarray | list[int]) -> SparseLabels:
        """The rows ``indices``, in that order, as a new :class:`SparseLabels`."""
        indices = np.asarray(indices, dtype=np.int64)
        starts, ends = self.offsets[indices], self.offsets[indices + 1]
        lengths = ends - starts
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Position of each kept entry in the old arrays: its row's start plus its rank within the row.
        take = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return SparseLabels(offsets, self.columns[take], self.values[take], self.shape[1], self.fill)

    def dense(self) -> Tensor:
        """float32 (N, C): the whole matrix (N * C * 4 bytes)."""
        rows = np.repeat(np.arange(self.shape[0]), np.diff(self.offsets))
        dense = torch.full(self.shape, float(self.fill))
        dense[torch.from_numpy(rows), torch.from_numpy(self.columns).long()] = torch.from_numpy(
            self.values
        ).float()
        return dense

    def count_per_class(self, value: int) -> Tensor:
        """int64 (C,): number of entries equal to ``value`` (1, 0 or -1) in each column."""
        stored = np.bincount(self.columns[self.values == value], minlength=self.shape[1]).astype(np.int64)
        if value == self.fill:
            stored = len(self) - np.bincount(self.columns, minlength=self.shape[1]) + stored
        return torch.from_numpy(stored.astype(np.int64))

    def counts(self) -> LabelCounts:
        return LabelCounts(len(self), self.count_per_class(1), self.count_per_class(0))

    def check(self, where: str) -> SparseLabels:
        """Raise ``ValueError`` naming ``where`` unless the arrays form a valid matrix; return ``self``."""
        offsets, columns = self.offsets, self.columns
        arrays = (offsets, columns, self.values)
        if any(array.ndim != 1 or array.dtype.kind not in "iu" for array in arrays):
            raise ValueError(
                f"{where}: row offsets, classes and values must be 1-D integer arrays, not "
                + ", ".join(f"{array.ndim}-D {array.dtype}" for array in arrays)
            )
        if (
            len(offsets) == 0
            or offsets[0] != 0
            or offsets[-1] != len(columns)
            or len(self.values) != len(columns)
            or (np.diff(offsets) < 0).any()
        ):
            raise ValueError(f"{where}: row offsets do not match the {len(columns)} stored labels")
        if len(columns) and (columns.min() < 0 or columns.max() >= self.shape[1]):
            raise ValueError(f"{where}: class index outside [0, {self.shape[1]})")
        if not np.isin(self.values, LABEL_VALUES).all() or self.fill not in LABEL_VALUES:
            raise ValueError(f"{where}: labels must be 1 (positive), 0 (negative) or -1 (unknown)")
        return self

    def to_bytes(self) -> bytes:
        """The matrix as an ``.npz`` file (arrays ``offsets``, ``columns``, ``values``, ``shape_fill``)."""
        buffer = io.BytesIO()
        np.savez(
            buffer,
            offsets=self.offsets,
            columns=self.columns,
            values=self.values,
            shape_fill=np.asarray([*self.shape, self.fill], dtype=np.int64),
        )
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, shape: tuple[int, int] | None = None) -> SparseLabels:
        """The matrix of :meth:`to_bytes`'s ``.npz`` bytes (members stored or deflated); ValueError for any
        other bytes. Bounded: no member is decompressed past :data:`MAX_DEFLATE_RATIO` times its compressed
        size (at most ``len(data)``) nor, given the ``shape`` (N, C) announced elsewhere, past what an
        (N, C) matrix takes (N + 1 offsets, N * C entries of 8 bytes at most, the headers). A member that
        declares more is refused before it is read; one holding more ends at its declared size (and fails
        its CRC)."""
        entries = None if shape is None else shape[0] * shape[1]
        limits = {
            "offsets": None if shape is None else shape[0] + 1,
            "columns": entries,
            "values": entries,
            "shape_fill": 3,
        }
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                arrays = {name: _npz_array(archive, name, limits[name], len(data)) for name in NPZ_ARRAYS}
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise ValueError(f"not an .npz file of label arrays ({exc})") from None
        shape_fill = arrays["shape_fill"]
        if shape_fill.shape != (3,) or shape_fill.dtype.kind not in "iu":
            raise ValueError(f"shape_fill is {shape_fill.shape} {shape_fill.dtype}, not 3 integers")
        rows, classes, fill = (int(v) for v in shape_fill)
        labels = cls(arrays["offsets"], arrays["columns"], arrays["values"], classes, fill)
        if len(labels) != rows:
            raise ValueError(f"{rows} rows announced, {len(labels)} stored")
        return labels


def _npz_array(archive: zipfile.ZipFile, name: str, items: int | None, file_size: int) -> np.ndarray:
    """A writable copy of the array ``name`` of ``archive`` (``file_size`` bytes) within the bounds of
    :meth:`SparseLabels.from_bytes` (``items``: the integers the shape allows, None: any)."""
    info = archive.getinfo(f"{name}.npy")
    check_npz_member(info, file_size)
    if items is not None and info.file_size > NPY_HEADER_ROOM + 8 * items:
        raise ValueError(
            f"{name}.npy declares {info.file_size} bytes, more than {items} integers take (the matrix's "
            "shape allows no more)"
        )
    if info.file_size > MAX_DEFLATE_RATIO * info.compress_size + NPY_HEADER_ROOM:
        raise ValueError(
            f"{name}.npy declares {info.file_size} bytes from {info.compress_size} compressed, more than "
            f"{MAX_DEFLATE_RATIO} times; expected label arrays, not a deflate bomb"
        )
    with archive.open(info) as member:
        return npy_array(member.read(info.file_size), f"{name}.npy").copy()


def dense_row(columns: np.ndarray, values: np.ndarray, num_classes: int, fill: int) -> Tensor:
    """float32 (C,): ``fill`` everywhere but at the classes ``columns`` (int (K,)), set to ``values``."""
    row = torch.full((num_classes,), float(fill))
    row[torch.from_numpy(np.asarray(columns)).long()] = torch.from_numpy(np.asarray(values)).float()
    return row


def observed_counts(
    labels: SparseLabels, observed: ObservedLabels, samples: np.ndarray | None = None
) -> LabelCounts:
    """The exact :class:`LabelCounts` of ``labels`` as the regime ``observed`` shows them, row ``i`` being
    sample ``samples[i]`` (``i`` when None). Drawn :data:`OBSERVED_CHUNK` entries at a time over the known
    entries: the stored ones when ``fill = -1``, else each block of rows made dense."""
    if not observed.hides_labels:
        return labels.counts()
    num_rows, num_classes = labels.shape
    step = max(1, OBSERVED_CHUNK // (1 if labels.fill == -1 else num_classes))
    positives, negatives = np.zeros(num_classes, np.int64), np.zeros(num_classes, np.int64)
    for start in range(0, num_rows, step):
        block = labels.rows(np.arange(start, min(start + step, num_rows)))
        if labels.fill == -1:
            rows = np.repeat(np.arange(len(block)), np.diff(block.offsets))
            columns, values = block.columns, block.values
        else:
            dense = block.dense().numpy()
            rows, columns = np.nonzero(dense != -1)
            values = dense[rows, columns]
        rows = rows + start
        seen = observed.observe(rows if samples is None else samples[rows], columns, values)
        positives += np.bincount(columns[seen == 1], minlength=num_classes)
        negatives += np.bincount(columns[seen == 0], minlength=num_classes)
    return LabelCounts(num_rows, torch.from_numpy(positives), torch.from_numpy(negatives))


class SparseLabelled:
    """A dataset whose labels are a :class:`SparseLabels` (``sparse_labels``): targets and counts come from
    it, and the dense ``labels`` is built on first access only when it fits in ``dense_labels_gb``."""

    sparse_labels: SparseLabels
    dense_labels_gb: float = 8.0
    _dense_labels: Tensor | None = None

    def sample_indices(self) -> np.ndarray | None:
        """int64 (N,): the sample index a regime draws each row of ``sparse_labels`` for; None: ``i``."""
        return None

    def label_counts(self) -> LabelCounts:
        return self.sparse_labels.counts()

    def target(self, index: int) -> Tensor:
        """float32 (C,): the labels of sample ``index``."""
        return self.sparse_labels.row(index)

    @property
    def labels(self) -> Tensor:
        """float32 (N, C), built on first access; :class:`DatasetConfigError` past ``dense_labels_gb``."""
        if self._dense_labels is None:
            rows, classes = self.sparse_labels.shape
            size_gb = 4 * rows * classes / 1e9
            if size_gb > self.dense_labels_gb:
                raise DatasetConfigError(
                    f"{type(self).__name__} ({getattr(self, 'split', '?')} split): the dense label matrix "
                    f"({rows} x {classes} float32) would take {size_gb:.1f} GB, over "
                    f"dataset.dense_labels_gb={self.dense_labels_gb:g}; training needs only each sample's "
                    "row and the label counts (label_counts), not this matrix"
                )
            self._dense_labels = self.sparse_labels.dense()
        return self._dense_labels


def sparse_labels_of(dataset: object) -> SparseLabels:
    """A dataset's ``sparse_labels``, or its dense ``labels`` converted."""
    sparse = getattr(dataset, "sparse_labels", None)
    return sparse if sparse is not None else SparseLabels.from_dense(dataset.labels)


def label_counts(dataset: object) -> LabelCounts | None:
    """The :class:`LabelCounts` of a dataset's targets: its ``label_counts()``, else of its ``labels``; a
    ``Subset``'s of its parent's rows as the parent's regime (``observed``) shows them; None without
    labels."""
    if isinstance(dataset, Subset):
        parent = dataset.dataset
        if getattr(parent, "sparse_labels", None) is None and getattr(parent, "labels", None) is None:
            return None
        indices = np.asarray(list(dataset.indices), dtype=np.int64)
        observed = getattr(parent, "observed", ALL_LABELS)
        return observed_counts(sparse_labels_of(parent).rows(indices), observed, indices)
    counts = getattr(dataset, "label_counts", None)
    if counts is not None:
        return counts()
    labels = getattr(dataset, "labels", None)
    return None if labels is None else LabelCounts.of(labels)


# ---- .npy and .npz files as np.load reads them, bounded: label arrays of packed shards and run files.


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
