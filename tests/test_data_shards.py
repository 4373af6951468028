"""Packed shards: ``mlcls-data pack`` (WebDataset layout, resume, sha256, skipped images) and
``dataset=shards`` (ranks and workers without duplicates, exact resume, pack -> train -> evaluate, equal
evaluation on 1 and 2 gloo processes)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, compose_config
from data_fixtures import corrupt, write_voc
from openimages_fixture import write_generated_openimages
from PIL import Image, JpegImagePlugin
from ranks import run_ranks

from mlcls.cli.data import main as data_main
from mlcls.cli.train import run
from mlcls.data import DatasetConfigError, DatasetFormatError, build_dataset
from mlcls.data.datasets.base import MultiLabelDataset, Sample
from mlcls.data.datasets.labels import SparseLabels, npy_array, npy_header
from mlcls.data.datasets.synthetic import SyntheticMultiLabel
from mlcls.data.loader import build_eval_loader, build_train_loader
from mlcls.data.shards import pack as pack_module
from mlcls.data.shards.datasets import ShardTrainSet, open_shards
from mlcls.data.shards.loader import ShardSchedule, ShardStream
from mlcls.data.shards.pack import encode_jpeg, labels_file, pack_split, packed_image
from mlcls.data.shards.reader import iter_shard
from mlcls.data.shards.tario import tar_files

wds = pytest.importorskip("webdataset")

SYNTHETIC = ["dataset.train_size=90", "dataset.val_size=30"]
URLS = "train-{000000..000003}.tar"  # 90 samples in shards of 25


def pack_synthetic(out: Path, *extra: str) -> int:
    return data_main(["pack", *SYNTHETIC, f"out={out}", "shard_size=25", "max_side=48", *extra])


# PIL's ``subsampling`` codes, as JpegImagePlugin.get_sampling reads them back from a file.
PIL_SUBSAMPLING = {"444": 0, "422": 1, "420": 2}


def pil_jpeg(image: Image.Image, quality: int = 90, subsampling: str = "444") -> bytes:
    """``image`` saved by PIL as a JPEG."""
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality, subsampling=PIL_SUBSAMPLING[subsampling])
    return buffer.getvalue()


def pixels(data: bytes) -> np.ndarray:
    """float (H, W, 3) RGB pixels of the image file ``data``, decoded by PIL."""
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"), float)


def assert_pils_jpeg(data: bytes, source: Image.Image, quality: int = 90, subsampling: str = "444") -> None:
    """``data`` is a JPEG of ``source`` as PIL writes it at ``quality`` and ``subsampling``: the same chroma
    sampling in its header and the same mean error against ``source``, within 2 % (the two libjpeg-turbo
    builds round differently, ~1.5 grey levels apart pixel by pixel; a step of quality or of subsampling
    changes the error by 15 % or more)."""
    assert sampling_of(data) == PIL_SUBSAMPLING[subsampling]
    reference = np.asarray(source.convert("RGB"), float)
    ours = np.abs(pixels(data) - reference).mean()
    pils = np.abs(pixels(pil_jpeg(source, quality, subsampling)) - reference).mean()
    assert abs(ours - pils) <= 0.02 * pils, (ours, pils)


def sampling_of(data: bytes) -> int:
    """PIL's subsampling code (0 4:4:4, 1 4:2:2, 2 4:2:0) of the JPEG ``data``, read from its header."""
    with Image.open(io.BytesIO(data)) as img:
        return JpegImagePlugin.get_sampling(img)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed")
    assert pack_synthetic(out) == 0
    return out


# A generated Open Images (64 train, 20 validation images, 12 classes) packed with a dense-label budget too
# small for any (N, C) matrix: packing, training and evaluation read only label rows and counts.
OPENIMAGES = ["dataset=openimages", "dataset.dense_labels_gb=1e-12", "dataset.image_size=32"]
OPENIMAGES_URLS = "train-{000000..000003}.tar"  # 64 samples in shards of 16


@pytest.fixture(scope="module")
def generated_openimages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return write_generated_openimages(tmp_path_factory.mktemp("openimages"))


@pytest.fixture(scope="module")
def packed_openimages(tmp_path_factory: pytest.TempPathFactory, generated_openimages) -> Path:
    root, _ = generated_openimages
    out = tmp_path_factory.mktemp("packed_openimages")
    options = [f"dataset.root={root}", f"out={out}", "shard_size=16", "max_side=32"]
    assert data_main(["pack", *OPENIMAGES, *options]) == 0
    return out


