"""Where a result comes from (results.json's ``"provenance"``): code version, resolved config, software,
hardware, data sizes and speed."""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import mlcls
from mlcls.losses.spec import effective_bucket_size

GIT_TIMEOUT_S = 10


def _git(args: list[str], cwd: Path) -> str | None:
    """stdout of ``git <args>`` run in ``cwd``, or None when git is missing or the command fails."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(package_dir: Path | None = None) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the git checkout holding the mlcls sources; both None when the
    package is not the checkout's own (a wheel inside some repository)."""
    package_dir = Path(package_dir or Path(mlcls.__file__).resolve().parent)
    unknown: dict[str, Any] = {"commit": None, "dirty": None}
    top = _git(["rev-parse", "--show-toplevel"], package_dir)
    if top is None:
        return unknown
    inside = Path(top.strip()) / package_dir.name / "__init__.py"
    if not inside.is_file() or inside.resolve() != (package_dir / "__init__.py").resolve():
        return unknown
    commit = _git(["rev-parse", "HEAD"], package_dir)
    status = _git(["status", "--porcelain"], package_dir)
    if commit is None:  # a repository without any commit yet
        return unknown
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


def collect_provenance(
    cfg: DictConfig,
    world_size: int,
    device: torch.device,
    train_size: int,
    val_size: int,
    wall_time_s: float,
    images_per_s: float,
) -> dict[str, Any]:
    """The provenance block of ``results.json``, JSON-serialisable (``bucket_size`` as configured,
    ``effective_bucket_size`` the M it gives; ``images_per_s`` over all processes; ``written_at`` UTC)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    loss = config.get("loss") or {}
    batch_size = int(config["trainer"]["batch_size"])
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "git": git_state(),
        "config": config,
        "world_size": int(world_size),
        "bucket_size": loss.get("bucket_size"),
        "effective_bucket_size": effective_bucket_size(loss, batch_size, world_size),
        "versions": {  # of the libraries that change numbers
            "python": platform.python_version(),
            "mlcls": mlcls.__version__,
            "torch": torch.__version__,
            **{name: _version(name) for name in ("torchvision", "timm", "hydra", "numpy")},
            "cuda": torch.version.cuda,
            "cudnn": None if cudnn is None else str(cudnn),
        },
        "device": {"type": device.type, "gpu_name": gpu_name},
        "dataset": {"train_size": int(train_size), "val_size": int(val_size)},
        "wall_time_s": float(wall_time_s),
        "images_per_s": float(images_per_s),
        "host": socket.gethostname(),
        "command": list(sys.argv),
        "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
