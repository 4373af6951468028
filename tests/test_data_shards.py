"""Packed shards: ``mlcls-data pack`` (WebDataset layout, resume, sha256, skipped images) and
``dataset=shards`` (ranks and workers without duplicates, exact resume, pack -> train -> evaluate, equal
evaluation on 1 and 2 gloo processes)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import TINY, compose_config
from data_fixtures import corrupt, write_voc
from PIL import Image, JpegImagePlugin

from mlcls.cli.data import main as data_main
from mlcls.cli.train import run
from mlcls.data import pack as pack_module
from mlcls.data.base import MultiLabelDataset, Sample
from mlcls.data.loader import build_eval_loader
from mlcls.data.pack import encode_jpeg, pack_split, packed_image
from mlcls.data.shard_loader import ShardSchedule, ShardTrainLoader
from mlcls.data.shards import ShardTrainSet, open_shards
from mlcls.data.synthetic import SyntheticMultiLabel

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


def test_pack_writes_webdataset_shards_of_the_resized_images(packed: Path) -> None:
    source = SyntheticMultiLabel("train", train_size=90, canvas_size=64)
    dataset = wds.WebDataset(str(packed / URLS), shardshuffle=False).decode()
    seen = []
    for sample in dataset:
        index = int(sample["__key__"])
        seen.append(index)
        with Image.open(io.BytesIO(sample["jpg"])) as image:
            assert image.size == (48, 48)
        np.testing.assert_array_equal(sample["labels.npy"], source.labels[index].numpy())
        assert_pils_jpeg(sample["jpg"], source.load_image(index).resize((48, 48), Image.Resampling.BILINEAR))
    assert sorted(seen) == list(range(90)) and seen != sorted(seen)  # every sample once, shuffled
    classes = json.loads((packed / "classes.json").read_text())
    assert classes["classes"] == source.classes and classes["dataset"] == "synthetic"
    assert classes["splits"] == {"train": "train", "val": "val"} and classes["max_side"] == 48
    assert (classes["quality"], classes["subsampling"]) == (90, "444")
    manifest = json.loads((packed / "manifest.json").read_text())
    assert [e["samples"] for e in manifest["train"]["shards"]] == [25, 25, 25, 15]
    assert manifest["val"]["samples"] == 30 and manifest["train"]["skipped"] == []
    for entry in manifest["train"]["shards"] + manifest["val"]["shards"]:
        assert entry["sha256"] == hashlib.sha256((packed / entry["name"]).read_bytes()).hexdigest()
    rows = np.load(packed / "train-labels.npy")
    assert rows.dtype == np.int8 and rows.shape == (90, 12)


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
    # Other settings start over.
    assert pack_split(dataset, tmp_path, "train", 30, 48, shuffle=True, progress=False).kept == 0
    again = pack_split(dataset, tmp_path, "train", 30, 48, subsampling="420", shuffle=True, progress=False)
    assert again.kept == 0


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
        super().__init__(None, split="train")
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
    dataset = open_shards("train", str(packed / URLS), transform=None, image_size=48)
    dataset.make_sample = lambda key, fields, seed: (int(key), 0)
    loader = ShardTrainLoader(dataset, 8, workers, rank, world, seed=3, device=torch.device("cpu"))
    loader.sampler.set_epoch(epoch)
    loader.sampler.set_start(start)
    batches = [keys.tolist() for keys, _ in loader]
    assert len(batches) == len(loader)
    return batches


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


def test_set_start_skips_exactly_the_batches_served(packed: Path) -> None:
    full = shard_keys(packed, 1, 2, 2, epoch=4)
    assert shard_keys(packed, 1, 2, 2, epoch=4, start=3 * 8) == full[3:]
    assert shard_keys(packed, 1, 2, 0, epoch=4, start=2 * 8) == shard_keys(packed, 1, 2, 0, epoch=4)[2:]


def test_schedule_blocks_follow_the_dataloader_turns() -> None:
    schedule = ShardSchedule([10, 10, 10], batch_size=2, rank=0, world_size=1, seed=0)
    # 15 batches over 4 workers: 4, 4, 4, 3; after 14 served, worker 3 has none left, workers 0-1 one each.
    assert schedule.worker_blocks(4) == [(0, 4), (4, 4), (8, 4), (12, 3)]
    assert [schedule.consumed(w, 4, 14) for w in range(4)] == [4, 4, 3, 3]


def test_shard_urls_not_in_the_manifest_are_one_line(packed: Path) -> None:
    from mlcls.data import DatasetError

    with pytest.raises(DatasetError, match="is not a train shard"):
        open_shards("train", str(packed / "val-000000.tar"))
    with pytest.raises(DatasetError, match="dataset.meta is needed"):
        open_shards("train", "pipe:cat /x/train-000000.tar")


def test_pack_train_evaluate_on_the_shards(packed: Path, tmp_path: Path) -> None:
    overrides = [o for o in TINY if not o.startswith("dataset")] + [
        "dataset=shards",
        f'dataset.urls="{packed / URLS}"',
        "dataset.image_size=32",
        "dataset.transform=light",
        "optim=adamw",
        "trainer.epochs=1",
        f"trainer.output_dir={tmp_path}",
    ]
    results = run(compose_config(overrides))
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["dataset"]["train_size"] == 90 and on_disk["dataset"]["val_size"] == 30
    assert on_disk["metrics"]["mAP_class"] == pytest.approx(results["metrics"]["mAP_class"])
    assert len(on_disk["per_class_ap"]) == 12


def fixed_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 12))


def evaluate_shards(packed: Path, rank: int, world: int) -> dict:
    from mlcls.data import build_dataset
    from mlcls.engine.evaluate import evaluate_model

    cfg = {
        "_target_": "mlcls.data.shards.open_shards",
        "urls": str(packed / URLS),
        "image_size": 32,
        "transform": "light",
    }
    val_set = build_dataset(cfg, train=False)
    loader = build_eval_loader(val_set, 4, 1, rank, world, torch.device("cpu"))
    evaluation = evaluate_model(fixed_model(), loader, torch.device("cpu"), val_set.classes)
    return {"metrics": evaluation.metrics, "scores": evaluation.scores, "labels": evaluation.labels}


def _evaluate_on_rank(rank: int, packed: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.save(evaluate_shards(Path(packed), rank, 2), Path(out) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_evaluation_is_equal_on_one_and_two_processes(packed: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_evaluate_on_rank, args=(str(packed), port, str(tmp_path)), nprocs=2, join=True)
    alone = evaluate_shards(packed, 0, 1)
    source = SyntheticMultiLabel("val", val_size=30)
    torch.testing.assert_close(alone["labels"], source.labels)  # every sample once, in dataset order
    for rank in range(2):
        both = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        torch.testing.assert_close(both["scores"], alone["scores"])
        torch.testing.assert_close(both["labels"], alone["labels"])
        assert both["metrics"]["mAP_class"] == pytest.approx(alone["metrics"]["mAP_class"])


def test_train_set_labels_are_those_of_the_packed_samples(packed: Path) -> None:
    train = open_shards("train", str(packed / URLS), transform=None)
    assert isinstance(train, ShardTrainSet) and len(train) == 90
    source = SyntheticMultiLabel("train", train_size=90)
    assert sorted(map(tuple, train.labels.tolist())) == sorted(map(tuple, source.labels.tolist()))


def test_seeded_augmentation_seeds_the_cpu_generator_only(monkeypatch) -> None:
    from mlcls.data.loader import seeded_call

    def device_seeding(seed: int) -> None:
        raise AssertionError("a device generator was seeded")

    monkeypatch.setattr(torch.cuda, "manual_seed_all", device_seeding)
    expected = torch.Generator().manual_seed(123)
    drawn = seeded_call(123, torch.rand, 5)
    torch.testing.assert_close(drawn, torch.rand(5, generator=expected))
