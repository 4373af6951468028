"""``python -m mlcls.cli.resave FILE [FILE ...]``: rewrite checkpoints you trust as plain data.

A checkpoint written before mlcls stored plain data is refused with a line pointing here. Re-saving
unpickles each file as it is -- only for files you wrote yourself -- and writes it back atomically.
"""

from __future__ import annotations

import argparse
import sys

from mlcls.cli.errors import user_errors
from mlcls.engine.checkpoint import resave_plain


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlcls.cli.resave", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint files you wrote yourself")
    args = parser.parse_args(argv)
    with user_errors():
        for path in args.checkpoints:
            resave_plain(path)
            print(f"mlcls: {path} re-saved as plain data", file=sys.stderr)


if __name__ == "__main__":
    main()
