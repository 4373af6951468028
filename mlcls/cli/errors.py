"""Turn user mistakes into one line on stderr and exit code 2, instead of a stack trace."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mlcls.data.datasets.base import DatasetError
from mlcls.engine.rundir import RunDirLocked
from mlcls.engine.state import CheckpointError
from mlcls.errors import ConfigError, InferenceError, failure
from mlcls.io import DiskFullError, FileTooLargeError, NotRegularFileError, UnsafeFileError

USER_ERRORS = (
    DatasetError,
    CheckpointError,
    ConfigError,
    InferenceError,
    OmegaConfBaseException,
    DiskFullError,
    NotRegularFileError,
    FileTooLargeError,
    UnsafeFileError,
    RunDirLocked,
)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Exit with status 2 and ``mlcls: error: <message>`` for the errors a user can fix."""
    try:
        yield
    except (HydraException, *USER_ERRORS) as exc:
        sys.exit(failure("mlcls", error_line(exc)))


def error_line(exc: BaseException) -> str:
    """The one line that says what went wrong in ``exc``: a user error inside a ``_target_`` Hydra called
    unwrapped; OmegaConf's first line (without its ``full_key`` lines); else the last line (a DataLoader
    worker's error comes with its traceback); Hydra's own errors by :func:`one_line`."""
    if isinstance(exc, InstantiationException) and isinstance(exc.__cause__, USER_ERRORS):
        return error_line(exc.__cause__)
    if isinstance(exc, HydraException):
        return one_line(exc)
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] if isinstance(exc, OmegaConfBaseException) else lines[-1]


def one_line(exc: Exception) -> str:
    """The message of ``exc`` on one line (Hydra's lists of options folded, its search path dropped)."""
    lines = [line.strip() for line in str(exc).split("Config search path")[0].splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] + (f" ({' '.join(lines[1:])})" if len(lines) > 1 else "")


def require_keys(cfg: DictConfig, usage: str) -> None:
    """Raise :class:`ConfigError` naming the required keys of ``cfg`` not given, with the ``usage``."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        keys = " and ".join(f"{key}=…" for key in missing)
        raise ConfigError(f"missing {keys} (required); usage: {usage}")
