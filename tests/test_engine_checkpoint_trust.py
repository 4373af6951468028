"""Checkpoints are data, not code: plain contents loaded with weights_only=True, pickles and ``_target_``s
from files refused with one line, old files re-saved or trusted explicitly."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_RESNET10T as TINY
from conftest import compose_config
from hydra.errors import InstantiationException
from omegaconf import OmegaConf
from PIL import Image
from test_engine_checkpoint_fuzz import CountingServer, stored_shards_config

from mlcls.cli.data import main as data_main
from mlcls.cli.errors import error_line
from mlcls.cli.eval import checkpoint_metrics
from mlcls.cli.predict import run as predict_run
from mlcls.cli.train import run as train_run
from mlcls.data import DatasetConfigError, DatasetFormatError, DatasetLayoutError
from mlcls.data.datasets.base import load_json
from mlcls.data.shards.datasets import open_shards
from mlcls.engine.checkpoint import UntrustedCheckpointError, load_checkpoint, save_checkpoint
from mlcls.engine.rundir import LOCK_NAME
from mlcls.engine.state import rng_state, set_rng_state
from mlcls.engine.trainer import Trainer
from mlcls.errors import ConfigError, InferenceError
from mlcls.formats import FORMAT
from mlcls.inference.export import export_checkpoint
from mlcls.inference.predictor import load_inference_model
from mlcls.io import NotRegularFileError, open_regular, read_regular_bytes

# 64 training images in batches of 32, one epoch: a checkpoint in a few seconds.
QUICK = ["dataset.train_size=64", "dataset.val_size=20", "trainer.epochs=1"]


def write_marker(path: str, **ignored) -> None:
    """What a hostile ``_target_`` would do: write a file."""
    Path(path).write_text("ran")


class _OpensMarker:
    """Unpickled, creates the file ``marker`` (``open(marker, "w")``): a pickle that runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The run directory of a one-epoch training run (last.pt, best.pt), shared by the tests here."""
    run_dir = tmp_path_factory.mktemp("trained")
    train_run(compose_config([*TINY, *QUICK, "trainer.ema_decay=0.9"]), run_dir=run_dir)
    return run_dir


@pytest.mark.slow
def test_training_checkpoints_hold_plain_data_only(trained):
    for name in ("last.pt", "best.pt"):
        state = torch.load(trained / "checkpoints" / name, weights_only=True)  # raises on any pickled object
        assert state["classes"][0] == "red_circle"
    rng = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)["rng"][0]
    assert rng["numpy"][0] == "MT19937" and rng["numpy"][1].dtype == torch.int64


def test_rng_state_round_trips_through_a_plain_checkpoint(tmp_path):
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    save_checkpoint({"model": {}, "rng": rng_state()}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.random(4), torch.rand(4))
    set_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    assert random.random() == expected[0]
    assert np.array_equal(np.random.random(4), expected[1])
    assert torch.equal(torch.rand(4), expected[2])


def _evil_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"format": FORMAT, "model": {}, "classes": ["a"], "payload": _OpensMarker(marker)}, path)
    return path


@pytest.mark.slow
def test_a_pickle_that_runs_code_is_refused_everywhere_with_one_line(tmp_path, trained):
    marker = tmp_path / "marker"
    evil = _evil_checkpoint(tmp_path / "evil.pt", marker)
    with pytest.raises(UntrustedCheckpointError) as caught:
        load_checkpoint(evil)
    line = error_line(caught.value)
    assert "\n" not in str(caught.value) and line == str(caught.value)
    assert "open object" in line and "trust_checkpoint=true" in line
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.jpg")
    predict_cfg = compose_config([f"checkpoint={evil}", f"images={tmp_path}"], config_name="predict")
    eval_cfg = compose_config([f"checkpoint={evil}", "device=cpu"], config_name="eval")
    for attempt in (
        lambda: predict_run(predict_cfg),
        lambda: checkpoint_metrics(eval_cfg),
        lambda: export_checkpoint(evil, "torchscript", tmp_path / "out.pt"),
    ):
        with pytest.raises(UntrustedCheckpointError, match="evil.pt holds a"):
            attempt()
    assert not marker.exists()

    # resume=auto finds it as last.pt of the run directory: refused, not skipped for an older one
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    _evil_checkpoint(run_dir / "checkpoints" / "last.pt", marker)
    with pytest.raises(UntrustedCheckpointError, match="last.pt holds a"):
        Trainer(compose_config([*TINY, *QUICK, "trainer.resume=auto"]), run_dir=run_dir)
    assert not marker.exists()
    # the failed start releases the run directory and keeps its checkpoint
    assert not (run_dir / LOCK_NAME).exists() and (run_dir / "checkpoints" / "last.pt").is_file()

    load_checkpoint(evil, trust=True)  # trusting a file unpickles it as it is
    assert marker.exists()


def _checkpoint_with_config(path: Path, trained: Path, section: str, value: dict) -> Path:
    state = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)
    state["config"][section] = value
    torch.save(state, path)
    return path


@pytest.mark.slow
def test_a_model_target_from_a_file_is_never_called(tmp_path, trained):
    marker = tmp_path / "marker"
    hostile = {"_target_": "test_engine_checkpoint_trust.write_marker", "path": str(marker)}
    path = _checkpoint_with_config(tmp_path / "target.pt", trained, "model", hostile)
    with pytest.raises(InferenceError, match="model._target_ is 'test_engine_checkpoint_trust.write_marker'"):
        load_inference_model(path, device="cpu")
    assert not marker.exists()

    head = {"name": "linear", "drop_rate": 0.0, "warmup_epochs": 0}
    fields = {"_target_": "mlcls.models.create_model", "name": "resnet10t", "pretrained": True, "head": head}
    fields |= {"path": "x"}
    path = _checkpoint_with_config(tmp_path / "fields.pt", trained, "model", fields)
    with pytest.raises(InferenceError, match=r"has path, which mlcls.models.create_model does not take"):
        load_inference_model(path, device="cpu")

    # the run's own fields build the model with create_model, pretrained or not: nothing downloaded
    fields.pop("path")
    path = _checkpoint_with_config(tmp_path / "good.pt", trained, "model", fields)
    inference = load_inference_model(path, device="cpu")
    expected = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)["model"]
    assert all(torch.equal(v, expected[k]) for k, v in inference.model.state_dict().items())


@pytest.mark.slow
def test_a_dataset_target_from_a_file_is_not_called_by_eval(tmp_path, trained):
    marker = tmp_path / "marker"
    stored = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)["config"]["dataset"]
    hostile = {**stored, "_target_": "test_engine_checkpoint_trust.write_marker", "path": str(marker)}
    path = _checkpoint_with_config(tmp_path / "target.pt", trained, "dataset", hostile)
    cfg = compose_config([f"checkpoint={path}", "device=cpu"], config_name="eval")
    with pytest.raises(ConfigError, match="dataset._target_='test_engine_checkpoint_trust.write_marker'"):
        checkpoint_metrics(cfg)
    assert not marker.exists()

    nested = {
        **stored,
        "transform": {"_target_": "test_engine_checkpoint_trust.write_marker", "path": str(marker)},
    }
    path = _checkpoint_with_config(tmp_path / "nested.pt", trained, "dataset", nested)
    cfg = compose_config([f"checkpoint={path}", "device=cpu"], config_name="eval")
    with pytest.raises(ConfigError, match=r"dataset.transform._target_ is set"):
        checkpoint_metrics(cfg)
    assert not marker.exists()


@pytest.mark.slow
def test_a_checkpoint_with_an_ndarray_is_refused_unless_trusted(tmp_path, trained):
    # NumPy's random state as it comes, with an ndarray inside: no plain data
    state = torch.load(trained / "checkpoints" / "last.pt", weights_only=True)
    state["rng"] = [{**state["rng"][0], "numpy": np.random.get_state()}]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    with pytest.raises(UntrustedCheckpointError, match=r"holds a numpy\S+ object.*trust_checkpoint=true"):
        load_checkpoint(old)
    assert load_checkpoint(old, trust=True)["rng"][0]["numpy"][1].dtype == np.uint32


# ----------------------------------------------------------------------------------- shard sources (issue 28)
def _eval_with_dataset(tmp_path: Path, trained: Path, dataset: dict, *argv: str) -> Any:
    path = _checkpoint_with_config(tmp_path / "shards.pt", trained, "dataset", dataset)
    return checkpoint_metrics(compose_config([f"checkpoint={path}", "device=cpu", *argv], config_name="eval"))


@pytest.fixture()
def server():
    counting = CountingServer()
    yield counting
    counting.close()


@pytest.fixture(scope="module")
def packed_synthetic(tmp_path_factory) -> Path:
    """A packed synthetic dataset (the classes of the ``trained`` run): 40 train and 20 val samples."""
    out = tmp_path_factory.mktemp("packed")
    argv = [
        "pack",
        "dataset.train_size=40",
        "dataset.val_size=20",
        f"out={out}",
        "shard_size=20",
        "max_side=32",
    ]
    assert data_main(argv) == 0
    return out


@pytest.mark.slow
def test_a_pipe_shard_source_in_a_checkpoint_is_refused_with_one_line(tmp_path, trained, packed_synthetic):
    """Item 1: a checkpoint (plain data) whose dataset config reads shards through ``pipe:`` ran the command
    in mlcls-eval; now a checkpoint's shard sources are local files only."""
    marker = tmp_path / "marker"
    for key, value in [("meta", f"pipe:touch {marker} #"), ("val_urls", f"pipe:touch {marker} #x.tar")]:
        with pytest.raises(ConfigError, match=rf"dataset.{key} reads 'pipe:touch .*not a local file") as info:
            _eval_with_dataset(tmp_path, trained, stored_shards_config(**{key: value}))
        assert "\n" not in error_line(info.value)
        assert not marker.exists()
    # the user's own dataset.* on the command line is theirs to choose; so is a checkpoint's local folder
    stored = stored_shards_config(meta=f"pipe:touch {marker} #")
    metrics = _eval_with_dataset(tmp_path, trained, stored, f"++dataset.meta={packed_synthetic}")
    assert metrics["num_samples"] == 20 and not marker.exists()
    metrics = _eval_with_dataset(tmp_path, trained, stored_shards_config(root=str(packed_synthetic)))
    assert metrics["num_samples"] == 20


