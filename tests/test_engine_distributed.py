"""Multi-node DDP on one machine: two torchrun "nodes" x 1 process (c10d rendezvous, gloo) against 1 process.

With a model without BatchNorm and the two-way loss gathered over the processes (``loss.gather=true``, the
class-wise term on the global batch), DDP over 2 processes computes the gradient one process computes on the
same global batch (it holds the same samples, each augmented under its own seed), so the figures agree.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from ranks import free_port

from mlcls.cli.train import run
from mlcls.engine.checkpoint import load_checkpoint

ARGS = [
    "dataset.train_size=64",
    "dataset.val_size=40",
    "dataset.image_size=32",
    "model.name=convnext_atto",  # LayerNorm only: no per-process BatchNorm statistics
    "model.pretrained=false",
    "trainer.epochs=1",
    "trainer.batch_size=32",
    "trainer.workers=0",
    "trainer.report=false",
    "trainer.device=cpu",
    "loss=twoway",
]


@pytest.mark.slow
def test_two_nodes_match_one_process(tmp_path):
    bin_dir = Path(sys.executable).parent
    torchrun = shutil.which("torchrun", path=str(bin_dir))
    assert torchrun
    # The one-process run, in this process: what ``mlcls-train`` runs after composing the config.
    run(compose_config([*ARGS]), run_dir=tmp_path / "one")

    port = free_port()
    node = [
        torchrun,
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=mlcls-test",
        "-m",
        "mlcls.train",
        *ARGS,
        "loss.gather=true",
        f"hydra.run.dir={tmp_path / 'two'}",
    ]
    env = {"OMP_NUM_THREADS": "1", "PATH": str(bin_dir) + ":/usr/bin:/bin"}
    nodes = [
        subprocess.Popen(
            node, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), outputs[0][-2000:] + outputs[1][-2000:]
    assert not (tmp_path / "outputs").exists()  # one run directory: no stray per-process ones

    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert two["metrics"]["mAP_class"] == pytest.approx(one["metrics"]["mAP_class"], abs=1e-6)
    assert two["metrics"]["mAP_sample"] == pytest.approx(one["metrics"]["mAP_sample"], abs=1e-6)
    assert two["history"][0]["loss"] == pytest.approx(one["history"][0]["loss"], rel=1e-5)
    a = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "two" / "checkpoints" / "last.pt")["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
