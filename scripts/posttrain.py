"""Post-train a KDAMoE model with a TRL recipe: the same as the ``kdamoe-posttrain`` command (see ``--help``).

Data-parallel: ``torchrun --standalone --nproc_per_node N scripts/posttrain.py --config sft ...``
(docs/post-training.md, "Several processes").
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from kdamoe.cli import posttrain_main

if __name__ == "__main__":
    sys.exit(posttrain_main())