# (fixture of the packed folder, its training shards, classes, validation samples, the source's val split)
PACKS = {
    "synthetic": ("packed", URLS, 12, 30),
    "openimages": ("packed_openimages", OPENIMAGES_URLS, 12, 20),
}


def test_pack_writes_webdataset_shards_of_the_resized_images(packed: Path) -> None:
    source = SyntheticMultiLabel("train", train_size=90, canvas_size=64)
    dataset = wds.WebDataset(str(packed / URLS), shardshuffle=False).decode()
    seen = []
    for sample in dataset:
        index = int(sample["__key__"])
        seen.append(index)
        with Image.open(io.BytesIO(sample["jpg"])) as image:
            assert image.size == (48, 48)
        # The row stored sparse: (class, value) of the entries other than the split's fill, 0 here.
        expected = [[c, int(v)] for c, v in enumerate(source.labels[index].tolist()) if v != 0]
        assert (
            sample["labels.sparse.npy"].tolist() == expected and sample["labels.sparse.npy"].dtype == np.int32
        )
        assert_pils_jpeg(sample["jpg"], source.load_image(index).resize((48, 48), Image.Resampling.BILINEAR))
    assert sorted(seen) == list(range(90)) and seen != sorted(seen)  # every sample once, shuffled
    classes = json.loads((packed / "classes.json").read_text())
    assert classes["classes"] == source.classes and classes["dataset"] == "synthetic"
    assert classes["splits"] == {"train": "train", "val": "val"} and classes["max_side"] == 48
    assert (classes["quality"], classes["subsampling"]) == (90, "auto")  # generated pixels: 4:4:4
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["train"]["label_fill"] == 0
    assert manifest["source"] == {"image_size": 64, "transform": "light"}  # the synthetic config's
    for name, entry in [
        ("classes.json", manifest["classes"]),
        ("train-labels.npz", manifest["train"]["labels"]),
    ]:
        assert entry == {
            "name": name,
            "bytes": (packed / name).stat().st_size,
            "sha256": hashlib.sha256((packed / name).read_bytes()).hexdigest(),
        }
    assert [e["samples"] for e in manifest["train"]["shards"]] == [25, 25, 25, 15]
    assert manifest["val"]["samples"] == 30 and manifest["train"]["skipped"] == []
    for entry in manifest["train"]["shards"] + manifest["val"]["shards"]:
        assert entry["sha256"] == hashlib.sha256((packed / entry["name"]).read_bytes()).hexdigest()
    rows = SparseLabels.from_bytes((packed / "train-labels.npz").read_bytes())
    torch.testing.assert_close(rows.dense(), source.labels[seen])  # the sidecar, in shard order


def test_a_killed_pack_continues_at_the_next_shard(tmp_path: Path, packed: Path, monkeypatch) -> None:
    dataset = SyntheticMultiLabel("train", train_size=90, canvas_size=64)
    real_write = pack_module.write_shard
    written = []

    def dies_in_third_shard(dataset, path, *args):
        if len(written) == 2:
            (path.with_name(path.name + ".tmp")).write_bytes(b"half a shard")
            raise KeyboardInterrupt
        written.append(path.name)
        return real_write(dataset, path, *args)

    monkeypatch.setattr(pack_module, "write_shard", dies_in_third_shard)
    with pytest.raises(KeyboardInterrupt):
        pack_split(dataset, tmp_path, "train", 25, 48, shuffle=True, progress=False)
    assert sorted(p.name for p in tmp_path.glob("train-*.tar")) == ["train-000000.tar", "train-000001.tar"]
    monkeypatch.setattr(pack_module, "write_shard", real_write)
    report = pack_split(dataset, tmp_path, "train", 25, 48, shuffle=True, progress=False)
    assert (report.kept, report.written) == (2, 2)
    for k in range(4):  # the same bytes as the uninterrupted pack
        name = f"train-{k:06d}.tar"
        assert (tmp_path / name).read_bytes() == (packed / name).read_bytes(), name
    # Other settings: refused in one line, or with overwrite every file of the split replaced.
    with pytest.raises(
        DatasetConfigError, match=r"packed with other settings \(shard_size 25 -> 30\);.*overwrite"
    ):
        pack_split(dataset, tmp_path, "train", 30, 48, shuffle=True, progress=False)
    report = pack_split(dataset, tmp_path, "train", 30, 48, shuffle=True, progress=False, overwrite=True)
    assert (report.kept, report.written) == (0, 3)
    assert sorted(p.name for p in tmp_path.glob("train-*.tar*")) == [f"train-{k:06d}.tar" for k in range(3)]


