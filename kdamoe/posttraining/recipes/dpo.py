"""DPO recipe: TRL's ``DPOTrainer`` (Rafailov et al. 2023, arXiv:2305.18290) on careful vs hasty episodes.

Data: :func:`kdamoe.posttraining.data.preference_dataset` — conversational ``prompt`` (the user task),
``chosen`` (the careful agent's episode), ``rejected`` (a hasty one of the same task) and ``tools`` (JSON
text). TRL 1.16's ``DPOTrainer`` reads the ``tools`` column (JSON text or a list) and passes it to the chat
template, so prompts carry the same tool preamble as SFT and GRPO. The reference model is a frozen copy of the
base made by TRL (none under PEFT: the base with the adapter disabled is the reference); the router-bias
callback only moves the policy's biases.
"""

from __future__ import annotations

from trl import DPOConfig, DPOTrainer

from ..data import preference_dataset
from .common import check_episodes_fit, peft_config, trainer_args, training_tasks

CONFIG_CLASS = DPOConfig


def build_trainer(cfg, model, tokenizer) -> DPOTrainer:
    """``DPOTrainer`` with ``max_length`` = the model's context by default.

    Raises:
        ValueError: the longest episode of ``cfg.data`` does not fit ``max_position_embeddings`` (TRL would cut it).
    """
    limit = model.config.max_position_embeddings
    tasks = training_tasks(cfg)
    check_episodes_fit(cfg, tokenizer, model.config, tasks, "chosen episode")
    args = trainer_args(cfg, DPOConfig, max_length=limit)
    return DPOTrainer(model=model, args=args, train_dataset=preference_dataset(tasks, seed=cfg.data.seed),
                      processing_class=tokenizer, peft_config=peft_config(cfg))
