"""Post-training of KDAMoE models with TRL (``kdamoe-posttrain``): SFT, GRPO, DPO, RLOO and PPO recipes on a
generated calculator-tool task.

* :mod:`.environment` — the arithmetic tasks and the calculator environment (TRL ``environment_factory``);
* :mod:`.data` — SFT conversations, RL prompts and preference pairs generated from the tasks;
* :mod:`.config` — :class:`PostTrainConfig` and :func:`load_posttrain_config` (YAML + ``--set`` overrides);
* :mod:`.recipes` — one module per recipe, each TRL's own trainer with safe defaults;
* :mod:`.run` — :func:`run_recipe`: load the base, train (resuming), save ``final/`` with a model card.
"""

from .config import PostTrainConfig, load_posttrain_config
from .run import run_recipe

__all__ = ["PostTrainConfig", "load_posttrain_config", "run_recipe"]