def test_pack_skips_and_reports_unreadable_images(tmp_path: Path, capsys) -> None:
    root = write_voc(tmp_path, 2007)
    corrupt(root / "VOCdevkit/VOC2007/JPEGImages/a2.jpg")
    out = tmp_path / "shards"
    assert data_main(["pack", "dataset=voc2007", f"dataset.root={root}", f"out={out}", "max_side=32"]) == 1
    printed = capsys.readouterr().out
    assert "train: 2 samples in 1 shards" in printed and "1 unreadable images skipped" in printed
    assert "skipped " in printed and "a2.jpg: UnidentifiedImageError" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["path"].endswith("a2.jpg") for s in manifest["train"]["skipped"]] == [True]
    assert manifest["val"]["samples"] == 2
    assert data_main(["pack", "dataset=voc2007", f"dataset.root={root}"]) == 2
    assert "pack needs out=DIR" in capsys.readouterr().err


@pytest.mark.parametrize("subsampling", ["444", "422", "420"])
@pytest.mark.parametrize("quality", [80, 90])
def test_encode_jpeg_is_pils_jpeg_at_the_quality_and_subsampling(quality: int, subsampling: str) -> None:
    for index in range(3):  # noisy backgrounds, saturated colours: much chroma detail
        image = SyntheticMultiLabel("val", val_size=3).load_image(index)
        assert_pils_jpeg(encode_jpeg(image, quality, subsampling), image, quality, subsampling)


class FileImages(MultiLabelDataset):
    """Image files as a dataset of one class, every label 1 (what ``packed_image`` reads of a dataset)."""

    def __init__(self, samples: list[Sample]) -> None:
        super().__init__(None)
        self.samples, self.classes = samples, ["thing"]
        self.labels = torch.ones(len(samples), 1)


def test_pack_keeps_small_jpegs_byte_for_byte_and_reencodes_the_rest(tmp_path: Path) -> None:
    """A JPEG within ``max_side`` is stored as it is (whatever its quality and subsampling); a larger JPEG,
    a PNG and a crop are re-encoded at the pack's quality and subsampling."""
    photo = SyntheticMultiLabel("val", val_size=1).load_image(0)  # 64 x 64
    small, large, png = tmp_path / "small.jpg", tmp_path / "large.jpg", tmp_path / "small.png"
    photo.save(small, quality=75)  # PIL's default 4:2:0
    photo.resize((128, 96), Image.Resampling.BILINEAR).save(large, quality=95, subsampling=0)
    photo.save(png)
    samples = [Sample(str(small)), Sample(str(large)), Sample(str(png)), Sample(str(small), (0, 0, 32, 16))]
    kept, resized, from_png, cropped = (packed_image(FileImages(samples), i, 64, 90, "420") for i in range(4))
    assert kept == small.read_bytes()
    assert_pils_jpeg(from_png, photo, 90, "420")
    assert_pils_jpeg(cropped, Image.open(small).crop((0, 0, 32, 16)), 90, "420")
    with Image.open(io.BytesIO(resized)) as img:
        assert img.size == (64, 48) and sampling_of(resized) == PIL_SUBSAMPLING["420"]
    expected = np.asarray(Image.open(large).resize((64, 48), Image.Resampling.BILINEAR), float)
    assert np.abs(pixels(resized) - expected).mean() < 8.0  # 4:2:0 of the noise, and draft-mode decoding


def test_auto_subsampling_keeps_a_jpegs_own_and_takes_444_for_other_images(tmp_path: Path) -> None:
    photo = SyntheticMultiLabel("val", val_size=1).load_image(0).resize((128, 96), Image.Resampling.BILINEAR)
    samples = []
    for name, code in PIL_SUBSAMPLING.items():
        photo.save(tmp_path / f"{name}.jpg", quality=95, subsampling=code)
        samples.append(Sample(str(tmp_path / f"{name}.jpg")))
    photo.save(tmp_path / "photo.png")
    samples.append(Sample(str(tmp_path / "photo.png")))
    dataset = FileImages(samples)
    packed = [packed_image(dataset, i, 64, 90, "auto") for i in range(len(samples))]
    assert [sampling_of(data) for data in packed] == [*PIL_SUBSAMPLING.values(), PIL_SUBSAMPLING["444"]]
    # A fixed subsampling applies to every source.
    assert {sampling_of(packed_image(dataset, i, 64, 90, "420")) for i in range(len(samples))} == {2}


