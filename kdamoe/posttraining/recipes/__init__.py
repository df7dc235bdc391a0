"""Post-training recipes: each is TRL's own trainer with safe defaults for KDAMoE.

A recipe module (``sft``, ``grpo``, ``dpo``, ``rloo``, ``ppo``) defines

* ``config_class()`` (or a ``CONFIG_CLASS`` attribute): the TRL config dataclass whose fields the YAML's
  ``trainer:`` section may set;
* ``build_trainer(cfg, model, tokenizer) -> transformers.Trainer``: the TRL trainer, its config made by
  :func:`kdamoe.posttraining.recipes.common.trainer_args`.

Modules are imported on first use: ``ppo`` needs ``trl.experimental.ppo`` (TRL 1.12; TRL 1.16 has no PPO),
so it is imported only when the recipe is ``ppo``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

RECIPES = ("sft", "grpo", "dpo", "rloo", "ppo")  # the recipe modules of this package


def get_recipe(name: str) -> ModuleType:
    """The recipe module ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`RECIPES`.
        ImportError: the recipe's TRL trainer is not installed (PPO outside its own environment).
    """
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r} is not one of {RECIPES}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as err:
        if name != "ppo":
            raise
        raise ImportError(f"recipe 'ppo' needs TRL's PPO trainer (trl==1.12.0, trl.experimental.ppo), which this "
                          f"environment lacks ({err}); create the PPO environment with `make ppo-env`") from err


def config_class(name: str) -> type:
    """The TRL config class of recipe ``name`` (see :func:`get_recipe` for errors)."""
    module = get_recipe(name)
    getter = getattr(module, "config_class", None)
    return getter() if callable(getter) else module.CONFIG_CLASS


def build_trainer(cfg, model, tokenizer):
    """``get_recipe(cfg.recipe).build_trainer(cfg, model, tokenizer)``."""
    return get_recipe(cfg.recipe).build_trainer(cfg, model, tokenizer)
