"""Sparse label matrices and label counts (mlcls/data/datasets/labels.py), against dense numpy
computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Subset

from mlcls.data.datasets.base import DatasetConfigError
from mlcls.data.datasets.labels import LabelCounts, SparseLabelled, SparseLabels, label_counts
from mlcls.losses import BinaryCrossEntropyLoss


def random_labels(rows: int, classes: int, unknown: float, seed: int) -> np.ndarray:
    """(rows, classes) of 1 / 0 / -1: ~10 % positives, ``unknown`` share of -1, the rest 0."""
    rng = np.random.default_rng(seed)
    draw = rng.random((rows, classes))
    return np.where(draw < 0.1, 1.0, np.where(draw < 0.1 + unknown, -1.0, 0.0)).astype(np.float32)


@pytest.mark.parametrize("unknown", [0.0, 0.3, 0.85])
def test_sparse_form_round_trips_and_counts(unknown: float) -> None:
    dense = random_labels(37, 11, unknown, seed=1)
    sparse = SparseLabels.from_dense(dense).check("test")
    assert sparse.fill == (-1 if unknown > 0.5 else 0)  # the most frequent of 0 and -1 is not stored
    np.testing.assert_array_equal(sparse.dense().numpy(), dense)
    for row in (0, 17, 36):
        np.testing.assert_array_equal(sparse.row(row).numpy(), dense[row])
    for value in (1, 0, -1):
        np.testing.assert_array_equal(sparse.count_per_class(value).numpy(), (dense == value).sum(0))
    counts = sparse.counts()
    assert counts.num_samples == 37 and counts.unknown == int((dense == -1).sum())
    restored = SparseLabels.from_bytes(sparse.to_bytes())
    assert restored.fill == sparse.fill
    np.testing.assert_array_equal(restored.dense().numpy(), dense)


def test_rows_selects_and_reorders() -> None:
    dense = random_labels(20, 7, 0.4, seed=2)
    rows = [19, 3, 3, 0, 11]
    picked = SparseLabels.from_dense(dense).rows(rows)
    np.testing.assert_array_equal(picked.dense().numpy(), dense[rows])
    assert picked.shape == (5, 7)
    empty = SparseLabels.from_dense(dense).rows([])
    assert empty.shape == (0, 7) and empty.counts().positives.tolist() == [0] * 7


def test_counts_of_a_dense_matrix_and_of_datasets() -> None:
    dense = torch.from_numpy(random_labels(30, 5, 0.2, seed=3))
    counts = LabelCounts.of(dense)
    assert counts.positives.tolist() == (dense == 1).sum(0).tolist()
    assert counts.negatives.tolist() == (dense == 0).sum(0).tolist()
    assert counts.unknown == int((dense == -1).sum())
    assert counts.positives_per_sample == pytest.approx(float((dense == 1).sum(1).float().mean()))
    assert counts.unknown_share == pytest.approx(float((dense == -1).float().mean()))

    class Dense(torch.utils.data.Dataset):
        labels = dense

    class Sparse(SparseLabelled):
        sparse_labels = SparseLabels.from_dense(dense)

    for dataset in (Dense(), Sparse()):
        assert label_counts(dataset).positives.tolist() == counts.positives.tolist()
        subset = label_counts(Subset(dataset, [4, 2, 9]))
        assert subset.positives.tolist() == (dense[[4, 2, 9]] == 1).sum(0).tolist()
        assert subset.negatives.tolist() == (dense[[4, 2, 9]] == 0).sum(0).tolist()
    assert label_counts(torch.utils.data.TensorDataset(torch.zeros(2))) is None


def test_dense_matrix_only_within_the_budget() -> None:
    class Sparse(SparseLabelled):
        split = "train"
        sparse_labels = SparseLabels.from_dense(random_labels(10, 4, 0.5, seed=4))

    small = Sparse()
    small.dense_labels_gb = 1e-12
    with pytest.raises(DatasetConfigError, match=r"10 x 4 float32\) would take 0\.0 GB, over dataset\.dense"):
        small.labels  # noqa: B018
    np.testing.assert_array_equal(small.target(3).numpy(), small.sparse_labels.dense()[3].numpy())
    roomy = Sparse()
    np.testing.assert_array_equal(roomy.labels.numpy(), roomy.sparse_labels.dense().numpy())


def test_invalid_sparse_arrays_are_refused() -> None:
    good = SparseLabels.from_dense(random_labels(6, 3, 0.0, seed=5))
    with pytest.raises(ValueError, match="class index outside"):
        SparseLabels(good.offsets, good.columns + 3, good.values, 3, good.fill).check("x")
    too_long = good.offsets.copy()
    too_long[-1] += 1
    with pytest.raises(ValueError, match="row offsets"):
        SparseLabels(too_long, good.columns, good.values, 3, good.fill).check("x")
    with pytest.raises(ValueError, match="must be 1"):
        SparseLabels(good.offsets, good.columns, good.values * 2, 3, good.fill).check("x")


def test_bce_class_weights_from_counts_equal_those_from_the_matrix() -> None:
    dense = torch.from_numpy(random_labels(50, 6, 0.3, seed=6))
    from_matrix, from_counts = BinaryCrossEntropyLoss("freq"), BinaryCrossEntropyLoss("freq")
    from_matrix.setup(dense)
    from_counts.setup(LabelCounts.of(dense))
    positives, negatives = (dense == 1).sum(0).double(), (dense == 0).sum(0).double()
    expected = torch.where(positives > 0, negatives / positives.clamp(min=1), 1.0).float()
    torch.testing.assert_close(from_counts.class_weight, expected)
    torch.testing.assert_close(from_matrix.class_weight, expected)


def test_from_bytes_reads_what_the_shape_allows_and_refuses_more() -> None:
    full = SparseLabels.from_dense(np.ones((70, 50)))  # every entry stored: the most a (70, 50) shape holds
    assert len(full.columns) == 70 * 50
    assert SparseLabels.from_bytes(full.to_bytes(), (70, 50)) == full
    # announced as 7 rows: its 3,500 stored classes (14 kB) are more than 7 x 50 entries take
    with pytest.raises(ValueError, match=r"columns.npy declares 14128 bytes, more than 350 integers take"):
        SparseLabels.from_bytes(full.to_bytes(), (7, 50))
    floats = SparseLabels(full.offsets.astype(np.float64), full.columns, full.values, 50, full.fill)
    with pytest.raises(ValueError, match="must be 1-D integer arrays, not 1-D float64, 1-D int32, 1-D int8"):
        floats.check("test")
