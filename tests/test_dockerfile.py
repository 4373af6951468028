"""The Dockerfile's base image against pyproject.toml: its torch must satisfy the torch range, so that
``pip install`` keeps the image's CUDA build instead of downloading another torch from PyPI."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
# pytorch/pytorch:<torch>-cuda<major.minor>-cudnn<major>-<runtime|devel>
BASE_TAG = re.compile(r"pytorch/pytorch:(?P<torch>\d+\.\d+\.\d+)-cuda(?P<cuda>\d+)\.\d+-cudnn\d+-\w+")


def _dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _base_image() -> re.Match[str]:
    (from_line,) = [line for line in _dockerfile_lines() if line.upper().startswith("FROM ")]
    match = BASE_TAG.fullmatch(from_line.split()[1])
    assert match, f"{from_line!r}: expected FROM pytorch/pytorch:<torch>-cuda<X.Y>-cudnn<N>-<flavour>"
    return match


def _requirement(name: str, extra: str | None = None) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["optional-dependencies"][extra] if extra else project["dependencies"]
    (requirement,) = [Requirement(line) for line in lines if Requirement(line).name == name]
    return requirement


def test_the_base_image_torch_is_in_pyprojects_range():
    torch = Version(_base_image()["torch"])
    specifier = _requirement("torch").specifier
    assert specifier.contains(torch), f"the base image has torch {torch}; pyproject wants torch{specifier}"


def test_the_base_image_cuda_matches_the_dali_extra():
    (cuda_major,) = re.findall(r"cuda(\d+)\d$", _requirement("nvidia-dali-cuda120", "dali").name)
    assert _base_image()["cuda"] == cuda_major


def test_pip_keeps_the_image_torch():
    installs = [shlex.split(line) for line in _dockerfile_lines() if "pip install" in line]
    assert installs
    for words in installs:
        assert "--constraint" in words or "-c" in words, f"{shlex.join(words)}: may replace the image's torch"
