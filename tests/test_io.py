"""Atomic writes under trouble: a full disk reported in one line however torch wraps it, the debris of a
killed write swept when the run directory is opened, best.pt consistent with the training checkpoint after a
kill at any write, and the permissions of the file (or of the umask) kept."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY, compose_config, error_on_a_full_disk
from inference_fixtures import trained_run, write_images

import mlcls.engine.checkpoint as checkpoint_module
from mlcls.cli import predict as predict_cli
from mlcls.engine.checkpoint import choose_resume_checkpoint, load_checkpoint
from mlcls.engine.rundir import LOCK_NAME, acquire_run_lock, release_run_lock
from mlcls.engine.trainer import Trainer
from mlcls.io import DiskFullError, atomic_write, atomic_write_bytes

QUICK = ["dataset.train_size=64", "dataset.val_size=20"]


# ---------------------------------------------------------------------------------------------- disk full
@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EDQUOT])
@pytest.mark.parametrize("link", ["bare", "__context__", "__cause__"])
def test_a_full_disk_is_found_through_the_exception_chain(tmp_path, error_number, link):
    """The OSError raised as it is, or two links away in the chain that torch's save raises."""
    full = OSError(error_number, os.strerror(error_number))
    outer: BaseException = full
    if link != "bare":
        wrapper = RuntimeError("unexpected pos 1472 vs 1362")
        setattr(wrapper, link, full)
        outer = ValueError("while saving")  # two links away
        outer.__context__ = wrapper

    def fail(f):
        f.write(b"partial")
        raise outer

    (tmp_path / "model.pt").write_bytes(b"previous")
    with pytest.raises(DiskFullError, match=r"cannot write .*model.pt: no space left .* MiB free"):
        atomic_write(tmp_path / "model.pt", fail)
    assert (tmp_path / "model.pt").read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_an_error_without_a_full_disk_in_its_chain_is_raised_as_it_is(tmp_path):
    wrapper = RuntimeError("unexpected pos 1472 vs 1362")
    wrapper.__context__ = OSError(errno.EIO, "Input/output error")

    def fail(f):
        raise wrapper

    with pytest.raises(RuntimeError, match="unexpected pos") as caught:
        atomic_write(tmp_path / "model.pt", fail)
    assert caught.value is wrapper


@pytest.mark.slow
def test_a_full_disk_under_torch_save_ends_training_with_one_line(tmp_path, monkeypatch, capsys):
    """The disk fills during epoch 2's save, the OSError only the context of torch's error: one line naming
    the file and the space left, the last good checkpoint kept, no temporary file and no run lock left (a
    bare OSError, the unwrapped case, is test_a_full_disk_is_found_through_the_exception_chain's)."""
    from mlcls.cli.errors import user_errors

    trainer = Trainer(compose_config([*TINY, *QUICK]), run_dir=tmp_path)
    real_save = torch.save

    def save_until_epoch_two(state, f, *args, **kwargs):
        if state.get("epoch") == 2:
            f.write(b"partial")
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:  # as torch raises it: the OSError only its __context__
                raise RuntimeError("unexpected pos 1472 vs 1362")  # noqa: B904
        real_save(state, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save_until_epoch_two)
    with pytest.raises(SystemExit) as exit_info, user_errors():
        trainer.fit()
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mlcls: error: cannot write {tmp_path / 'checkpoints'}")
    assert "no space left on the device" in lines[0] and "MiB free in" in lines[0]
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["epoch"] == 1
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    assert leftovers == [] and not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow
def test_predict_out_on_a_full_disk_is_one_line(tmp_path, tmp_path_factory, monkeypatch, capsys):
    run_dir = trained_run(tmp_path_factory)
    folder = tmp_path / "photos"
    write_images(folder, count=2)
    out = tmp_path / "predictions.jsonl"
    monkeypatch.chdir(tmp_path)
    argv = [
        "mlcls-predict",
        f"checkpoint={run_dir / 'plain.pt'}",
        f"images={folder}",
        f"out={out}",
        "workers=0",
    ]
    line = error_on_a_full_disk(predict_cli.main, argv, monkeypatch, capsys)
    assert line.startswith(f"mlcls: error: cannot write {out}: no space left on the")
    assert not out.exists()
    assert list(tmp_path.glob(".predictions.jsonl.*")) == []


# ------------------------------------------------------------------------------------------------- debris
KILLED_WRITER = """
import sys, time
from pathlib import Path
from mlcls.io import atomic_write

def write(f):
    f.write(b"x" * 4096)
    f.flush()
    print("writing", flush=True)
    time.sleep(60)

atomic_write(Path(sys.argv[1]), write)
"""


