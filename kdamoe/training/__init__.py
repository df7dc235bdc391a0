"""Pretraining for kdamoe: corpus and tokenizer, packing, the accelerate training loop, monitoring, export.

Entry points: ``kdamoe-train`` / ``kdamoe-generate`` (``kdamoe.cli``), which call :func:`run` and
:func:`kdamoe.training.export.generate_text`.
"""

from .config import RunConfig, load_config
from .trainer import run

__all__ = ["RunConfig", "load_config", "run"]
