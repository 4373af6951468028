"""Observed-label regimes (dataset.observed): the draw, its statistics, and its identity across ranks,
workers, resumes and the shards."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import assert_dataset_setting_refused, compose_config
from ranks import run_ranks

from mlcls.cli.data import main as data_main
from mlcls.cli.train import run
from mlcls.data import DatasetConfigError
from mlcls.data.datasets.labels import LabelCounts, SparseLabels, label_counts, observed_counts
from mlcls.data.datasets.observed import ObservedLabels
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.loader import build_train_loader
from mlcls.data.pipeline.transforms import build_transform
from mlcls.data.views import apply_training_policies, training_policies

SIZE = 400


def synthetic(split: str = "train", size: int = SIZE, **observed) -> SyntheticMultiLabel:
    """The ``split`` of the synthetic dataset, the regime of the keys ``observed`` on its training split (as
    ``build_dataset`` puts it)."""
    dataset = SyntheticMultiLabel(split, train_size=size, val_size=size)
    if split == dataset.train_split:
        return apply_training_policies(dataset, **observed)
    training_policies(**observed)
    return dataset


def targets(dataset, indices=None) -> torch.Tensor:
    return torch.stack([dataset.target(i) for i in (range(len(dataset)) if indices is None else indices)])


def test_all_is_the_default_and_changes_nothing() -> None:
    default, explicit = synthetic(), synthetic(observed="all", observed_seed=7, observed_fraction=0.5)
    assert torch.equal(explicit.labels, default.labels)
    # bit for bit: every target is the row of the label matrix, as before the regimes
    assert targets(explicit).numpy().tobytes() == default.labels.numpy().tobytes()
    counts, reference = label_counts(explicit), LabelCounts.of(default.labels)
    assert torch.equal(counts.positives, reference.positives)
    assert torch.equal(counts.negatives, reference.negatives)


@pytest.mark.parametrize(
    "regime", [{"observed": "single_positive"}, {"observed": "partial", "observed_fraction": 0.4}]
)
def test_the_draw_is_a_function_of_seed_and_index(regime: dict) -> None:
    first = targets(synthetic(observed_seed=3, **regime))
    assert torch.equal(first, targets(synthetic(observed_seed=3, **regime)))
    assert not torch.equal(first, targets(synthetic(observed_seed=4, **regime)))
    # sample i alone, last, or among others in another order: the same row
    order = np.random.default_rng(0).permutation(SIZE)[:50].tolist()
    fresh = synthetic(observed_seed=3, **regime)
    assert torch.equal(targets(fresh, order[::-1]), first[order[::-1]])
    assert torch.equal(synthetic(observed_seed=3, **regime).target(order[0]), first[order[0]])
    # a longer split (the same first rows) draws the same rows for them: the draw does not depend on N
    longer = synthetic(size=SIZE * 2, observed_seed=3, **regime)
    assert torch.equal(longer.labels[:SIZE], fresh.labels)
    assert torch.equal(targets(longer, range(SIZE)), first)


def test_single_positive_keeps_one_of_the_positives_uniformly() -> None:
    dataset = synthetic(size=2000, observed="single_positive", observed_seed=11)
    full, shown = dataset.labels, targets(dataset)
    assert torch.equal((shown == 1).sum(1), torch.ones(2000, dtype=torch.long))  # every image has positives
    assert bool((full[shown == 1] == 1).all()) and not bool((shown == 0).any())
    assert set(shown.unique().tolist()) == {1.0, -1.0}

    # Uniform among the positives: 24,000 rows of 4 positives, the kept one's rank among them counted.
    rows = np.repeat(np.arange(24_000), 4)
    columns = np.tile([2, 5, 7, 11], 24_000)
    kept = ObservedLabels("single_positive", 5).observe(rows, columns, np.ones(len(rows), np.int8))
    ranks = np.bincount(np.flatnonzero(kept == 1) % 4, minlength=4)
    assert ranks.sum() == 24_000
    sd = np.sqrt(24_000 * 0.25 * 0.75)
    assert np.abs(ranks - 6000).max() < 4.5 * sd, ranks  # 4.5 standard deviations: 1 in ~10^5 per rank

    # an image without any positive keeps no observed label (kept, all unknown), as the authors' code does
    row = ObservedLabels("single_positive", 5).row(torch.tensor([0.0, -1.0, 0.0]), 3)
    assert row.tolist() == [-1.0, -1.0, -1.0]


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 1.0])
def test_partial_keeps_each_label_with_probability_p(fraction: float) -> None:
    dataset = synthetic(size=2000, observed="partial", observed_fraction=fraction, observed_seed=2)
    full, shown = dataset.labels, targets(dataset)
    kept = shown != -1
    assert torch.equal(shown[kept], full[kept])  # a kept label is unchanged, the others are unknown
    share, entries = kept.float().mean().item(), kept.numel()
    assert abs(share - fraction) <= 4.5 * np.sqrt(fraction * (1 - fraction) / entries) + 1e-12, share
    # positives and negatives are kept alike
    for value in (1.0, 0.0):
        of_value = full == value
        assert abs(kept[of_value].float().mean().item() - fraction) < 0.05


def test_evaluation_reads_the_full_labels() -> None:
    val = synthetic("val", observed="single_positive")
    assert torch.equal(targets(val), val.labels) and not hasattr(val, "observed")  # no regime wraps it
    with pytest.raises(DatasetConfigError, match="also dataset.val_split") as error:
        dataset = SyntheticMultiLabel("train", val_split="train")
        apply_training_policies(dataset, observed="partial", observed_fraction=0.5)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("fill", [-1, 0])
@pytest.mark.parametrize("regime", [ObservedLabels("single_positive", 9), ObservedLabels("partial", 9, 0.3)])
def test_counts_are_those_of_the_targets(fill: int, regime: ObservedLabels) -> None:
    rng = np.random.default_rng(1)
    shares = [0.2, 0.5, 0.3] if fill == 0 else [0.2, 0.2, 0.6]  # Open Images: most labels unknown
    dense = rng.choice([1, 0, -1], size=(300, 17), p=shares).astype(np.float32)
    dense[::7] = fill  # rows without any positive
    sparse = SparseLabels.from_dense(dense)
    assert sparse.fill == fill
    samples = rng.permutation(10_000)[:300]  # rows drawn for other sample indices (shards: their keys)
    shown = torch.stack([regime.row(torch.from_numpy(dense[i]), int(samples[i])) for i in range(300)])
    reference = LabelCounts.of(shown)
    counts = observed_counts(sparse, regime, samples)
    assert torch.equal(counts.positives, reference.positives)
    assert torch.equal(counts.negatives, reference.negatives)
    assert counts.num_samples == 300


@pytest.mark.parametrize(
    "regime", [{"observed": "single_positive"}, {"observed": "partial", "observed_fraction": 0.5}]
)
def test_sparse_labels_draw_alike_without_a_dense_matrix(tmp_path: Path, regime: dict) -> None:
    from openimages_fixture import write_generated_openimages

    from mlcls.data.datasets.openimages import OpenImages

    root, rows = write_generated_openimages(tmp_path)
    train = OpenImages("train", root=str(root), dense_labels_gb=1e-12)
    train = apply_training_policies(train, observed_seed=8, **regime)
    full = torch.tensor(rows["train"])
    rule = ObservedLabels(regime["observed"], 8, regime.get("observed_fraction", 1.0))
    shown = targets(train)
    assert torch.equal(shown, torch.stack([rule.row(full[i], i) for i in range(len(full))]))
    assert bool((shown[full == -1] == -1).all())  # an unverified pair stays unknown
    counts, reference = label_counts(train), LabelCounts.of(shown)  # no (N, C) matrix is built
    assert torch.equal(counts.positives, reference.positives)
    assert torch.equal(counts.negatives, reference.negatives)
    validation = OpenImages("validation", root=str(root))
    assert torch.equal(targets(validation), torch.tensor(rows["validation"]))


def _loader_targets(dataset, rank: int, world: int, workers: int, epoch: int, start: int = 0) -> list:
    loader = build_train_loader(dataset, 8, workers, rank, world, 5, torch.device("cpu"), "torchvision")
    loader.sampler.set_epoch(epoch)
    loader.sampler.set_start(start)
    return [batch[1] for batch in loader]


def regime_dataset() -> SyntheticMultiLabel:
    dataset = SyntheticMultiLabel("train", build_transform("light", 16, True), canvas_size=16, train_size=64)
    return apply_training_policies(dataset, observed="single_positive", observed_seed=1)


@pytest.mark.slow
def test_workers_and_resume_serve_the_same_targets() -> None:
    dataset = regime_dataset()
    full = _loader_targets(dataset, 0, 1, 0, epoch=2)
    order = list(iter_indices(dataset, 0, 1, epoch=2))
    assert torch.equal(torch.cat(full), targets(dataset, order[: 8 * len(full)]))
    assert all(
        torch.equal(a, b) for a, b in zip(_loader_targets(dataset, 0, 1, 2, epoch=2), full, strict=True)
    )
    resumed = _loader_targets(regime_dataset(), 0, 1, 2, epoch=2, start=3 * 8)  # a new process's dataset
    assert len(resumed) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[3:], strict=True))


def iter_indices(dataset, rank: int, world: int, epoch: int):
    from mlcls.data.sampling import ResumableSampler

    sampler = ResumableSampler(dataset, world, rank, 5)
    sampler.set_epoch(epoch)
    return (index for index, _ in sampler)


def _gather_on_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dataset = regime_dataset()  # built on each rank, as the trainer does
    mine = torch.cat(_loader_targets(dataset, rank, 2, 0, epoch=1))
    every = targets(dataset)
    gathered = {
        "mine": [torch.zeros_like(mine) for _ in range(2)],
        "every": [torch.zeros_like(every) for _ in range(2)],
    }
    dist.all_gather(gathered["mine"], mine)
    dist.all_gather(gathered["every"], every)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_draw_the_rows_of_one(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "gathered.pt"
    run_ranks(_gather_on_rank, (port, str(out)))
    gathered = torch.load(out)
    dataset = regime_dataset()
    single = targets(dataset)
    assert all(torch.equal(every, single) for every in gathered["every"])
    for rank in range(2):
        order = list(iter_indices(dataset, rank, 2, epoch=1))
        assert torch.equal(gathered["mine"][rank], single[order[: len(gathered["mine"][rank])]])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dataset.observed=some", "dataset.observed='some'; expected one of all, single_positive, partial"),
        ("dataset.observed_fraction=0", "dataset.observed_fraction=0; expected a number in (0, 1]"),
        ("dataset.observed_fraction=1.5", "dataset.observed_fraction=1.5; expected a number in (0, 1]"),
        ("dataset.observed_fraction=-0.2", "dataset.observed_fraction=-0.2; expected a number in (0, 1]"),
        ("dataset.observed_seed=-1", "dataset.observed_seed=-1; expected an integer from 0"),
    ],
)
def test_bad_settings_are_one_line(override: str, message: str, capsys) -> None:
    assert_dataset_setting_refused(override, message, capsys)


def test_stats_reports_the_observed_counts_per_class(capsys) -> None:
    assert (
        data_main(
            [
                "stats",
                "dataset=synthetic",
                "dataset.train_size=300",
                "dataset.observed=partial",
                "dataset.observed_fraction=0.25",
                "dataset.observed_seed=6",
                "--split",
                "train",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    dataset = synthetic(size=300, observed="partial", observed_fraction=0.25, observed_seed=6)
    shown = targets(dataset)
    assert "observed labels: partial (seed 6, fraction 0.25)" in printed
    for c, name in enumerate(dataset.classes):
        column = shown[:, c]
        counts = [int((column == v).sum()) for v in (1, 0, -1)]
        assert f"    {name}: {counts[0]} / {counts[1]} / {counts[2]}\n" in printed


# --- shards -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("webdataset")
    from test_data_shards import pack_synthetic

    out = tmp_path_factory.mktemp("packed")
    assert pack_synthetic(out) == 0
    return out


def test_shards_draw_the_source_rows_by_key(packed: Path) -> None:
    from test_data_shards import URLS

    from mlcls.data.shards.datasets import open_shards
    from mlcls.data.shards.reader import iter_shard

    regime = {"observed": "single_positive", "observed_seed": 4}
    shards = apply_training_policies(open_shards("train", str(packed / URLS), transform=None), **regime)
    source = synthetic(size=90, **regime)
    shown = []
    for url in shards.urls:
        for key, fields in iter_shard(url):
            _, target = shards.make_sample(key, fields, 0)
            assert torch.equal(target, source.target(int(key))), key
            shown.append(target)
    counts, reference = label_counts(shards), LabelCounts.of(torch.stack(shown))
    assert torch.equal(counts.positives, reference.positives) and int(counts.negatives.sum()) == 0


@pytest.mark.slow
def test_shards_train_under_single_positive(packed: Path, tmp_path: Path) -> None:
    from test_data_shards import URLS, shard_training

    overrides = shard_training(packed, URLS) + [
        "dataset.observed=single_positive",
        "loss.pos_weight=none",
    ]
    run(compose_config(overrides), run_dir=tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["epochs_completed"] == 1
    train_size = results["dataset"]["train_size"]
    # one observed positive per image, every other label of the 12 classes unknown
    assert results["counts"]["ignored_train_labels"] == train_size * 11
