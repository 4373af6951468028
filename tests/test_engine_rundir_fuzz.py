"""A run directory written by someone else: every file mlcls-report and mlcls-tables read from it (and the
run lock mlcls-train reads) is read through mlcls.io's door, bounded in time and memory, and a bad one
stops the command with one line.

The unit tests build their files by hand (fast); the fuzz test mutates one genuine trained run directory
(slow: it trains) and reads each mutation through ``mlcls-report``'s and ``mlcls-tables --runs``'s
``main(argv)`` in-process, under :func:`hostile.bounded`.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, compose_config
from data_fixtures import write_csv
from hostile import bounded, rezip, two_directories

from mlcls.cli.report import main as report_main
from mlcls.cli.tables import main as tables_main
from mlcls.data.datasets.csv_dataset import CSVDataset
from mlcls.engine.rundir import LOCK_NAME, RunDirLocked, acquire_run_lock, release_run_lock
from mlcls.reporting.paper import ReportError
from mlcls.reporting.report import Thumbnails
from mlcls.reporting.report_data import ValPredictions, load_val_predictions
from mlcls.reporting.run_files import read_run

SECONDS = 15


def one_line(outcome, *words: str) -> None:
    """The bounded call stopped cleanly with a one-line error naming each of ``words``. (The checks are
    made on plain values: a failing assert on ``outcome`` itself would print its value, which may be huge.)"""
    escaped, error, message = outcome.escaped, outcome.error, outcome.message
    assert not escaped, (error, message, outcome.trace[-2000:])
    stopped = error is not None and "\n" not in message.strip()
    assert stopped, f"{error}: {message[:2000]}"
    missing = [word for word in words if word not in message]
    assert not missing, f"{missing} not in {message[:2000]!r}"


def alias_bomb() -> str:
    """2.5 kB of YAML whose aliases expand to 10**9 strings (a "billion laughs")."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\ndataset: *a8\nmodel: *a8\nloss: *a8\ntrainer: *a8\n"


