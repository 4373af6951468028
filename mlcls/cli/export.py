"""``mlcls-export``: a checkpoint as TorchScript or ONNX, with classes, preprocessing and thresholds inside.

mlcls-export checkpoint=outputs/run/checkpoints/best.pt format=onnx
mlcls-export checkpoint=best.pt format=torchscript out=deploy/model.torchscript.pt
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from mlcls import config_dir
from mlcls.cli.errors import require_keys, user_errors
from mlcls.cli.overrides import run_command
from mlcls.errors import failure
from mlcls.inference.export import export_checkpoint

USAGE = "mlcls-export checkpoint=<run>/checkpoints/best.pt format=onnx"


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="export")
def _hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        require_keys(cfg, USAGE)
        path, difference = export_checkpoint(
            cfg.checkpoint, cfg.format, cfg.out, cfg.opset, cfg.verify, trust=cfg.trust_checkpoint
        )
    print(json.dumps({"format": cfg.format, "path": str(path), "max_abs_difference": difference}))
    if difference is not None and not difference <= cfg.tolerance:
        tolerance = f"{difference:.3g} > tolerance {cfg.tolerance}"
        sys.exit(failure("mlcls", f"{path} differs from the PyTorch model by {tolerance}", 1))


def main() -> None:
    run_command("export", _hydra_main)


if __name__ == "__main__":
    sys.exit(main())