def test_pack_subsampling_option(tmp_path: Path, capsys) -> None:
    out = tmp_path / "shards"
    assert pack_synthetic(out, "--split", "val", "subsampling=420", "quality=80") == 0
    classes = json.loads((out / "classes.json").read_text())
    assert (classes["quality"], classes["subsampling"]) == (80, "420")
    source = SyntheticMultiLabel("val", val_size=30, canvas_size=64)
    for sample in wds.WebDataset(str(out / "val-000000.tar"), shardshuffle=False):
        small = source.load_image(int(sample["__key__"])).resize((48, 48), Image.Resampling.BILINEAR)
        assert_pils_jpeg(sample["jpg"], small, 80, "420")
    assert pack_synthetic(tmp_path / "other", "subsampling=411") == 2
    assert "subsampling=411" in capsys.readouterr().err


def shard_keys(
    packed: Path, rank: int, world: int, workers: int, epoch: int, start: int = 0
) -> list[list[int]]:
    """The batches (as sample keys) rank ``rank`` trains on: the loader's own stream, the image replaced by
    the key."""
    dataset = open_shards("train", str(packed / URLS), transform=None)
    dataset.make_sample = lambda key, fields, seed: (int(key), 0)
    loader = build_train_loader(dataset, 8, workers, rank, world, 3, torch.device("cpu"), "fast")
    loader.sampler.set_epoch(epoch)
    loader.sampler.set_start(start)
    batches = [keys.tolist() for keys, _ in loader]
    assert len(batches) == len(loader)
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_ranks_and_workers_read_every_sample_at_most_once(packed: Path, workers: int) -> None:
    per_rank = 90 // (2 * 8) * 8  # DistributedSampler's drop_last count: 40
    ranks = [shard_keys(packed, rank, 2, workers, epoch=1) for rank in range(2)]
    keys = [key for batches in ranks for batch in batches for key in batch]
    assert [sum(map(len, batches)) for batches in ranks] == [per_rank, per_rank]
    assert len(set(keys)) == 2 * per_rank and set(keys) <= set(range(90))
    alone = shard_keys(packed, 0, 1, workers, epoch=1)
    assert sum(map(len, alone)) == 88 and len({k for b in alone for k in b}) == 88
    assert alone != shard_keys(packed, 0, 1, workers, epoch=2)  # a new order every epoch


@pytest.mark.slow
def test_set_start_skips_exactly_the_batches_served(packed: Path) -> None:
    full = shard_keys(packed, 1, 2, 2, epoch=4)
    assert shard_keys(packed, 1, 2, 2, epoch=4, start=3 * 8) == full[3:]
    assert shard_keys(packed, 1, 2, 0, epoch=4, start=2 * 8) == shard_keys(packed, 1, 2, 0, epoch=4)[2:]


def test_schedule_workers_serve_the_batches_in_turn_whatever_their_number() -> None:
    """15 batches in 4 blocks (4, 4, 4, 3); batch i is batch i // 4 of block i % 4. Taking one batch of
    each worker in turn (the DataLoader's order) gives the batches after ``start`` in order, for any
    number of workers."""
    schedule = ShardSchedule([10, 10, 10], batch_size=2, rank=0, world_size=1, seed=0, streams=4)
    assert schedule.stream_blocks() == [(0, 4), (4, 4), (8, 4), (12, 3)]
    for start in (0, 5):
        schedule.set_start(start * 2)
        for workers in (1, 2, 3, 4, 5):
            lists = [list(schedule.worker_batches(w, workers)) for w in range(workers)]
            in_turn = [b for turn in range(15) for batches in lists for b in batches[turn : turn + 1]]
            assert in_turn == list(range(start, 15)), (start, workers)


def test_every_block_shuffles_its_windows_under_its_own_seed(packed: Path) -> None:
    """Two blocks (trainer.workers=2), windows of 8: the first windows of the two blocks are shuffled by
    different permutations (each worker's first window used to be drawn from the same seed)."""
    dataset = open_shards("train", str(packed / URLS), transform=None, shuffle_buffer=8)
    dataset.make_sample = lambda key, fields, seed: int(key)
    schedule = ShardSchedule(dataset.shard_sizes, 8, rank=0, world_size=1, seed=3, streams=2)
    schedule.set_epoch(1)
    in_shard_order = [int(k) for s in schedule.shard_order() for k, _ in iter_shard(dataset.urls[s])]
    served = list(ShardStream(dataset, schedule))  # batch 0 of block 0, then batch 0 of block 1, ...
    second_block = schedule.stream_blocks()[1][0] * 8
    first = [in_shard_order.index(key) for key in served[:8]]
    second = [in_shard_order.index(key) - second_block for key in served[8:16]]
    assert sorted(first) == sorted(second) == list(range(8))
    assert first != second


