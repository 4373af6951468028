"""``python -m mlcls.train`` (and ``torchrun -m mlcls.train``): the same as ``mlcls-train``."""

from mlcls.cli.train import main

if __name__ == "__main__":
    main()
