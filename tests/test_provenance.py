"""mlcls.provenance: what results.json records about where a number comes from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from conftest import compose_config
from omegaconf import OmegaConf

from mlcls.provenance import collect_provenance, git_state

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True
    )


def make_checkout(root: Path) -> Path:
    """A git repository holding a package ``mlcls`` with one commit; returns the package directory."""
    package = root / "mlcls"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    return package


@pytest.mark.slow
def test_provenance_does_not_import_the_tables():
    """The trainer imports provenance; the table specs and their renderer stay out of it."""
    code = "import sys, mlcls.provenance; print(*sorted(m for m in sys.modules if 'reporting' in m))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == []  # nothing of mlcls.reporting


def test_provenance_of_a_run():
    cfg = compose_config(["experiment=paper_twoway", "dataset=coco", "++protocol.bucket_size=64"])
    record = collect_provenance(
        cfg,
        world_size=2,
        device=torch.device("cpu"),
        train_size=82081,
        val_size=40137,
        wall_time_s=12.5,
        images_per_s=400.0,
    )
    json.dumps(record)  # results.json must be able to hold it
    assert record["config"] == OmegaConf.to_container(cfg, resolve=True)
    assert record["config"]["loss"]["bucket_size"] == 64  # interpolation resolved
    assert record["world_size"] == 2
    assert record["bucket_size"] == 64 and record["effective_bucket_size"] == 64
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["timm"] == timm.__version__
    assert record["versions"]["cuda"] == torch.version.cuda
    assert record["device"] == {"type": "cpu", "gpu_name": None}
    assert record["dataset"] == {"train_size": 82081, "val_size": 40137}
    assert record["wall_time_s"] == 12.5 and record["images_per_s"] == 400.0
    assert set(record["git"]) == {"commit", "dirty"}


def test_provenance_bucket_size_of_losses_without_buckets():
    cfg = compose_config(["experiment=paper_bce", "dataset=coco"])
    record = collect_provenance(cfg, 4, torch.device("cpu"), 10, 5, 1.0, 1.0)
    assert record["bucket_size"] is None and record["effective_bucket_size"] is None
    cfg = compose_config(["loss=twoway", "trainer.batch_size=512"])  # bucket_size null: the per-process batch
    assert collect_provenance(cfg, 4, torch.device("cpu"), 10, 5, 1.0, 1.0)["effective_bucket_size"] == 128


@needs_git
def test_git_state_commit_and_dirty(tmp_path):
    package = make_checkout(tmp_path)
    branch_ref = (tmp_path / ".git" / "HEAD").read_text().split()[1]
    commit = (tmp_path / ".git" / branch_ref).read_text().strip()
    assert git_state(package) == {"commit": commit, "dirty": False}

    (package / "__init__.py").write_text("x = 2\n")
    assert git_state(package) == {"commit": commit, "dirty": True}
    git(tmp_path, "checkout", "--", ".")
    (package / "new_loss.py").write_text("")  # untracked source: the commit alone is not the code
    assert git_state(package)["dirty"] is True


@needs_git
def test_git_state_outside_a_checkout(tmp_path):
    package = tmp_path / "site-packages" / "mlcls"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert git_state(package) == {"commit": None, "dirty": None}
    # A repository that merely encloses an installed package is not the package's checkout.
    enclosing = tmp_path / "project"
    make_checkout(enclosing)
    installed = enclosing / "venv" / "lib" / "mlcls"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    assert git_state(installed) == {"commit": None, "dirty": None}
