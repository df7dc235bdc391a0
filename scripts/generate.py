"""Stream text from a saved KDAMoE folder: the same as the ``kdamoe-generate`` command (see ``--help``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from kdamoe.cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main())
