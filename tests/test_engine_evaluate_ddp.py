"""Distributed evaluation: 2 gloo processes on an odd-size dataset give exactly the single-process figures,
computed on rank 0 and broadcast to the other rank."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from mlcls.collectives import gather_rank_parts
from mlcls.data.loader import build_eval_loader
from mlcls.engine.evaluate import calibrate_on_main, evaluate
from mlcls.metrics import compute_metrics

WORLD = 2
SIZE = 1001  # odd: shards of 501 and 500 rows
CLASS_NAMES = [f"class{c}" for c in range(12)]


def make_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """bfloat16 logits (as under AMP) with many ties, labels with -1, an empty class and empty samples."""
    generator = torch.Generator().manual_seed(0)
    labels = (torch.rand(SIZE, len(CLASS_NAMES), generator=generator) < 0.2).float()
    labels[:, 0] = 0
    labels[:5] = 0
    logits = (torch.randn(SIZE, len(CLASS_NAMES), generator=generator) + 2 * labels).round(decimals=1)
    labels[torch.rand(SIZE, len(CLASS_NAMES), generator=generator) < 0.05] = -1
    return logits.to(torch.bfloat16), labels


class LookUp(torch.nn.Module):
    """A model scoring sample ``i`` (its input) with ``logits[i]``."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.logits[index]


def _evaluate_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        logits, labels = make_dataset()
        scores = gather_rank_parts(logits[rank::WORLD], SIZE)  # the rows RankSampler gives this rank
        targets = gather_rank_parts(labels[rank::WORLD], SIZE)
        metrics = compute_metrics(scores, targets, CLASS_NAMES, voc11=True)
        # a set smaller than the world: rank 1 has no row, and predict() returns torch.empty(0) for it
        one_row = gather_rank_parts(logits[:1] if rank == 0 else torch.empty(0), 1)
        # the same through the trainer's evaluation: rank 1 scores nothing, its empty labels are int8 too
        one_sample = torch.utils.data.TensorDataset(torch.ones(1, 3), labels[:1].float())
        loader = build_eval_loader(one_sample, 4, 0, rank, WORLD, torch.device("cpu"))
        torch.manual_seed(0)
        model = torch.nn.Linear(3, len(CLASS_NAMES))
        evaluation = evaluate(model, loader, torch.device("cpu"), CLASS_NAMES)
        # the trainer's evaluation of the whole set: a model whose outputs are the logits of its samples
        whole = torch.utils.data.TensorDataset(torch.arange(SIZE), labels)
        loader = build_eval_loader(whole, 64, 0, rank, WORLD, torch.device("cpu"))
        full = evaluate(LookUp(logits), loader, torch.device("cpu"), CLASS_NAMES)
        on_rank0 = gather_rank_parts(logits[rank::WORLD], SIZE, dst=0)
        padded = list(range(SIZE)) + [0]  # DistributedSampler pads to a multiple of the world size
        try:
            gather_rank_parts(logits[padded[rank::WORLD]], SIZE)
            refused = ""
        except ValueError as error:
            refused = str(error)
        result = {
            "scores": scores,
            "targets": targets,
            "metrics": metrics,
            "one_row": one_row,
            "one_sample_labels": evaluation.labels,
            "full": {
                "metrics": full.metrics,
                "scores": full.scores,
                "labels": full.labels,
                "thresholds": calibrate_on_main(full, CLASS_NAMES),
            },
            "on_rank0": on_rank0,
        }
        torch.save({**result, "refused": refused}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_give_the_single_process_figures(tmp_path: Path) -> None:
    run_ranks(_evaluate_on_rank, (str(tmp_path / "rendezvous"), str(tmp_path)), WORLD)
    logits, labels = make_dataset()
    expected = compute_metrics(logits.float(), labels, CLASS_NAMES, voc11=True)
    loader = build_eval_loader(torch.utils.data.TensorDataset(torch.arange(SIZE), labels), 64, 0, 0, 1,
                               torch.device("cpu"))  # fmt: skip
    alone = evaluate(LookUp(logits), loader, torch.device("cpu"), CLASS_NAMES)
    alone_thresholds = calibrate_on_main(alone, CLASS_NAMES)
    assert alone.labels.dtype == torch.int8 and torch.equal(alone.labels, labels.to(torch.int8))
    assert expected["classes_counted"] == len(CLASS_NAMES) - 1
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["scores"].dtype == torch.float32
        assert torch.equal(result["scores"], logits.float())  # each sample once, in dataset order
        assert torch.equal(result["targets"], labels)
        assert json.dumps(result["metrics"], sort_keys=True) == json.dumps(expected, sort_keys=True)
        assert torch.equal(result["one_row"], logits[:1].float())
        if rank == 0:  # the whole set on rank 0 only, labels in int8
            assert torch.equal(result["one_sample_labels"], labels[:1].to(torch.int8))
            assert result["one_sample_labels"].dtype == torch.int8
            assert torch.equal(result["on_rank0"], logits.float())
        else:
            assert result["one_sample_labels"] is None and result["on_rank0"] is None
        full = result["full"]
        assert json.dumps(full["metrics"], sort_keys=True) == json.dumps(alone.metrics, sort_keys=True)
        assert torch.equal(full["thresholds"], alone_thresholds)
        if rank == 0:
            assert torch.equal(full["scores"], logits.float()) and torch.equal(full["labels"], alone.labels)
        else:
            assert full["scores"] is None and full["labels"] is None
        assert "part lengths [501, 501]" in result["refused"]
