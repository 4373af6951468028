"""``mlcls-eval``: the figures of a checkpoint on its validation set (or another split/root).

mlcls-eval checkpoint=outputs/2026-01-01/12-00-00/checkpoints/best.pt
torchrun --nproc_per_node=4 -m mlcls.eval checkpoint=... dataset.root=/data/coco
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mlcls import config_dir
from mlcls.cli.errors import user_errors
from mlcls.cli.overrides import check_command_line
from mlcls.data import build_dataset
from mlcls.data.loader import eval_loader
from mlcls.engine import distributed as dist_utils
from mlcls.engine.checkpoint import load_checkpoint, write_json
from mlcls.engine.evaluate import predict_dataset
from mlcls.metrics import compute_metrics


def evaluate_checkpoint(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate ``cfg.checkpoint``; every process returns the same figures."""
    info = dist_utils.init_distributed(cfg.device)
    state = load_checkpoint(cfg.checkpoint, map_location="cpu")
    run_cfg = OmegaConf.create(state["config"])
    overrides = {k: v for k, v in OmegaConf.to_container(cfg.dataset).items() if v is not None}
    dataset_cfg = OmegaConf.merge(run_cfg.dataset, overrides)
    dataset = build_dataset(dataset_cfg, train=False)
    model = instantiate(
        run_cfg.model, num_classes=len(state["classes"]), pretrained=False, checkpoint_path=None
    )
    model.load_state_dict(state["model"])
    model.to(info.device)
    loader = eval_loader(
        dataset, cfg.batch_size, cfg.workers, info.rank, info.world_size, info.device.type == "cuda"
    )
    scores, labels = predict_dataset(
        model, loader, info.device, cfg.amp if info.device.type == "cuda" else "none"
    )
    figures = compute_metrics(scores, labels, list(state["classes"]))
    figures["checkpoint"] = str(cfg.checkpoint)
    figures["num_samples"] = len(dataset)
    return figures


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="eval")
def _hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        try:
            figures = evaluate_checkpoint(cfg)
        finally:
            dist_utils.cleanup()
    if int(os.environ.get("RANK", "0")) == 0:
        if cfg.output:
            write_json(figures, cfg.output)
        print(json.dumps({k: v for k, v in figures.items() if k != "per_class_ap"}))


def main() -> None:
    check_command_line("eval")
    _hydra_main()


if __name__ == "__main__":
    sys.exit(main())
