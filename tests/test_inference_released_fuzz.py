"""Fuzzing released files: seeded mutations of a small genuine CSRA file (its bytes: the pickle, the zip
headers, the stored tensors, a truncation, a deflated member; its content: keys, values, shapes, dtypes,
heads, the wrapping dict, ``idx_to_class``), each fed to ``mlcls-import`` in this process under a memory
cap and a time limit (tests/hostile.py). Each must import, or stop with one line, never escape.

The genuine file holds every key and shape of CSRA's ResNet-101 with 4 heads for COCO's 80 classes, as
``torch.save`` writes it, but all its tensors are views of one stored block of the largest tensor's size
(9 MB instead of 170 MB): ``torch.save`` keeps the sharing, and the importer reads only names and shapes.
"""

from __future__ import annotations

import io
import random
import traceback
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from hostile import Outcome, bounded
from test_inference_released import import_outcome

SEEDS = 16  # mutated files per run (those that import take a second each: a ResNet-101 built on meta)
BATCHES = 2  # bounded children the files are split between
MEMORY_MB = 768  # above what a child has mapped; the genuine file imports within about 100 MB
SECONDS = 25  # per child, on a loaded CI machine


def genuine_csra() -> dict[str, torch.Tensor]:
    """CSRA's ResNet-101 with 4 heads for 80 classes: every released key and shape, every tensor a view of
    one shared random block (BatchNorm counters, int64 scalars, apart)."""
    with torch.device("meta"):
        shapes = {
            key: value.shape
            for key, value in torchvision.models.resnet101().state_dict().items()
            if key[:3] != "fc."
        }
    for head in range(4):
        shapes[f"classifier.multi_head.{head}.head.weight"] = torch.Size((80, 2048, 1, 1))
    block = torch.randn(max(shape.numel() for shape in shapes.values())) * 0.05
    return {
        key: torch.tensor(5) if key.endswith("num_batches_tracked") else block[: shape.numel()].view(shape)
        for key, shape in shapes.items()
    }


def member_spans(data: bytes) -> dict[str, tuple[int, int]]:
    """Where each zip member's stored bytes lie in ``data`` (from its local header), and the central
    directory (``""``)."""
    import io
    import zipfile

    spans = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            at = info.header_offset
            start = at + 30 + int.from_bytes(data[at + 26 : at + 28], "little")
            start += int.from_bytes(data[at + 28 : at + 30], "little")
            spans[info.filename] = (start, start + info.compress_size)
        spans[""] = (archive.start_dir, len(data))
    return spans


def flip(data: bytes, span: tuple[int, int], rng: random.Random, count: int) -> bytes:
    """``data`` with ``count`` bytes in ``span`` set to random values."""
    mutated = bytearray(data)
    for _ in range(count):
        mutated[rng.randrange(*span)] = rng.randrange(256)
    return bytes(mutated)


