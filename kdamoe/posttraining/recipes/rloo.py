"""RLOO recipe: TRL's ``RLOOTrainer`` (REINFORCE with a leave-one-out baseline; Ahmadian et al. 2024,
arXiv:2402.14740) on the arithmetic prompts.

TRL 1.16's ``RLOOTrainer`` has no tool loop (no ``tools=`` / ``environment_factory=``), so RLOO trains single
turns without tools, rewarded by :func:`kdamoe.posttraining.recipes.grpo.stated_answer_reward` (the last
integer of the completion is the answer). The completion budget is checked as GRPO's
(:func:`kdamoe.posttraining.recipes.common.completion_budget`); the tokenizer pads on the left (TRL requires it).
"""

from __future__ import annotations

from trl import RLOOConfig, RLOOTrainer

from ..data import prompt_dataset
from .common import completion_budget, peft_config, trainer_args, training_tasks
from .grpo import stated_answer_reward

CONFIG_CLASS = RLOOConfig


def build_trainer(cfg, model, tokenizer) -> RLOOTrainer:
    """``RLOOTrainer`` with the single-turn reward (module docstring).

    Raises:
        ValueError: the completion budget does not fit the model's context.
    """
    tasks = training_tasks(cfg)
    budget = completion_budget(cfg, tokenizer, model.config, tasks, with_tools=False)
    args = trainer_args(cfg, RLOOConfig, max_completion_length=budget)
    tokenizer.padding_side = "left"
    return RLOOTrainer(model=model, reward_funcs=[stated_answer_reward], args=args, train_dataset=prompt_dataset(tasks),
                       processing_class=tokenizer, peft_config=peft_config(cfg))