@pytest.mark.slow
def test_order_and_resume_do_not_depend_on_the_workers_the_cpus_allow(packed: Path, monkeypatch) -> None:
    """trainer.workers=3 (three read blocks): 3 worker processes serve the batches in the order of the
    schedule read in one process; a requeued run capped at 2 or 1 CPUs resumes with exactly the remaining
    batches, in the same order (no sample repeated or skipped)."""
    from mlcls.data import loader

    def keys_on(cpus: int, start: int = 0) -> list[list[int]]:
        monkeypatch.setattr(loader, "available_cpus", lambda: cpus)
        return shard_keys(packed, 1, 2, 3, epoch=4, start=start)

    dataset = open_shards("train", str(packed / URLS), transform=None)
    dataset.make_sample = lambda key, fields, seed: int(key)
    schedule = ShardSchedule(dataset.shard_sizes, 8, rank=1, world_size=2, seed=3, streams=3)
    schedule.set_epoch(4)
    served = list(ShardStream(dataset, schedule))
    full = keys_on(3)
    assert full == [served[k : k + 8] for k in range(0, len(served), 8)]
    assert keys_on(2, start=2 * 8) == full[2:]
    assert keys_on(1, start=3 * 8) == full[3:]


def test_shard_sets_normalise_with_the_config_mean_and_std(packed: Path) -> None:
    """``dataset.mean`` and ``dataset.std`` reach the transform each split of the shards names."""
    keys = ["dataset.transform=light", "dataset.mean=[0,0,0]", "dataset.std=[1,2,4]"]
    cfg = compose_config(["dataset=shards", f"dataset.root={packed}", *keys]).dataset
    for split in ("train", "val"):
        dataset = build_dataset(cfg, train=split == "train")
        normalize = dataset.transform.transforms[-1]
        assert (list(normalize.mean), list(normalize.std)) == ([0.0, 0.0, 0.0], [1.0, 2.0, 4.0]), split


def test_shard_urls_not_in_the_manifest_are_one_line(packed: Path) -> None:
    from mlcls.data import DatasetError

    with pytest.raises(DatasetError, match="is not a train shard"):
        open_shards("train", str(packed / "val-000000.tar"))
    with pytest.raises(DatasetError, match="dataset.meta is needed"):
        open_shards("train", "pipe:cat /x/train-000000.tar")


def shard_training(packed: Path, urls: str) -> list[str]:
    return [o for o in TINY if not o.startswith("dataset")] + [
        "dataset=shards",
        f'dataset.urls="{packed / urls}"',
        "dataset.image_size=32",
        "dataset.transform=light",
        "optim=adamw",
        "loss=bce",
        "loss.pos_weight=freq",  # class-frequency weights: set up from the sidecar's label counts
        "trainer.epochs=1",
        "trainer.batch_size=16",
    ]


def assert_results_of_the_pack(results: dict, packed: Path, pack: str) -> None:
    """results.json of a run on ``pack``'s shards counts the packed samples and has every class's AP."""
    _, _, classes, val_size = PACKS[pack]
    train_size = sum(
        e["samples"] for e in json.loads((packed / "manifest.json").read_text())["train"]["shards"]
    )
    assert results["dataset"]["train_size"] == train_size and results["dataset"]["val_size"] == val_size
    assert len(results["per_class_ap"]) == classes