def hostile_file(path: Path, kind: str, depth: int) -> None:
    """``path`` made as ``kind``: a fifo, a link to /dev/zero, a folder, a sparse file one byte past the 64
    MiB cap ("too large"), a YAML alias bomb, or else ``depth`` nested brackets ("deep")."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    elif kind == "too large":
        with path.open("wb") as f:  # sparse: no disk used
            f.truncate(64 * 2**20 + 1)
    elif kind == "alias bomb":
        path.write_text(alias_bomb())
    else:
        path.write_text("[" * depth)


def npy_header(shape: tuple[int, ...], dtype: str) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}
    )
    return buffer.getvalue()


def predictions_npz(path: Path, rows: int, cols: int, data_bytes: bool = True, level: int = 1) -> None:
    """A val_predictions.npz of ``rows`` x ``cols`` zeros, its members deflated; ``data_bytes=False``:
    each member holds only its header (a shape the member does not hold)."""
    arrays = {
        "scores": ((rows, cols), "<f4"),
        "labels": ((rows, cols), "|i1"),
        "thresholds": ((cols,), "<f8"),
        "classes": ((cols,), "<U8"),
        "ids": ((rows,), "<U8"),
        "indices": ((rows,), "<i8"),
        "epoch": ((), "<i8"),
    }
    chunk = bytes(2**24)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as archive:
        for name, (shape, dtype) in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                member.write(npy_header(shape, dtype))
                left = int(np.prod(shape)) * np.dtype(dtype).itemsize if data_bytes else 0
                while left > 0:
                    member.write(chunk[: min(left, len(chunk))])
                    left -= len(chunk)


# ------------------------------------------------------------------ results.json and config.yaml


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder", "too large", "deep"])
def test_a_results_json_that_never_ends_is_one_line(tmp_path, kind):
    path = tmp_path / "results.json"
    hostile_file(path, kind, depth=100_000)
    outcome = bounded(read_run, tmp_path, memory_mb=512, seconds=SECONDS)
    one_line(outcome, str(path))
    error = outcome.error
    assert error == "ReportError"


@pytest.mark.slow
def test_a_results_json_that_declares_0_bytes_and_streams_is_one_line_unread(tmp_path):
    """/proc/self/pagemap (st_size 0, about 2^38 bytes) as results.json. Before: read to the 64 MiB cap and
    copied before the refusal, a MemoryError under 48 MB."""
    path = tmp_path / "results.json"
    path.symlink_to("/proc/self/pagemap")
    outcome = bounded(read_run, tmp_path, memory_mb=48, seconds=SECONDS)
    one_line(outcome, str(path), "declares 0 bytes and yet streams")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "alias bomb", "deep"])
def test_a_config_yaml_that_never_ends_or_explodes_is_one_line(tmp_path, kind):
    path = tmp_path / "config.yaml"
    hostile_file(path, kind, depth=20_000)
    if kind == "alias bomb":
        assert path.stat().st_size < 3000
    outcome = bounded(read_run, tmp_path, memory_mb=512, seconds=SECONDS)
    one_line(outcome, str(path))
    error = outcome.error
    assert error == "ReportError"


@pytest.mark.slow
def test_tables_on_an_alias_bomb_and_a_fifo_lists_them_unreadable(tmp_path, capsys):
    """Old: mlcls-tables --runs on the alias bomb ran past its time limit (MemoryError without one)."""
    (tmp_path / "bomb").mkdir()
    (tmp_path / "bomb" / "config.yaml").write_text(alias_bomb())
    (tmp_path / "pipe").mkdir()
    os.mkfifo(tmp_path / "pipe" / "results.json")
    (tmp_path / "pipe" / "config.yaml").write_text("trainer: {epochs: 1}\n")
    outcome = bounded(tables_main, ["--runs", str(tmp_path), "--json"], memory_mb=512, seconds=SECONDS)
    escaped, code = outcome.escaped, outcome.value
    assert not escaped and code == 0, (outcome.error, outcome.message)
    outcome = bounded(tables_main, [str(tmp_path / "bomb")], memory_mb=512, seconds=SECONDS)
    escaped, code = outcome.escaped, outcome.value
    assert not escaped and code == 2, (outcome.error, outcome.message)


@pytest.mark.slow  # forks a bounded child
def test_linked_folders_under_a_runs_folder_are_not_walked(tmp_path):
    """A runs folder from someone else may link to a folder above it (a loop) or to the whole file system:
    the search for runs (``mlcls-tables --runs``, ``mlcls-report`` on a folder) follows no folder link, so it
    ends at once, finding the runs that are in the folder itself."""
    from mlcls.reporting.run_files import find_run_dirs

    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "results.json").write_text("{}")
    (tmp_path / "runs" / "a" / "loop").symlink_to(tmp_path / "runs")
    (tmp_path / "runs" / "root").symlink_to("/")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "results.json").write_text("{}")
    (tmp_path / "runs" / "outside").symlink_to(tmp_path / "elsewhere")
    outcome = bounded(lambda: [str(path) for path in find_run_dirs(tmp_path / "runs")], seconds=5)
    assert not outcome.escaped and outcome.error is None, (outcome.error, outcome.message)
    assert outcome.value == [str(tmp_path / "runs" / "a")]


ODD_RESULTS = {  # field: a value of the wrong type, and the words of the one-line refusal
    "metrics": ("high", "metrics is the text"),
    "per_class_ap": ({"cat": [1, 2]}, "per_class_ap cat is a list"),
    "history": (5, "history is 5; expected a list"),
    "best": ("yes", "best is the text"),
    "provenance": ([1], "provenance is a list"),
    "dataset": ("coco", "dataset is the text"),
    "epochs_completed": ("3", "epochs_completed is the text"),
    "world_size": ("many", "world_size is the text"),
}


@pytest.mark.parametrize("field", ODD_RESULTS)
def test_odd_typed_results_fields_are_one_line(tmp_path, field):
    value, words = ODD_RESULTS[field]
    (tmp_path / "results.json").write_text(json.dumps({"metrics": {"mAP_class": 1.0}, field: value}))
    with pytest.raises(ReportError) as caught:
        read_run(tmp_path)
    assert "\n" not in str(caught.value) and words in str(caught.value)


@pytest.mark.parametrize(
    "entry",
    [
        {"metrics": {"mAP_class": "34.6"}},
        {"metrics": {"mAP_class": 10**400}},
        {"best": {"epoch": None}},
        {"history": [{"epoch": 1, "loss": "low"}]},
        {"history": ["x"]},
        {"provenance": {"wall_time_s": "long"}},
    ],
)
def test_numbers_as_text_and_nulls_are_one_line(tmp_path, entry):
    (tmp_path / "results.json").write_text(json.dumps(entry))
    with pytest.raises(ReportError, match=r"expected (a|an) "):
        read_run(tmp_path)


# ------------------------------------------------------------------------------ val_predictions.npz


@pytest.mark.slow
def test_a_deflated_predictions_bomb_is_refused_before_it_is_unpacked(tmp_path):
    """1 MB declaring 200 MB of arrays (old: MemoryError under a 256 MB cap; a 2.9 MB one took +2.7 GB)."""
    predictions_npz(tmp_path / "val_predictions.npz", 4_000, 10_000)
    assert (tmp_path / "val_predictions.npz").stat().st_size < 2**20
    outcome = bounded(load_val_predictions, tmp_path, memory_mb=256, seconds=SECONDS)
    one_line(outcome, "its members declare", "bytes in a file of")


@pytest.mark.slow
def test_a_header_asking_for_more_than_its_member_holds_is_refused(tmp_path):
    """Each member holds only its header, whose shape asks for 400 GB: numpy allocates from the header."""
    predictions_npz(tmp_path / "val_predictions.npz", 1_000_000, 100_000, data_bytes=False)
    outcome = bounded(load_val_predictions, tmp_path, memory_mb=512, seconds=SECONDS)
    one_line(outcome, "header declares shape (1000000, 100000)")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["fifo", "/dev/zero", "not a zip", "object array", "epoch of 3", "encrypted"]
)
def test_odd_predictions_files_are_one_line(tmp_path, kind):
    path = tmp_path / "val_predictions.npz"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "not a zip":
        path.write_bytes(b"\x00" * 100)
    else:
        arrays = {
            "scores": np.zeros((2, 3), np.float32),
            "labels": np.zeros((2, 3), np.int8),
            "thresholds": np.zeros(3),
            "classes": np.array(["a", "b", "c"]),
            "ids": np.array(["x", "y"]),
            "indices": np.arange(2),
            "epoch": np.arange(3) if kind == "epoch of 3" else np.asarray(1),
        }
        if kind == "object array":
            arrays["classes"] = np.array(["a", 1, None], dtype=object)
        np.savez(path, **arrays)
        if kind == "encrypted":  # old: RuntimeError "password required" out of zipfile, a traceback
            data = bytearray(path.read_bytes())
            for signature, flags in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local, central headers
                at = data.find(signature)
                while at >= 0:
                    data[at + flags] |= 1  # bit 0 of the general purpose flags: encrypted
                    at = data.find(signature, at + 4)
            path.write_bytes(bytes(data))
    outcome = bounded(load_val_predictions, tmp_path, memory_mb=512, seconds=SECONDS)
    one_line(outcome, str(path), *(["is encrypted"] if kind == "encrypted" else []))


def test_predictions_are_checked_against_the_runs_counts(tmp_path):
    np.savez(
        tmp_path / "val_predictions.npz",
        scores=np.zeros((2, 3), np.float32),
        labels=np.zeros((2, 3), np.int8),
        thresholds=np.zeros(3),
        classes=np.array(["a", "b", "c"]),
        ids=np.array(["x", "y"]),
        indices=np.arange(2),
        epoch=np.asarray(1),
    )
    assert load_val_predictions(tmp_path, {"num_classes": 3, "val_size": 2}).classes == ["a", "b", "c"]
    with pytest.raises(ReportError, match="3 classes; the run's results.json counts 80"):
        load_val_predictions(tmp_path, {"num_classes": 80})
    with pytest.raises(ReportError, match="2 rows; the run's results.json counts 1 validation images"):
        load_val_predictions(tmp_path, {"val_size": 1})


# ------------------------------------------------------------------------------- validation images


@pytest.mark.slow
def test_a_validation_image_that_is_a_fifo_gets_no_thumbnail(tmp_path):
    """Old: the report blocked on the pipe for good."""
    text = "image,labels\na.jpg,cat\nb.jpg,dog\n"
    root = write_csv(tmp_path, text, name="val.csv", images=["a.jpg", "b.jpg"])
    dataset = CSVDataset(split="val", root=str(root), train_file="val.csv", val_file="val.csv")
    (root / "b.jpg").unlink()
    os.mkfifo(root / "b.jpg")
    rows = len(dataset)
    predictions = ValPredictions(
        scores=np.zeros((rows, 2), np.float32),
        labels=np.zeros((rows, 2), np.int8),
        thresholds=np.zeros(2),
        classes=list(dataset.classes),
        ids=[str(sample.path) for sample in dataset.samples],
        indices=np.arange(rows),
        epoch=1,
    )
    thumbnails = Thumbnails(dataset, predictions)
    start = time.monotonic()
    outcome = bounded(lambda: [thumbnails.key(row) for row in range(rows)], memory_mb=512, seconds=SECONDS)
    took = time.monotonic() - start
    assert took < SECONDS / 3, (
        f"{took:.1f} s: the pipe was waited on (the alarm's TimeoutError is an OSError)"
    )
    escaped, error, keys = outcome.escaped, outcome.error, outcome.value
    assert not escaped and error is None, (error, outcome.message)
    fifo_row = [str(sample.path) for sample in dataset.samples].index(str(root / "b.jpg"))
    assert keys[fifo_row] is None and keys[1 - fifo_row] is not None


# ------------------------------------------------------------------------------------------ the lock


def _take(run_dir: Path) -> str:
    acquire_run_lock(run_dir)
    release_run_lock(run_dir)
    return "taken"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder", "1 MB of ["])
def test_a_lock_that_is_not_a_lock_file_is_refused_in_one_line(tmp_path, kind):
    """Old: a FIFO blocked, /dev/zero read to a MemoryError, 1 MB of "[" raised RecursionError."""
    lock = tmp_path / LOCK_NAME
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "/dev/zero":
        lock.symlink_to("/dev/zero")
    elif kind == "folder":
        lock.mkdir()
    else:
        lock.write_text("[" * 2**20)
    outcome = bounded(_take, tmp_path, memory_mb=512, seconds=SECONDS)
    one_line(outcome, str(lock), "delete it if no run holds the directory")
    error = outcome.error
    assert error == RunDirLocked.__name__


@pytest.mark.slow
def test_a_lock_of_nested_brackets_under_the_cap_is_stale_and_taken_over(tmp_path):
    """Old: RecursionError."""
    (tmp_path / LOCK_NAME).write_text("[" * 60_000)
    outcome = bounded(_take, tmp_path, memory_mb=512, seconds=SECONDS)
    error, value = outcome.error, outcome.value
    assert (error, value) == (None, "taken"), outcome.message


# ------------------------------------------------------------------- the fuzz of a genuine run directory


@pytest.fixture(scope="module")
def genuine_run(tmp_path_factory) -> Path:
    """A finished tiny run (20 validation images, 12 classes), its report written by mlcls-train."""
    from mlcls.cli.train import run

    out = tmp_path_factory.mktemp("run")
    run(
        compose_config(
            [
                *TINY,
                "dataset.train_size=32",
                "dataset.val_size=20",
                "trainer.epochs=1",
                "trainer.report=true",
            ]
        ),
        run_dir=out,
    )
    return out


HOSTILE_VALUES = [
    None,
    True,
    -1,
    10**30,
    1e308,
    float("inf"),
    "34.6",
    "\x1b[31m\x00\r\n=cmd|' /C calc'!A0",
    [],
    {},
    [[[[1]]]],
    {"a": {"b": {"c": [1, "x"]}}},
]


def _paths(node, prefix=()):
    """Every (key path) in a JSON/YAML tree, down to three levels."""
    if len(prefix) >= 3:
        return
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


def _set(node, path, value):
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _never_ending(path: Path, rng: random.Random) -> None:
    path.unlink(missing_ok=True)
    choice = rng.choice(["fifo", "zero", "folder", "declares 0 bytes"])
    if choice == "fifo":
        os.mkfifo(path)
    elif choice == "zero":
        path.symlink_to("/dev/zero")
    elif choice == "declares 0 bytes":
        path.symlink_to("/proc/self/pagemap")  # a regular file of st_size 0 that streams 2^38 bytes
    else:
        path.mkdir()


def mutate(run_dir: Path, rng: random.Random) -> str:
    """One seeded mutation of ``run_dir``; returns what it did."""
    results_path, config_path = run_dir / "results.json", run_dir / "config.yaml"
    results = json.loads(results_path.read_text())
    target = rng.choice(["results", "results", "results", "config", "config", "npz", "npz"])
    if target == "results":
        how = rng.choice(["field", "field", "field", "deep", "never ends", "control"])
        if how == "field":
            path = rng.choice(list(_paths({k: v for k, v in results.items() if k != "provenance"})))
            _set(results, path, rng.choice(HOSTILE_VALUES))
            results_path.write_text(json.dumps(results))
            return f"results.json {'.'.join(map(str, path))}"
        if how == "deep":
            results_path.write_text("[" * rng.randint(2_000, 200_000))
        elif how == "control":
            results_path.write_bytes(b'{"metrics": "\x1b\x00\xff\xfe"}')
        else:
            _never_ending(results_path, rng)
        return f"results.json {how}"
    if target == "config":
        results["provenance"].pop("config", None)  # the report and tables then read config.yaml
        results_path.write_text(json.dumps(results))
        how = rng.choice(["field", "field", "alias bomb", "deep", "never ends"])
        if how == "field":
            import yaml

            config = yaml.safe_load(config_path.read_text())
            path = rng.choice(list(_paths(config)))
            _set(config, path, rng.choice(HOSTILE_VALUES))
            config_path.write_text(json.dumps(config))
            return f"config.yaml {'.'.join(map(str, path))}"
        if how == "alias bomb":
            config_path.write_text(alias_bomb())
        elif how == "deep":
            config_path.write_text("[" * rng.randint(2_000, 200_000))
        else:
            _never_ending(config_path, rng)
        return f"config.yaml {how}"
    npz = run_dir / "val_predictions.npz"
    how = rng.choice(["header lies", "bomb", "never ends", "truncated", "shape", "two directories"])
    if how == "two directories":  # a stored copy of its (deflated) directory just before the end record
        npz.write_bytes(two_directories(rezip(npz.read_bytes(), zipfile.ZIP_DEFLATED)))
    elif how == "header lies":
        predictions_npz(npz, 10**6, rng.randint(10**4, 10**6), data_bytes=False)
    elif how == "bomb":
        predictions_npz(npz, 4_000, 10_000)  # 200 MB in 1 MB
    elif how == "truncated":
        data = npz.read_bytes()
        npz.write_bytes(data[: rng.randint(0, len(data))])
    elif how == "shape":
        with np.load(npz) as saved:
            arrays = {key: saved[key] for key in saved.files}
        key = rng.choice(sorted(arrays))
        arrays[key] = rng.choice([np.zeros(3), np.array(["x"] * 7), np.zeros((2, 2, 2)), np.asarray(5)])
        np.savez(npz, **arrays)
    else:
        _never_ending(npz, rng)
    return f"val_predictions.npz {how}"


def _exit_code(main, argv: list[str]) -> int:
    """``main(argv)``'s return value, or the status it exits with (a user error: one line, status 2)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _report_then_tables(run_dir: str) -> tuple[int, int]:
    return _exit_code(report_main, [run_dir]), _exit_code(tables_main, ["--runs", run_dir])


@pytest.mark.slow
def test_fuzzed_run_directories_render_or_stop_with_one_line(genuine_run, tmp_path, capfd):
    report_main([str(genuine_run)])  # imports and caches in this process: the children start warm
    capfd.readouterr()
    rng = random.Random(35)
    for case in range(24):
        run_dir = tmp_path / str(case)
        shutil.copytree(genuine_run, run_dir, symlinks=True)
        (run_dir / "report.html").unlink()
        what = mutate(run_dir, rng)
        outcome = bounded(_report_then_tables, str(run_dir), memory_mb=1024, seconds=SECONDS)
        err = capfd.readouterr().err
        escaped, error, codes = outcome.escaped, outcome.error, outcome.value
        assert not escaped and error is None, (what, error, outcome.trace[-3000:])
        report_code, tables_code = codes
        assert report_code in (0, 2) and tables_code == 0, (what, codes, err)
        errors = [line for line in err.splitlines() if line.startswith("mlcls: error")]
        assert (report_code == 2) == (len(errors) == 1), (what, err)
        assert "Traceback" not in err, (what, err)
