"""Where a run writes: one directory for every process, held by one run at a time (a lock file naming its
host and process), with the resolved ``config.yaml``; removed again by a run that fails before its first
checkpoint."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from mlcls import collectives
from mlcls.engine import distributed as dist_utils
from mlcls.errors import is_integer
from mlcls.io import (
    CAPS,
    FileTooLargeError,
    NotRegularFileError,
    atomic_write_bytes,
    open_regular,
    read_regular_bytes,
    sweep_temporary_files,
)

log = logging.getLogger("mlcls")

# The lock file of a live run in its run directory: JSON {"host", "pid", "started", "process"}.
LOCK_NAME = ".lock"
# How long a process waits for another judging the same lock (a judgement takes milliseconds).
JUDGE_TIMEOUT_S = 10.0

# The folders of a run directory written atomically into, besides itself.
WRITTEN_SUBDIRS = ("checkpoints", "plots")


class RunDirLocked(RuntimeError):
    """Another live run holds the run directory."""


def hydra_run_dir() -> Path | None:
    """The directory Hydra made for this job (``hydra.run.dir``, or the sweep job's), if Hydra runs it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    # A config composed in Python (hydra.compose) leaves the runtime's directory unset: no job runs.
    output_dir = OmegaConf.select(
        HydraConfig.get(), "runtime.output_dir", default=None, throw_on_missing=False
    )
    return Path(output_dir) if output_dir else None


def resolve_run_dir(given: str | Path | None, hydra_dir: Path | None, is_main: bool, cfg: DictConfig) -> Path:
    """The directory ``given`` in Python (``Trainer(cfg, run_dir=...)``), else Hydra's job directory, else
    ``outputs/<date>/<time>``, as rank 0 chose it (each rank's Hydra reads its own clock); locked, with
    ``checkpoints/`` and ``config.yaml`` in it."""
    chosen = given or hydra_dir or f"outputs/{datetime.now():%Y-%m-%d/%H-%M-%S}"
    run_dir = Path(collectives.broadcast_object(str(chosen))).absolute()
    if hydra_dir is not None and hydra_dir.absolute() != run_dir:
        discard_if_empty(hydra_dir)

    def create_and_lock() -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        acquire_run_lock(run_dir)
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        atomic_write_bytes(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())

    dist_utils.on_main(create_and_lock, is_main)  # a refused lock raises on every rank
    return run_dir


def explicit_hydra_run_dir() -> bool:
    """True when the command line names the job's directory, the same on every relaunch (so
    ``trainer.resume=auto`` knows where to look): ``hydra.run.dir`` for a single run, ``hydra.sweep.dir``
    for a multirun (each job's subdirectory, ``hydra.sweep.subdir``, is a function of the job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False
    hydra_cfg = HydraConfig.get()
    key = "hydra.sweep.dir" if hydra_cfg.mode == RunMode.MULTIRUN else "hydra.run.dir"
    return any(override.lstrip("+~").split("=")[0] == key for override in hydra_cfg.overrides.hydra)


def _parse_holder(content: bytes) -> dict[str, Any]:
    """The holder a lock file's ``content`` names (empty when it is not a JSON object)."""
    try:
        holder = json.loads(content)
    except (ValueError, RecursionError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _is_mine(holder: dict[str, Any]) -> bool:
    return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()


def process_identity(pid: int) -> str | None:
    """``"<boot id>:<start time>"`` of process ``pid`` on this host (Linux ``/proc``; else None): unlike a
    reused process id, the pair names one process for as long as the host exists."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 of proc(5)'s stat, counted after the command name, which may hold spaces and parentheses.
    fields = stat[stat.rfind(")") + 2 :].split()
    return f"{boot_id}:{fields[19]}" if len(fields) > 19 else None


def _holder_alive(holder: dict[str, Any]) -> bool:
    """Whether the run a lock names may still run: its process exists and is the one that wrote the lock,
    or it is on another host (which cannot be checked); this process's own lock is not."""
    if holder.get("host") != socket.gethostname():
        return bool(holder)
    pid = holder.get("pid")
    if not is_integer(pid) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        pass
    written, now = holder.get("process"), process_identity(pid)
    return not (isinstance(written, str) and now is not None and written != now)


def acquire_run_lock(run_dir: Path) -> None:
    """Take ``run_dir``'s lock until :func:`release_run_lock` (or exit), then sweep the temporary files of
    a killed run's writes. A live run's lock is a :class:`RunDirLocked` naming its holder; a stale one is
    taken over with a warning (:func:`_take_over_if_stale`). The lock appears complete in one step (a hard
    link of a written file)."""
    lock = run_dir / LOCK_NAME
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": f"{datetime.now():%Y-%m-%d %H:%M:%S}",
        "process": process_identity(os.getpid()),
    }
    draft = run_dir / f"{LOCK_NAME}.{os.getpid()}.draft"
    draft.write_text(json.dumps(holder) + "\n")
    try:
        while True:
            try:
                os.link(draft, lock)
                break
            except FileExistsError:
                if _take_over_if_stale(lock, draft):
                    break
    finally:
        draft.unlink(missing_ok=True)
    atexit.register(release_run_lock, run_dir)
    for directory in (run_dir, *(run_dir / sub for sub in WRITTEN_SUBDIRS)):
        for debris in sweep_temporary_files(directory):
            log.info("removed %s, left by a write that did not finish", debris)


def _take_over_if_stale(lock: Path, draft: Path) -> bool:
    """Replace ``lock`` by ``draft`` if the run it names is gone; True once done, False when ``lock``
    changed meanwhile (try again); :class:`RunDirLocked` for a live holder. The file is held under
    :class:`filelock.FileLock` while judged, and judged only if still the file opened: of the processes
    that found one stale lock, the first replaces it and the others find the new one, alive."""
    try:
        # one open, without blocking; a pipe, a device or a folder there is refused, and a file over
        # CAPS["lock"] bytes: neither is a lock this module writes
        file = open_regular(lock, "rb", max_bytes=CAPS["lock"], what="lock")
    except FileNotFoundError:
        return False
    except (NotRegularFileError, FileTooLargeError) as exc:
        raise RunDirLocked(
            f"{exc} (the lock of run directory {lock.parent}); delete it if no run holds the directory"
        ) from None
    except OSError as exc:  # another user's lock, say: its run cannot be judged from here
        raise RunDirLocked(
            f"cannot read the lock {lock} ({exc.strerror}); another run may hold the directory: choose "
            "another one, or delete the lock if its run is gone"
        ) from None
    # the lock file stays where it is on release, and no soft lock stands in where flock is missing
    judging = FileLock(lock, timeout=JUDGE_TIMEOUT_S, preserve_lock_file=True, fallback_to_soft=False)
    with file:
        try:
            judging.acquire()
        except Timeout:
            raise RunDirLocked(
                f"the lock {lock} stayed held by another process for {JUDGE_TIMEOUT_S:.0f} s; choose another "
                "run directory, or delete the lock if no run holds it"
            ) from None
        except OSError as exc:  # a file system without flock; the lock replaced by a link or a folder
            raise RunDirLocked(
                f"cannot take over the lock {lock} safely ({exc.strerror}); delete it if its run is gone"
            ) from None
        try:
            try:  # is the file opened still the one at ``lock``?
                if not os.path.samestat(os.stat(lock), os.fstat(file.fileno())):
                    return False
            except FileNotFoundError:
                return False
            other = _parse_holder(file.read(CAPS["lock"]))
            if _holder_alive(other):
                raise RunDirLocked(
                    f"run directory {lock.parent} is in use by another run (pid {other.get('pid')} on "
                    f"{other.get('host')}, started {other.get('started')}); wait for it to end, choose "
                    f"another directory, or delete {lock} if that run is gone"
                )
            if not _is_mine(other):
                log.warning("taking over the stale lock %s of a run that is gone (%s)", lock, other)
            os.replace(draft, lock)
        finally:
            judging.release()
    return True


def release_run_lock(run_dir: Path) -> None:
    """Remove ``run_dir``'s lock if this process holds it."""
    lock = run_dir / LOCK_NAME
    try:
        holder = _parse_holder(read_regular_bytes(lock, CAPS["lock"], "lock"))
    except (OSError, FileTooLargeError):
        return
    if _is_mine(holder):
        lock.unlink(missing_ok=True)


def close_run_dir(run_dir: Path, is_main: bool) -> None:
    """On rank 0, release ``run_dir``'s lock; without a checkpoint, remove what the run wrote and the
    directory if nothing else is left."""
    if not is_main:
        return
    checkpoints = run_dir / "checkpoints"
    if not any(checkpoints.glob("*.pt")):
        (run_dir / "config.yaml").unlink(missing_ok=True)
        shutil.rmtree(run_dir / "tb", ignore_errors=True)
        if checkpoints.is_dir() and not any(checkpoints.iterdir()):
            checkpoints.rmdir()
    release_run_lock(run_dir)
    discard_if_empty(run_dir)


def discard_if_empty(directory: Path | None) -> None:
    """Remove ``directory`` if nothing was written into it, and its parents below the working directory
    left empty (``outputs/<date>``); other ranks may remove the same ones, so a directory gone or no
    longer empty ends the clean-up quietly."""
    if directory is None:
        return
    cwd, current = Path.cwd().absolute(), directory.absolute()
    try:
        if any(current.rglob("*")):
            return
        shutil.rmtree(current)
    except OSError:
        return
    current = current.parent
    while current != cwd and cwd in current.parents:
        try:
            current.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # not empty
            return
        current = current.parent
