"""``mlcls-bench``: throughput benchmarks, one JSON line each on stdout (plus a table on a terminal).

mlcls-bench pipeline --images DIR [--n N] [--workers W] [--size 224]   decode + augmentation, images/s
mlcls-bench step model.name=resnet50 dataset.image_size=224 trainer.batch_size=32 [trainer.amp=bf16]
                                                                        train step vs a bare loop, images/s
mlcls-bench e2e [overrides] --backends fast,gpu,torchvision,shards [--images DIR]
                                  the training loop fed by each loader vs on device-resident batches
mlcls-bench loss [--device cpu] [--repeats 100] [--scale [--threads 1]] two-way loss forward + backward
mlcls-bench metrics [--n 40137] [--c 80]                               mAP@class + mAP@sample vs sklearn
mlcls-bench eval [--n 41620] [--c 9605]              the trainer's evaluation: seconds and peak memory

Rates are under keys ending in ``_per_s``; for the loss and metric timings (milliseconds or seconds per
call) the matching ``_per_s`` rate (calls per second) is added next to each time.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mlcls.bench import e2e_bench, pipeline_bench, step_bench
from mlcls.cli.errors import user_errors
from mlcls.cli.overrides import compose_config


def add_rates(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``<name>_per_s = 1 / <name>_s`` (or ``1000 / <name>_ms``) after each timing key."""
    out: dict[str, Any] = {}
    for key, value in result.items():
        out[key] = value
        if not isinstance(value, (int, float)) or isinstance(value, bool) or key.endswith("_per_s"):
            continue
        for suffix, per_second in (("_ms", 1000.0), ("_s", 1.0)):
            if key.endswith(suffix) and value > 0:
                out[f"{key[: -len(suffix)]}_per_s"] = per_second / value
                break
    return out


# `mlcls-bench loss`'s timed calls per loss: at C = 80 (two losses), and under --scale (every loss, up to
# C = 9,605), where each call costs far more.
LOSS_REPEATS, SCALE_REPEATS = 100, 20


def _loss(args: argparse.Namespace) -> dict[str, Any]:
    from mlcls.bench import loss_bench

    if args.scale:
        repeats = SCALE_REPEATS if args.repeats is None else args.repeats
        return add_rates(loss_bench.run_scale(repeats=repeats, threads=args.threads))
    repeats = LOSS_REPEATS if args.repeats is None else args.repeats
    return add_rates(loss_bench.run(device=args.device, repeats=repeats))


def _metrics(args: argparse.Namespace) -> dict[str, Any]:
    from mlcls.bench import metrics_bench

    return add_rates(metrics_bench.run(n=args.n, c=args.c, seed=args.seed))


def _eval(args: argparse.Namespace) -> dict[str, Any]:
    from mlcls.bench import eval_bench

    return add_rates(eval_bench.run(n=args.n, c=args.c, seed=args.seed))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlcls-bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pipeline = commands.add_parser("pipeline", help="decode + training augmentation images/s")
    pipeline_bench.add_arguments(pipeline)
    pipeline.set_defaults(run=pipeline_bench.run_from_args)
    step = commands.add_parser(
        "step", help="the trainer's epoch loop (or step) vs a bare PyTorch loop, images/s"
    )
    step_bench.add_arguments(step)
    step.set_defaults(
        run=lambda args: step_bench.run_from_args(args, compose_config("train", args.overrides))
    )
    e2e = commands.add_parser(
        "e2e", help="the training loop fed by each input pipeline vs on batches already on the device"
    )
    e2e_bench.add_arguments(e2e)
    e2e.set_defaults(run=lambda args: e2e_bench.run_from_args(args, compose_config("train", args.overrides)))
    loss = commands.add_parser("loss", help="two-way loss vs masked logsumexp, forward + backward")
    loss.add_argument("--device", default="cpu")
    loss.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed calls per loss ({LOSS_REPEATS}; --scale: {SCALE_REPEATS})",
    )
    loss.add_argument("--scale", action="store_true", help="every loss at C = 80 and 9,605, batch 128 (CPU)")
    loss.add_argument("--threads", type=int, default=1, help="torch intra-op threads for --scale")
    loss.set_defaults(run=_loss)
    metrics = commands.add_parser("metrics", help="mAP@class + mAP@sample vs scikit-learn")
    metrics.add_argument("--n", type=int, default=40137, help="samples (rows)")
    metrics.add_argument("--c", type=int, default=80, help="classes (columns)")
    metrics.add_argument("--seed", type=int, default=0)
    metrics.set_defaults(run=_metrics)
    evaluation = commands.add_parser(
        "eval", help="gather, metrics, thresholds and results of one evaluation: seconds, peak memory"
    )
    evaluation.add_argument("--n", type=int, default=41620, help="validation samples (rows)")
    evaluation.add_argument("--c", type=int, default=9605, help="classes (columns)")
    evaluation.add_argument("--seed", type=int, default=0)
    evaluation.set_defaults(run=_eval)
    return parser


def format_table(result: dict[str, Any]) -> str:
    """Two aligned columns, key and value, floats with 4 significant digits."""
    width = max(map(len, result), default=0)
    rows = [
        f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}"
        for key, value in result.items()
    ]
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the subcommand of ``argv``; print its result as one JSON line (and a table on a terminal)."""
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], dict[str, Any]] = args.run
    with user_errors():
        try:
            result = run(args)
        except FileNotFoundError as exc:  # --images without JPEGs
            print(f"mlcls: error: {exc}", file=sys.stderr)
            sys.exit(2)
    print(json.dumps(result), flush=True)
    if sys.stdout.isatty():
        print(format_table(result))


if __name__ == "__main__":
    main()
