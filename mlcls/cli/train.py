"""``mlcls-train``: compose the config, train, return the figures.

mlcls-train                                   # embedded synthetic dataset, small model, CPU-friendly
mlcls-train dataset=coco dataset.root=/data/coco loss=twoway loss.tp=4
torchrun --nproc_per_node=4 -m mlcls.train dataset=coco dataset.root=/data/coco
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from mlcls import config_dir
from mlcls.cli.errors import user_errors
from mlcls.cli.overrides import run_command
from mlcls.engine.distributed import RankFailed
from mlcls.engine.trainer import EXIT_PREEMPTED, NonFiniteError, Preempted, Trainer
from mlcls.errors import failure
from mlcls.reporting.report import report_run

# A shell's exit status for a process ended by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 128 + signal.SIGINT


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Train the run of ``cfg`` (in ``run_dir`` when given, else Hydra's job directory); return
    results.json's content. With ``trainer.report=true`` rank 0 then
    draws the plots and writes ``report.html``. The process group stays up for a sweep's next run."""
    trainer = Trainer(cfg, run_dir)
    if cfg.trainer.report:
        trainer.on_finish.append(report_run)
    return trainer.fit()


def _run_cli(cfg: DictConfig) -> dict[str, Any]:
    try:
        return run(cfg)
    except Preempted as exc:
        print(f"mlcls: stopped: {exc}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED if exc.signum == signal.SIGINT else EXIT_PREEMPTED)
    except KeyboardInterrupt:
        print("mlcls: interrupted (no checkpoint of the current epoch)", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except (NonFiniteError, RankFailed) as exc:
        sys.exit(failure("mlcls", exc, 1))


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    with user_errors():
        results = _run_cli(cfg)
    # Returned for Hydra sweepers (e.g. Optuna) that optimise a value: the held-out split's best mAP@class
    # when the run has one (the test split chooses nothing), else the last validation mAP@class.
    best = results.get("best") or {}
    if best.get("selected_on") == "holdout":
        return best["selection"]["mAP_class"]
    return results.get("metrics", {}).get("mAP_class")


def main() -> None:
    run_command("train", _hydra_main)


if __name__ == "__main__":
    sys.exit(main())
