"""SFT recipe: TRL's ``SFTTrainer`` on the scripted agents' tool-calling episodes.

Data: :func:`kdamoe.posttraining.data.sft_dataset` — conversational ``messages`` with a ``tools`` column (JSON
text, which ``SFTTrainer`` parses and hands to the chat template). Loss on the assistant turns only
(``assistant_only_loss=True``): the shipped chat template marks them with ``{% generation %}``, end-of-turn
token included, so the model learns to emit tool calls and to stop, not to predict tool results or the task. A base
folder with Kimi's tokenizer (a converted Kimi Linear model) keeps its own template; its data is tokenized with a
marked copy of Kimi's format that renders the same text
(:func:`~kdamoe.posttraining.chat_formats.training_chat_template`).

``padding_free=True`` (one flattened row, ``position_ids`` restarting per example) and ``packing=True`` (BFD
packing, which implies padding-free) are honoured exactly by the model: restarting ``position_ids`` start a
new KDA state and a new MLA causal block (docs/architecture.md §8), so they give the same per-token loss as
padded batches.
"""

from __future__ import annotations

from trl import SFTConfig, SFTTrainer

from ..chat_formats import chat_template_swapped, training_chat_template
from ..data import sft_dataset
from .common import check_episodes_fit, peft_config, trainer_args, training_tasks

CONFIG_CLASS = SFTConfig


def build_trainer(cfg, model, tokenizer) -> SFTTrainer:
    """``SFTTrainer`` with ``assistant_only_loss=True``.

    ``max_length`` defaults to the model's context (``None`` under padding-free without packing, where TRL does
    not truncate), and no episode may be longer: a cut episode would teach calls without their ``submit``.

    The tokenizer's own chat template is what it keeps (and ``final/`` saves); under ``assistant_only_loss`` a Kimi
    template without ``{% generation %}`` markers is swapped for its marked copy only while TRL tokenizes the data.

    Raises:
        ValueError: the longest episode of ``cfg.data`` does not fit ``max_position_embeddings``; a Kimi template
            the marked copy does not reproduce (:func:`~kdamoe.posttraining.chat_formats.training_chat_template`).
    """
    limit = model.config.max_position_embeddings
    tasks = training_tasks(cfg)
    check_episodes_fit(cfg, tokenizer, model.config, tasks, "SFT episode")
    padding_free = cfg.trainer.get("padding_free", False) and not cfg.trainer.get("packing", False)
    args = trainer_args(cfg, SFTConfig, assistant_only_loss=True, max_length=None if padding_free else limit)
    dataset = sft_dataset(tasks, hasty_fraction=cfg.data.hasty_fraction, seed=cfg.data.seed)
    marked = training_chat_template(tokenizer) if args.assistant_only_loss else None
    with chat_template_swapped(tokenizer, marked):  # SFTTrainer tokenizes the whole dataset while it builds
        return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                          peft_config=peft_config(cfg))