@contextlib.contextmanager
def within(seconds: int):
    """Fail, instead of hanging the suite, if the block takes longer than ``seconds``."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow
def test_a_device_or_pipe_named_as_a_data_file_is_one_line_at_once(tmp_path, trained):
    """A checkpoint's dataset config naming /dev/zero (never ends), a pipe or /dev/stdin (blocks) where a
    CSV, a manifest or an annotation file is read: one line, at once, for mlcls-eval."""
    fifo = tmp_path / "labels.csv"
    os.mkfifo(fifo)
    csv_config = OmegaConf.to_container(compose_config(["dataset=csv"]).dataset)
    for path, kind in [("/dev/zero", "a character device"), (str(fifo), "a pipe (FIFO)")]:
        with within(20), pytest.raises(InstantiationException) as info:  # the dataset's constructor raised
            _eval_with_dataset(tmp_path, trained, {**csv_config, "root": str(tmp_path), "train_file": path})
        assert isinstance(info.value.__cause__, NotRegularFileError)
        assert error_line(info.value) == f"{path} is {kind}; expected a regular file"
    packed = tmp_path / "packed"
    packed.mkdir()
    os.mkfifo(packed / "manifest.json")
    with within(20), pytest.raises(DatasetLayoutError) as info:  # read while the source is checked
        _eval_with_dataset(tmp_path, trained, stored_shards_config(root=str(packed)))
    assert error_line(info.value) == f"{packed}/manifest.json is a pipe (FIFO); expected a regular file"
    with within(20), pytest.raises(NotRegularFileError, match="is a folder; expected a regular file"):
        load_json(tmp_path)


def test_open_regular_reads_files_and_links_to_them(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x\r\ny")
    (tmp_path / "link").symlink_to(tmp_path / "a.txt")
    assert read_regular_bytes(tmp_path / "link", 16) == b"x\r\ny"
    with open_regular(tmp_path / "a.txt", "r", newline="") as f:
        assert f.read() == "x\r\ny"
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")
    with pytest.raises(ValueError, match="open_regular reads files; mode 'w' writes"):
        open_regular(tmp_path / "a.txt", "w")


@pytest.mark.slow
def test_a_stored_interpolation_is_refused_before_anything_resolves(tmp_path, trained, server, monkeypatch):
    """Items 2 and 4: the refused ``os.system`` target was reported only after every value had been
    resolved (running the ``pipe:`` meta, or sending ``${oc.env:…}`` to a server); now never resolved."""
    marker = tmp_path / "marker"
    monkeypatch.setenv("MLCLS_TEST_SECRET", "s3cr3t")
    hostile = [
        {
            "_target_": "os.system",
            "image_size": "${shards_source:image_size,64}",
            "meta": f"pipe:touch {marker} #",
        },
        stored_shards_config(meta=f"{server.url}/" + "${oc.env:MLCLS_TEST_SECRET}"),
        stored_shards_config(image_size="${shards_source:image_size,32}", meta=f"{server.url}/m"),
        stored_shards_config(transform={"kind": "${oc.env:MLCLS_TEST_SECRET}"}),
    ]
    for dataset in hostile:
        with pytest.raises(
            ConfigError, match=r"an interpolation; a config read from a file is never resolved"
        ):
            _eval_with_dataset(tmp_path, trained, dataset)
    assert not marker.exists() and server.requests == 0
    with pytest.raises(ConfigError, match=r"dataset.meta reads 'http://127.0.0.1:\d+/m', not a local file"):
        _eval_with_dataset(tmp_path, trained, stored_shards_config(meta=f"{server.url}/m"))
    assert server.requests == 0


@pytest.mark.slow
def test_the_checked_config_is_the_one_built(tmp_path, trained, server, monkeypatch):
    """Item 3: the check and the build resolved the stored config separately (nine nested meta URLs overflowed
    the resolver's cache, so a server could answer one thing to each); now one plain object, never resolved,
    is checked and built."""
    import mlcls.cli.eval as eval_module

    seen: dict[str, Any] = {}
    check, build = eval_module.check_dataset_target, eval_module.build_dataset
    monkeypatch.setattr(
        eval_module, "check_dataset_target", lambda cfg: (seen.setdefault("checked", cfg), check(cfg))
    )
    monkeypatch.setattr(
        eval_module, "build_dataset", lambda cfg, train: (seen.setdefault("built", cfg), build(cfg, train))[1]
    )
    stored = torch.load(trained / "checkpoints" / "best.pt", weights_only=True)["config"]["dataset"]
    _eval_with_dataset(tmp_path, trained, stored)
    assert seen["built"] is seen["checked"] and isinstance(seen["built"], dict)

    nested = "${shards_source:image_size,32}"
    for _level in range(9):
        nested = "${shards_source:image_size," + nested + "}"
    with pytest.raises(ConfigError, match="an interpolation"):
        _eval_with_dataset(tmp_path, trained, stored_shards_config(image_size=nested, meta=f"{server.url}/m"))
    assert server.requests == 0


def _pack_with_names(packed: Path, out: Path, names: dict[str, str]) -> Path:
    """A copy of ``packed`` whose shards ``names`` maps are renamed (file and manifest)."""
    shutil.copytree(packed, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for role in ("train", "val"):
        for entry in manifest[role]["shards"]:
            if entry["name"] in names:
                new = names[entry["name"]]
                (out / entry["name"]).rename(out / new.replace("/", "_"))
                entry["name"] = new
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.slow
def test_manifest_names_never_reach_a_command(tmp_path, packed_synthetic, monkeypatch):
    """Item 5: a val shard named ``$(cmd)val-000000.tar`` ran ``cmd`` when the val URLs were made from the
    user's ``pipe:cat …`` training URLs; names are now plain file names, never written into a command."""
    monkeypatch.chdir(tmp_path)
    name = "$(touch${IFS}pwned)val-000000.tar"  # what the old code ran: cat …/$(touch pwned)val-000000.tar
    evil = _pack_with_names(packed_synthetic, tmp_path / "evil", {"val-000000.tar": name})
    pipe = f"pipe:cat {evil}/train-{{000000..000001}}.tar"
    with pytest.raises(
        DatasetFormatError, match=r"records the val.shards\[0\] name '\$\(touch.*expected a plain"
    ):
        open_shards("val", urls=pipe, meta=str(evil))
    assert not (tmp_path / "pwned").exists()

    # the user's own pipe: URLs work as documented; the val shards are given, not made from manifest names
    pipe = f"pipe:cat {packed_synthetic}/train-{{000000..000001}}.tar"
    with pytest.raises(DatasetConfigError, match=r"dataset.val_urls is needed with pipe: training shards"):
        open_shards("val", urls=pipe, meta=str(packed_synthetic))
    val = open_shards(
        "val", urls=pipe, val_urls=f"pipe:cat {packed_synthetic}/val-000000.tar", meta=str(packed_synthetic)
    )
    train = open_shards("train", urls=pipe, meta=str(packed_synthetic))
    assert len(val) == 20 and len(train) == 40


def test_manifest_names_are_read_from_the_manifests_folder(tmp_path, packed_synthetic, monkeypatch):
    """Item 6: with ``dataset.meta=DIR`` alone, names were opened as raw URLs (``pipe:cmd;#….tar`` ran) and an
    honest pack was looked for in the working directory."""
    monkeypatch.chdir(tmp_path)
    evil = _pack_with_names(
        packed_synthetic, tmp_path / "evil", {"val-000000.tar": "pipe:touch${IFS}pwned;#.tar"}
    )
    with pytest.raises(DatasetFormatError, match=r"records the val.shards\[0\] name 'pipe:touch"):
        open_shards("val", meta=str(evil))
    assert not (tmp_path / "pwned").exists()
    outside = _pack_with_names(
        packed_synthetic, tmp_path / "outside", {"train-000000.tar": "../train-000000.tar"}
    )
    with pytest.raises(DatasetFormatError, match=r"records the train.shards\[0\] name '../train-000000.tar'"):
        open_shards("train", meta=str(outside))

    # an honest pack opened through meta alone, from another directory
    assert len(open_shards("train", meta=str(packed_synthetic))) == 40
    assert len(open_shards("val", meta=str(packed_synthetic))) == 20
