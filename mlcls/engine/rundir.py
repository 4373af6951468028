"""Where a run writes: one directory for every process, created only once the run can start."""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from mlcls.engine import distributed as dist_utils


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


def resolve_run_dir(output_dir: str | None, hydra_dir: Path | None, is_main: bool) -> Path:
    """``output_dir`` (``trainer.output_dir``), else Hydra's job directory, else ``outputs/<date>/<time>``;
    with ``checkpoints/`` in it.

    Rank 0 decides for every process: each rank's Hydra resolves ``${now:...}`` on its own clock, and a
    directory Hydra made that is not the run's is removed again when empty.
    """
    chosen = output_dir or hydra_dir or f"outputs/{datetime.now():%Y-%m-%d/%H-%M-%S}"
    run_dir = Path(dist_utils.broadcast_object(str(chosen))).absolute()
    if hydra_dir is not None and hydra_dir.absolute() != run_dir:
        discard_if_empty(hydra_dir)
    dist_utils.on_main(lambda: (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True), is_main)
    return run_dir


def discard_if_empty(directory: Path | None) -> None:
    """Remove ``directory`` if nothing was written into it (a run that stopped before it began, or Hydra's
    default directory of a run that writes elsewhere), and its parents below the working directory that
    are left empty (``outputs/<date>``).

    Other processes of the run may be removing the same directories (their Hydra resolved the same time):
    a directory that is gone already, or no longer empty, ends the clean-up without an error.
    """
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