def _kill_mid_write(path) -> None:
    """Start a process writing ``path`` with :func:`atomic_write` and kill it (SIGKILL) mid-write."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "writing"
    finally:
        process.kill()
        process.wait(timeout=10)


@pytest.mark.slow
def test_the_debris_of_killed_writes_is_swept_when_the_run_directory_is_opened(tmp_path):
    run_dir = tmp_path / "run"
    for path in (run_dir / "checkpoints" / "iter_000000003.pt", run_dir / "results.json"):
        _kill_mid_write(path)
    (run_dir / "plots").mkdir()
    (run_dir / "checkpoints" / ".last.pt.link.tmp").write_bytes(b"link")
    (run_dir / "plots" / ".pr_curves.png.k2j4x9_a.tmp").write_bytes(b"png")
    debris = sorted(p for p in run_dir.rglob(".*.tmp"))
    assert len(debris) == 4 and all(p.stat().st_size for p in debris)
    kept = [
        run_dir / "notes.tmp",
        run_dir / ".hidden",
        run_dir / "checkpoints" / "iter_000000002.pt",
        run_dir / "tb" / ".events.abcdefgh.tmp",  # not a folder mlcls writes with atomic_write
    ]
    for path in kept:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"keep")

    acquire_run_lock(run_dir)
    try:
        assert [p for p in debris if p.exists()] == []
        assert all(p.read_bytes() == b"keep" for p in kept)
    finally:
        release_run_lock(run_dir)


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs but the clean-up of ``finally`` blocks."""


@pytest.mark.parametrize("kill_at", [1, 2, 3])
@pytest.mark.slow
def test_a_kill_at_any_checkpoint_write_leaves_best_pt_of_the_best_the_run_records(
    tmp_path, monkeypatch, kill_at
):
    """The newest training checkpoint (what resume=auto loads) names a best epoch: best.pt exists and holds
    that epoch, whichever write of the run a kill interrupts."""
    trainer = Trainer(compose_config([*TINY, *QUICK]), run_dir=tmp_path)
    real_save, calls = torch.save, []  # the epoch of each state written

    def killed_save(state, f, *args, **kwargs):
        calls.append(state.get("epoch"))
        if len(calls) == kill_at:
            f.write(b"partial")
            raise _Killed
        real_save(state, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", killed_save)
    with pytest.raises(_Killed):
        trainer.fit()
    monkeypatch.undo()
    checkpoints = tmp_path / "checkpoints"
    resume_from, chosen = choose_resume_checkpoint("auto", checkpoints)
    best_recorded = None if chosen is None else chosen["best"]
    if best_recorded is not None:
        assert (checkpoints / "best.pt").is_file(), (
            f"{resume_from} records best epoch {best_recorded['epoch']}"
        )
        assert load_checkpoint(checkpoints / "best.pt")["epoch"] == best_recorded["epoch"]
    assert (checkpoints / "best.pt").is_file() == (kill_at > 1)  # the first write of a run is its best.pt


# ------------------------------------------------------------------------------------------------ modes
@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_gets_the_mode_of_the_umask(tmp_path, umask_027):
    atomic_write_bytes(tmp_path / "new.json", b"{}")
    (tmp_path / "reference").write_bytes(b"{}")  # what open() gives under the same umask
    assert _mode(tmp_path / "new.json") == _mode(tmp_path / "reference") == 0o640


@pytest.mark.parametrize("mode", [0o600, 0o664])
def test_a_replaced_file_keeps_its_mode(tmp_path, umask_027, mode):
    path = tmp_path / "results.json"
    path.write_bytes(b"old")
    path.chmod(mode)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and _mode(path) == mode


@pytest.mark.parametrize("special", [0o6000, 0o4000, 0o2000, 0o1000])
@pytest.mark.parametrize("through_a_symlink", [True, False])
def test_a_replaced_file_keeps_its_permission_bits_never_the_special_ones(
    tmp_path, special, through_a_symlink
):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"old")
    target.chmod(special | 0o755)
    assert _mode(target) == special | 0o755  # the file system took the special bits
    path = tmp_path / "results.json"
    if through_a_symlink:
        path.symlink_to(target)
    else:
        path = target
    atomic_write_bytes(path, b"new")
    assert not path.is_symlink() and path.read_bytes() == b"new"
    assert _mode(path) == 0o755  # setuid, setgid and sticky dropped; rwxr-xr-x kept
