"""Post-training of KDAMoE models with TRL (``kdamoe-posttrain``): SFT, GRPO, DPO, RLOO and PPO recipes on
generated tool-use tasks (docs/post-training.md).

* :mod:`.keyhunt` — the key-hunt tasks and environment (TRL ``environment_factory``), used by ``make posttrain``;
* :mod:`.environment` — the chained-arithmetic tasks and the calculator environment (tools with arguments);
* :mod:`.data` — task families, SFT conversations, RL prompts and preference pairs generated from the tasks;
* :mod:`.agent` — held-out multi-turn evaluation that mirrors TRL's tool loop;
* :mod:`.demo` — ``make posttrain``: SFT then GRPO, scored on held-out tasks;
* :mod:`.config` — :class:`PostTrainConfig` and :func:`load_posttrain_config` (YAML + ``--set`` overrides);
* :mod:`.recipes` — one module per recipe, each TRL's own trainer with safe defaults;
* :mod:`.run` — :func:`run_recipe`: load the base, train (resuming), save ``final/`` with a model card.
"""

from .config import PostTrainConfig, load_posttrain_config
from .run import run_recipe

__all__ = ["PostTrainConfig", "load_posttrain_config", "run_recipe"]
