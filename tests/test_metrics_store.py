"""The evaluation's output stores: every figure from class-blocked files on disk equals the in-memory
path and the references (scikit-learn, float64 loops from the definitions), in memory bounded by a block."""

from __future__ import annotations

import ctypes
import json
import math

import numpy as np
import pytest
import torch
from hostile import bounded
from sklearn.metrics import average_precision_score

from mlcls.errors import ConfigError
from mlcls.metrics import RowFigures, compute_metrics, store_metrics
from mlcls.metrics import ap as ap_module
from mlcls.metrics import store as store_module
from mlcls.metrics.store import DiskStore, MemoryStore, Storage
from mlcls.metrics.thresholds import NEVER_PREDICTED, ThresholdRule, calibrate_store, calibrate_thresholds


def problem(seed: int, n: int = 53, c: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits with ties (rounded to 0.25), int8 labels with about 20% of -1, one class without a
    positive and one with a single positive."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, c, generator=g) < torch.linspace(0.03, 0.5, c)).to(torch.int8)
    scores = ((torch.randn(n, c, generator=g) + 1.5 * labels) * 4).round() / 4
    labels[torch.rand(n, c, generator=g) < 0.2] = -1
    labels[:, 0] = labels[:, 0].clamp_max(0)
    labels[:, 1] = labels[:, 1].clamp_max(0)
    labels[5, 1] = 1
    return scores, labels


def streamed(
    scores: torch.Tensor, labels: torch.Tensor, batch: int, tmp_path
) -> tuple[DiskStore, RowFigures]:
    """The outputs appended to a disk store ``batch`` rows at a time, as an evaluation appends them."""
    rows = RowFigures(len(scores), top_k=2)
    store = Storage(in_memory_gb=0, folder=str(tmp_path)).open(*scores.shape, rows)
    assert isinstance(store, DiskStore)
    for start in range(0, len(scores), batch):
        store.append(scores[start : start + batch], labels[start : start + batch])
    return store.finish(), rows


def reference_ap(scores: np.ndarray, labels: np.ndarray) -> float:
    """AP of one list from its definition in float64: mean over positives of TP(s_i) / K(s_i)."""
    known = labels >= 0
    s, positive = scores[known].astype(np.float64), labels[known] == 1
    if not positive.any():
        return math.nan
    return float(np.mean([(positive & (s >= x)).sum() / (s >= x).sum() for x in s[positive]]))


@pytest.mark.parametrize(
    ("block_elements", "flush_elements", "batch"), [(1, 1, 1), (40, 60, 7), (1 << 22, 1 << 25, 53)]
)
def test_disk_store_figures_equal_the_in_memory_path_and_the_references(
    block_elements, flush_elements, batch, tmp_path, monkeypatch
):
    """One class per block and one row per flush, a few of each, everything at once: the same figures and
    thresholds, the references' APs; the files are gone once closed."""
    scores, labels = problem(3)
    names = [f"tag{j}" for j in range(scores.shape[1])]
    in_memory = compute_metrics(scores, labels, names, top_k=2, voc11=True)
    rule = ThresholdRule(min_positives=4)
    thresholds = calibrate_thresholds(scores, labels, NEVER_PREDICTED, rule=rule)
    monkeypatch.setattr(ap_module, "BLOCK_ELEMENTS", block_elements)
    monkeypatch.setattr(store_module, "FLUSH_ELEMENTS", flush_elements)
    store, rows = streamed(scores, labels, batch, tmp_path)
    assert store.width == min(scores.shape[1], max(1, block_elements // len(scores)))
    on_disk = store_metrics(store, rows, names, voc11=True)
    assert json.dumps(on_disk, sort_keys=True) == json.dumps(in_memory, sort_keys=True)
    assert torch.equal(calibrate_store(store, NEVER_PREDICTED, rule=rule), thresholds)
    for c in range(2, scores.shape[1]):  # classes with a positive: scikit-learn's AP
        known = labels[:, c] >= 0
        expected = average_precision_score(labels[known, c] == 1, scores[known, c].double())
        assert on_disk["per_class_ap"][names[c]] == pytest.approx(100 * expected, abs=1e-12)
    assert on_disk["per_class_ap"]["tag0"] is None
    expected_rows = [reference_ap(s, y) for s, y in zip(scores.numpy(), labels.numpy(), strict=True)]
    np.testing.assert_allclose(rows.sample_ap.numpy(), expected_rows, atol=1e-12)
    files = list(tmp_path.rglob("*"))
    assert {f.name for f in files if f.is_file()} == {"scores.f32", "labels.i8"}
    store.close()
    assert not any(tmp_path.iterdir())


def test_a_store_refuses_a_wrong_number_of_rows_in_one_line(tmp_path):
    scores, labels = problem(4, n=10)
    store = Storage(in_memory_gb=0, folder=str(tmp_path)).open(12, scores.shape[1])
    store.append(scores, labels)
    with pytest.raises(ValueError, match="^10 rows of outputs for 12 samples$"):
        store.finish()
    with pytest.raises(ValueError, match="for a store of 11 classes"):
        MemoryStore(10, 11).append(scores[:, :5], labels[:, :5])


def peak_growth_mb(n: int, c: int, in_memory_gb: float, folder: str, warm: bool = True) -> float:
    """Stream n x c generated outputs into a store, compute every figure and the thresholds; the growth of
    the peak resident memory meanwhile, in MB (the high-water mark reset first, after a small run that
    brings the code in)."""
    if warm:
        peak_growth_mb(200, 500, in_memory_gb, folder, warm=False)

    def status(field: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) for line in lines if line.startswith(field))

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(0, n, 25):  # batches of 25 rows: what the store copies of one is small beside the outputs
        labels = (torch.rand(25, c, generator=g) < 0.02).to(torch.int8)
        batches.append((torch.randn(25, c, generator=g) + labels, labels))
    # The forked child shares the worker's heap: memory an earlier test freed there would take the store's
    # allocations unseen by the resident size. Given back to the system first, every new page counts.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as reset:
        reset.write("5")
    before = status("VmRSS:")
    rows = RowFigures(n)
    store = Storage(in_memory_gb, folder).open(n, c, rows)
    for scores, labels in batches:
        store.append(scores, labels)
    assert store_metrics(store.finish(), rows, [str(j) for j in range(c)])["classes_counted"] > 0
    calibrate_store(store)
    return (status("VmHWM:") - before) / 1024


@pytest.mark.slow
def test_memory_stays_bounded_by_a_block_not_the_outputs(tmp_path, monkeypatch):
    """Outputs of 95 MB (float32 scores, int8 labels): on disk the peak grows by a third of them at most
    (a block's temporaries, the row buffer, the allocator's slack: 11-24 MB measured here), held in memory
    by half of them at least."""
    monkeypatch.setattr(ap_module, "BLOCK_ELEMENTS", 1 << 16)
    monkeypatch.setattr(store_module, "FLUSH_ELEMENTS", 1 << 16)
    n, c = 1000, 20000
    on_disk = bounded(peak_growth_mb, n, c, 0.0, str(tmp_path), memory_mb=500, seconds=60)
    in_memory = bounded(peak_growth_mb, n, c, 1.0, str(tmp_path), memory_mb=500, seconds=60)
    assert on_disk.error is None and in_memory.error is None, on_disk.trace + in_memory.trace
    outputs_mb = n * c * 5 / 2**20
    assert on_disk.value < outputs_mb / 3 and in_memory.value > outputs_mb / 2, (
        on_disk.value,
        in_memory.value,
    )


@pytest.mark.parametrize("value", [-1, "2GB", None])
def test_a_bad_in_memory_size_is_one_line(value):
    with pytest.raises(ConfigError, match=r"^metrics.in_memory_gb=.*; expected a number of GB >= 0$"):
        Storage(value)
