"""``python -m mlcls.eval`` (and ``torchrun -m mlcls.eval``): the same as ``mlcls-eval``."""

from mlcls.cli.eval import main

if __name__ == "__main__":
    main()