def deflated(data: bytes, member: str) -> bytes:
    """``data`` with ``member`` deflated, the other members stored as they were."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            kind = zipfile.ZIP_DEFLATED if info.filename == member else zipfile.ZIP_STORED
            target.writestr(info.filename, source.read(info.filename), compress_type=kind)
    return out.getvalue()


ODD_VALUES: list[Any] = [
    None,
    3,
    2.5,
    "weights",
    [1, 2],
    {"a": torch.zeros(1)},
    torch.zeros(0),
    torch.tensor(1.0),
]
ODD_NAMES = ["layer1.x.conv1.weight", "layer3.99999999999.bn1.weight", "layer1.0.conv1.weight.extra", "é", ""]


def content_mutation(state: dict[str, torch.Tensor], rng: random.Random) -> Any:
    """The genuine state dict with one change of its content, or wrapped otherwise."""
    state, key = dict(state), rng.choice(sorted(state))
    kind = rng.randrange(9)
    if kind == 0:
        del state[key]
    elif kind == 1:
        state[rng.choice(ODD_NAMES)] = state.pop(key)
    elif kind == 2:
        state[key] = rng.choice(ODD_VALUES)
    elif kind == 3:
        state[key] = state[key].reshape(-1) if rng.random() < 0.5 else state[key][..., :1]
    elif kind == 4:
        state[key] = state[key].to(rng.choice([torch.int64, torch.bool, torch.float16, torch.complex64]))
    elif kind == 5:
        state[f"classifier.multi_head.{rng.choice([4, 5, 40])}.head.weight"] = torch.zeros(80, 2048, 1, 1)
    elif kind == 6:
        state["classifier.multi_head.0.head.weight"] = torch.zeros(rng.choice([0, 1, 79, 9605]), 2048, 1, 1)
    elif kind == 7:
        tables: list[Any] = [
            {str(i): f"c{i}" for i in range(80)},
            {i: "same" for i in range(80)},
            {i: i for i in range(80)},
            ["c"] * 80,
            {0: "a", "1": "b"},
            {i: "x" * 10_000 for i in range(80)},
        ]
        return {rng.choice(["model", "state_dict"]): state, "idx_to_class": rng.choice(tables)}
    else:
        return rng.choice(
            [[state], {"model": 5}, {"state_dict": {"model": state}}, torch.zeros(3), {1: state}]
        )
    return state


def mutated_file(genuine: bytes, state: dict[str, torch.Tensor], seed: int, path: Path) -> str:
    """Write the mutation of ``seed`` to ``path``; the name of its kind."""
    rng = random.Random(seed)
    spans = member_spans(genuine)
    pickle_span = next(span for name, span in spans.items() if name.endswith("data.pkl"))
    storage = max((span for name, span in spans.items() if "/data/" in name), key=lambda s: s[1] - s[0])
    kind = ["pickle", "headers", "truncated", "stored", "deflated", "content", "content", "content"][seed % 8]
    if kind == "pickle":
        data = flip(genuine, pickle_span, rng, rng.randint(1, 3))
    elif kind == "headers":
        header = rng.choice([spans[""], (0, 64), (pickle_span[1], pickle_span[1] + 64)])
        data = flip(genuine, header, rng, rng.randint(1, 2))
    elif kind == "truncated":
        data = genuine[: rng.randrange(len(genuine))]
    elif kind == "stored":
        data = flip(genuine, storage, rng, 8)
    elif kind == "deflated":
        data = deflated(genuine, rng.choice([name for name in spans if name]))
    else:
        torch.save(content_mutation(state, rng), path)
        return kind
    path.write_bytes(data)
    return kind


def import_each(cases: list[tuple[str, list[str]]]) -> list[tuple[str, Outcome]]:
    """Import each ``(kind, argv)``; the outcome of each, an exception recorded as an escape."""
    outcomes = []
    for kind, argv in cases:
        try:
            code, err = import_outcome(argv)
            outcomes.append((kind, Outcome(value=(code, err), message=err)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the case
            trace = "".join(traceback.format_exception(exc))
            outcomes.append((kind, Outcome(error=type(exc).__name__, message=str(exc)[:500], trace=trace)))
    return outcomes


@pytest.mark.slow  # forks two bounded children
def test_mutated_released_files_import_or_stop_in_one_line(tmp_path):
    torch.manual_seed(0)
    state = genuine_csra()
    torch.save(state, tmp_path / "genuine.pth")
    genuine = (tmp_path / "genuine.pth").read_bytes()
    cases = [("genuine", ["csra", str(tmp_path / "genuine.pth"), f"out={tmp_path / 'genuine.pt'}"])]
    for seed in range(SEEDS):
        source = tmp_path / f"mutated{seed}.pth"
        kind = mutated_file(genuine, state, seed, source)
        lam = ["lam=0.3"] if seed % 2 else []  # past the question for lam, to the heads' check
        cases.append((f"{kind} {seed}", ["csra", str(source), f"out={tmp_path / f'out{seed}.pt'}", *lam]))
    results = []
    for batch in range(BATCHES):
        outcome = bounded(import_each, cases[batch::BATCHES], memory_mb=MEMORY_MB, seconds=SECONDS)
        assert not outcome.escaped and outcome.error is None, (outcome.error, outcome.message, outcome.trace)
        results += outcome.value
    imported = set()
    for kind, outcome in results:
        assert not outcome.escaped and outcome.error is None, (kind, outcome.error, outcome.trace[-2000:])
        code, err = outcome.value
        lines = err.strip().splitlines()
        assert code in (0, 2) and len(lines) == 1, (kind, code, err[-2000:])
        assert lines[0].startswith("mlcls: error: " if code else "mlcls: "), (kind, err)
        if code == 0:
            imported.add(kind)
    assert "genuine" in imported
    refused = {kind.split()[0] for kind, outcome in results if outcome.value[0] == 2}
    assert {"truncated", "deflated", "content"} <= refused  # the mutations reach the checks
