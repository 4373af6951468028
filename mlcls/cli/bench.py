"""``mlcls-bench``: throughput benchmarks, one JSON line each on stdout (plus a table on a terminal).

``mlcls-bench SUBCOMMAND --help`` lists its options, docs/performance.md says what each measures. Rates are
under keys ending in ``_per_s`` (added next to each time of the loss, metric and evaluation timings).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

# Each subcommand's help, and whether its timings get rates. Its options and run are those of
# mlcls.bench.<name>_bench (``add_arguments``; ``run_from_args``, else ``run`` called with the options its
# parameters name), imported only when named (``mlcls-bench --help`` imports no torch).
COMMANDS = {
    "pipeline": ("decode + training augmentation images/s", False),
    "step": ("the trainer's epoch loop (or step) vs a bare PyTorch loop, images/s", False),
    "e2e": ("the training loop fed by each input pipeline vs on batches already on the device", False),
    "loss": ("two-way loss vs masked logsumexp, forward + backward", True),
    "metrics": ("mAP@class + mAP@sample vs scikit-learn", True),
    "eval": ("outputs streamed to a store, metrics, thresholds and results of one evaluation", True),
    "thresholds": ("held-out F1 of per-tag thresholds (min_positives) vs one global threshold", True),
}


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


def build_parser(commands: Sequence[str | None] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The parser of ``mlcls-bench``, with the options of the subcommands ``commands`` only."""
    parser = argparse.ArgumentParser(prog="mlcls-bench", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, _) in COMMANDS.items():
        command = subparsers.add_parser(name, help=help_text)
        if name in commands:
            module = importlib.import_module(f"mlcls.bench.{name}_bench")
            harness = importlib.import_module("mlcls.bench.harness")
            module.add_arguments(command)
            default = functools.partial(harness.run_with_options, module.run)
            command.set_defaults(run=getattr(module, "run_from_args", default))
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
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser([named]).parse_args(argv)
    from mlcls.cli.errors import user_errors  # after parsing: --help and a typo import no torch
    from mlcls.cli.overrides import compose_config
    from mlcls.errors import failure

    with user_errors(), contextlib.redirect_stdout(sys.stderr):  # stdout holds the JSON line only
        try:
            if "overrides" in args:
                args.cfg = compose_config("train", args.overrides)
            result = args.run(args)
        except FileNotFoundError as exc:  # --images without JPEGs
            sys.exit(failure("mlcls", exc))
    if COMMANDS[args.command][1]:
        result = add_rates(result)
    print(json.dumps(result), flush=True)
    if sys.stdout.isatty():
        print(format_table(result))


if __name__ == "__main__":
    main()
