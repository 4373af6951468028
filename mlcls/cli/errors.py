"""Turn user mistakes into one line on stderr and exit code 2, instead of a stack trace."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from mlcls.data.base import DatasetError
from mlcls.engine.checkpoint import CheckpointError
from mlcls.engine.validate import ConfigError
from mlcls.inference.errors import InferenceError

USER_ERRORS = (DatasetError, CheckpointError, ConfigError, InferenceError, OmegaConfBaseException)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Exit with status 2 and ``mlcls: error: <message>`` for the errors a user can fix."""
    try:
        yield
    except HydraException as exc:  # a bad override of a command that composes its config itself
        print(f"mlcls: error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except USER_ERRORS as exc:
        # An error raised in a DataLoader worker comes back with the worker's traceback in its message;
        # its last line is the error itself.
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        print(f"mlcls: error: {lines[-1]}", file=sys.stderr)
        sys.exit(2)


def one_line(exc: Exception) -> str:
    """The message of ``exc`` on one line (Hydra's lists of options folded, its search path dropped)."""
    lines = [line.strip() for line in str(exc).split("Config search path")[0].splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] + (f" ({' '.join(lines[1:])})" if len(lines) > 1 else "")
