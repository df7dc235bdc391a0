"""Pretrain a KDAMoE model: the same as the ``kdamoe-train`` command (see ``--help``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from kdamoe.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