@pytest.mark.slow
def test_pack_train_evaluate_on_the_shards(packed: Path, tmp_path: Path) -> None:
    """On the synthetic pack, in one process (the Open Images pack trains on two:
    test_shards_train_on_two_processes_and_evaluate_alike_on_one)."""
    results = run(compose_config(shard_training(packed, URLS)), run_dir=tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert_results_of_the_pack(on_disk, packed, "synthetic")
    assert on_disk["metrics"]["mAP_class"] == pytest.approx(results["metrics"]["mAP_class"])


def _train_on_rank(rank: int, packed: str, urls: str, port: int, out: str) -> None:
    from mlcls.engine.trainer import Trainer

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    # on the CPU: a rank forked from a process that may have used CUDA cannot use it
    Trainer(compose_config([*shard_training(Path(packed), urls), "trainer.device=cpu"]), run_dir=out).fit()


@pytest.mark.slow
def test_shards_train_on_two_processes_and_evaluate_alike_on_one(
    packed_openimages: Path, tmp_path: Path
) -> None:
    """On the Open Images pack (sparse labels, unknown entries). The synthetic pack's uneven shards under two
    ranks are test_ranks_and_workers_read_every_sample_at_most_once's, its evaluation on two processes
    test_evaluation_is_equal_on_one_and_two_processes's: the training path is the same."""
    import socket

    from omegaconf import OmegaConf

    from mlcls.cli.eval import checkpoint_metrics

    _, urls, _, val_size = PACKS["openimages"]
    packed = packed_openimages
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_ranks(_train_on_rank, (str(packed), urls, port, str(tmp_path)))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2 and results["epochs_completed"] == 1
    assert_results_of_the_pack(results, packed, "openimages")
    cfg = OmegaConf.merge(
        OmegaConf.load(Path(__file__).parents[1] / "mlcls/configs/eval.yaml"),
        {
            "checkpoint": str(tmp_path / "checkpoints" / "last.pt"),
            "workers": 0,
            "batch_size": 8,
            "device": "cpu",
        },
    )
    cfg.pop("defaults"), cfg.pop("hydra")
    single = checkpoint_metrics(cfg)
    assert single["num_samples"] == val_size
    assert single["mAP_class"] == pytest.approx(results["metrics"]["mAP_class"], abs=1e-6)
    assert single["mAP_sample"] == pytest.approx(results["metrics"]["mAP_sample"], abs=1e-6)


@pytest.mark.slow
def test_openimages_trains_from_the_csvs_without_a_dense_label_matrix(generated_openimages, tmp_path) -> None:
    root, rows = generated_openimages
    overrides = [o for o in TINY if not o.startswith("dataset")] + [
        *OPENIMAGES,
        f"dataset.root={root}",
        "loss=bce",
        "loss.pos_weight=freq",
        "trainer.epochs=1",
        "trainer.batch_size=16",
    ]
    run(compose_config(overrides), run_dir=tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["dataset"] == {"name": "openimages", "num_classes": 12, "train_size": 64, "val_size": 20}
    unknown = sum(value == -1 for row in rows["train"] for value in row)
    assert on_disk["counts"]["ignored_train_labels"] == unknown


def fixed_model(classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, classes)
    )


def evaluate_shards(packed: Path, urls: str, rank: int, world: int) -> dict:
    from mlcls.data import build_dataset
    from mlcls.engine.evaluate import evaluate

    cfg = {
        "_target_": "mlcls.data.shards.datasets.open_shards",
        "urls": str(packed / urls),
        "image_size": 32,
        "transform": "light",
    }
    val_set = build_dataset(cfg, train=False)
    loader = build_eval_loader(val_set, 4, 1, rank, world, torch.device("cpu"))
    evaluation = evaluate(fixed_model(len(val_set.classes)), loader, torch.device("cpu"), val_set.classes)
    return {"metrics": evaluation.metrics, "scores": evaluation.scores, "labels": evaluation.labels}


def _evaluate_on_rank(rank: int, packed: str, urls: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.save(evaluate_shards(Path(packed), urls, rank, 2), Path(out) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_evaluation_is_equal_on_one_and_two_processes(packed: Path, tmp_path: Path) -> None:
    """Scores and labels, not only the figures (test_shards_train_on_two_processes_... compares those)."""
    import socket

    urls = URLS
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_ranks(_evaluate_on_rank, (str(packed), urls, port, str(tmp_path)))
    alone = evaluate_shards(packed, urls, 0, 1)
    expected = SyntheticMultiLabel("val", val_size=30).labels
    torch.testing.assert_close(alone["labels"], expected.to(torch.int8))  # each sample once, in order
    for rank in range(2):
        both = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        if rank == 0:  # the whole set is gathered on rank 0 only
            torch.testing.assert_close(both["scores"], alone["scores"])
            torch.testing.assert_close(both["labels"], alone["labels"])
        else:
            assert both["scores"] is None and both["labels"] is None
        assert both["metrics"]["mAP_class"] == pytest.approx(alone["metrics"]["mAP_class"])


def test_train_set_labels_are_those_of_the_packed_samples(packed: Path) -> None:
    train = open_shards("train", str(packed / URLS), transform=None)
    assert isinstance(train, ShardTrainSet) and len(train) == 90
    source = SyntheticMultiLabel("train", train_size=90)
    assert sorted(map(tuple, train.labels.tolist())) == sorted(map(tuple, source.labels.tolist()))
    # A subset of the shards: the labels of exactly those shards' samples, in shard order.
    subset = open_shards("train", str(packed / "train-{000001..000002}.tar"), transform=None)
    keys = [int(key) for shard in (1, 2) for key, _ in iter_shard(str(packed / f"train-{shard:06d}.tar"))]
    torch.testing.assert_close(subset.labels, source.labels[keys])
    assert subset.label_counts().positives.tolist() == (source.labels[keys] == 1).sum(0).tolist()


def test_openimages_pack_keeps_the_verified_labels(packed_openimages: Path, generated_openimages) -> None:
    _, rows = generated_openimages
    train = open_shards("train", str(packed_openimages / OPENIMAGES_URLS), transform=None)
    stored = SparseLabels.from_bytes((packed_openimages / "train-labels.npz").read_bytes())
    assert stored.fill == -1  # unknown is the most frequent value: the verified labels are what is stored
    keys = [int(k) for s in range(4) for k, _ in iter_shard(str(packed_openimages / f"train-{s:06d}.tar"))]
    torch.testing.assert_close(stored.dense(), torch.tensor(rows["train"])[keys])
    expected = torch.tensor(rows["train"])
    assert train.label_counts().positives.tolist() == (expected == 1).sum(0).tolist()
    assert train.label_counts().negatives.tolist() == (expected == 0).sum(0).tolist()


def test_seeded_augmentation_seeds_the_cpu_generator_only(monkeypatch) -> None:
    from mlcls.data.sampling import seeded_call

    def device_seeding(seed: int) -> None:
        raise AssertionError("a device generator was seeded")

    monkeypatch.setattr(torch.cuda, "manual_seed_all", device_seeding)
    expected = torch.Generator().manual_seed(123)
    drawn = seeded_call(123, torch.rand, 5)
    torch.testing.assert_close(drawn, torch.rand(5, generator=expected))


def tarfile_members(path: Path) -> list[tuple[str, bytes]]:
    """The reference: ``(name, data)`` of the regular files, as tarfile streams them."""
    with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
        return [(member.name, tar.extractfile(member).read()) for member in tar if member.isfile()]


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_files_reads_what_tarfile_reads(tmp_path: Path, tar_format: int) -> None:
    path = tmp_path / "archive.tar"
    rng = np.random.default_rng(0)
    long = tar_format != tarfile.USTAR_FORMAT  # names and link targets only GNU and pax can hold
    names = ["000000001.jpg", "a" * 90 + "/" + "b" * 40 + ".jpg", "é.labels.npy", "c" * (120 if long else 9)]
    with tarfile.open(path, "w", format=tar_format) as tar:
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for k, name in enumerate(names):
            data = rng.integers(0, 256, 700 * k + 3, dtype=np.uint8).tobytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime = (
                len(data),
                time.time(),
            )  # a float mtime: a pax record (webdataset's writer)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link")
        link.type, link.linkname = tarfile.SYMTYPE, "z" * (150 if long else 9)
        tar.addfile(link)
        tar.addfile(tarfile.TarInfo("empty"), io.BytesIO(b""))
    with open(path, "rb") as f:
        members = list(tar_files(f, str(path)))
    assert [name for name, _ in members] == [*names, "empty"]
    assert members == tarfile_members(path)


def test_tar_files_reads_the_packed_shards_as_tarfile_does(packed: Path) -> None:
    for path in sorted(packed.glob("*.tar")):
        with open(path, "rb") as f:
            assert list(tar_files(f, str(path))) == tarfile_members(path)


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["in a member", "before the end block", "in a header"])
def test_a_truncated_shard_is_a_format_error(packed: Path, tmp_path: Path, cut: str) -> None:
    for name in ("classes.json", "manifest.json", labels_file("train"), labels_file("val")):
        shutil.copy(packed / name, tmp_path / name)
    for k in range(4):
        shutil.copy(packed / f"train-{k:06d}.tar", tmp_path / f"train-{k:06d}.tar")
    shard = tmp_path / "train-000003.tar"  # every shard is read in an epoch: this one, last in the file
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    data_end = last.offset_data + last.size
    end = {
        "in a member": data_end - 10,
        "before the end block": -(-data_end // 512) * 512,
        "in a header": last.offset + 100,
    }
    data = shard.read_bytes()
    shard.write_bytes(data[: end[cut]])
    with pytest.raises(
        DatasetFormatError, match=f"train-000003.tar has {end[cut]} bytes, manifest.json records"
    ):
        open_shards("train", str(tmp_path / URLS), transform=None)  # a local shard's size is checked at open
    # Through pipes the size is not known before reading: the reader finds the truncation.
    urls = [f"pipe:cat {tmp_path / f'train-{k:06d}.tar'}" for k in range(4)]
    dataset = open_shards("train", urls, meta=str(tmp_path), transform=None)
    dataset.make_sample = lambda key, fields, seed: (int(key), 0)
    loader = build_train_loader(dataset, 8, 0, 0, 1, 3, torch.device("cpu"), "fast")
    with pytest.raises(DatasetFormatError, match="train-000003.tar is truncated"):
        list(loader)


@pytest.mark.slow
def test_pipe_shards_are_read_to_the_end_of_the_stream(packed: Path) -> None:
    """A pipe: command whose output the reader stopped reading fails (here: exit 3 once the trailing
    300 kB, more than a pipe holds, meet a closed pipe); the shards read through pipes give the same
    batches as the files."""
    urls = [
        f"pipe:(cat {packed / f'train-{k:06d}.tar'}; head -c 300000 /dev/zero) || exit 3" for k in range(4)
    ]
    dataset = open_shards("train", urls, meta=str(packed), transform=None)
    dataset.make_sample = lambda key, fields, seed: (int(key), 0)
    loader = build_train_loader(dataset, 8, 0, 0, 1, 3, torch.device("cpu"), "fast")
    loader.sampler.set_epoch(1)
    assert [keys.tolist() for keys, _ in loader] == shard_keys(packed, 0, 1, 0, epoch=1)


def test_npy_array_reads_what_np_load_reads() -> None:
    arrays = [
        np.array([1, 0, -1, 1], dtype=np.int8),
        np.arange(6, dtype=">f4").reshape(2, 3),
        np.asfortranarray(np.arange(6).reshape(2, 3)),
        np.float64(3.5),
    ]
    for array in arrays:
        buffer = io.BytesIO()
        np.save(buffer, array)
        read = npy_array(buffer.getvalue())
        assert read.dtype == array.dtype and read.shape == array.shape
        np.testing.assert_array_equal(read, array)
        buffer.seek(0)  # the header alone, as the report reads it: what numpy's own parser reads
        version = np.lib.format.read_magic(buffer)
        shape, fortran, dtype = getattr(np.lib.format, f"read_array_header_{version[0]}_0")(buffer)
        assert npy_header(buffer.getvalue()[: buffer.tell()]) == (
            dtype,
            shape,
            "F" if fortran else "C",
            buffer.tell(),
        )
    buffer = io.BytesIO()
    np.save(buffer, np.arange(3))
    for bad in (b"not an array", buffer.getvalue()[:-3]):  # np.load's errors
        with pytest.raises(ValueError):
            npy_array(bad)


def test_torch_only_seeding_leaves_python_and_numpy_alone() -> None:
    import random

    from mlcls.data.sampling import seeded_call

    random.seed(5)
    np.random.seed(6)
    expected_python, expected_numpy = random.random(), np.random.random()
    random.seed(5)
    np.random.seed(6)
    drawn = seeded_call(123, torch.rand, 5, torch_only=True)
    torch.testing.assert_close(drawn, torch.rand(5, generator=torch.Generator().manual_seed(123)))
    assert (random.random(), np.random.random()) == (expected_python, expected_numpy)


def test_a_shard_sample_is_augmented_as_under_full_seeding(packed: Path) -> None:
    """The fast CPU stage draws from torch alone: seeding only torch gives each sample the augmentation
    that seeding torch, numpy and random gives it; the target is the packed labels row."""
    from mlcls.data.pipeline.fast import FastTrainTransform
    from mlcls.data.sampling import sample_seed, seeded_call
    from mlcls.data.shards.reader import iter_shard

    transform = FastTrainTransform(32)
    dataset = open_shards("train", str(packed / URLS), transform=transform)
    source = SyntheticMultiLabel("train", train_size=90)
    for key, fields in list(iter_shard(str(packed / "train-000001.tar")))[:6]:
        seed = sample_seed(3, 2, int(key))
        image, target = dataset.make_sample(key, fields, seed)
        expected = seeded_call(seed, lambda data: transform(transform.decode_bytes(data)), fields["jpg"])
        torch.testing.assert_close(image.pixels, expected.pixels, rtol=0, atol=0)
        torch.testing.assert_close(image.params, expected.params, rtol=0, atol=0)
        assert target.dtype == torch.float32
        torch.testing.assert_close(target, source.labels[int(key)].float())
