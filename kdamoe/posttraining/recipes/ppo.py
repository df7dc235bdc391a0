"""Recipe ``ppo``: TRL's PPO trainer with a KDAMoE policy, value model and reward model.

PPO (Schulman et al. 2017, arXiv:1707.06347) as used for RLHF (Ziegler et al. 2019, arXiv:1909.08593):
the policy samples a response to each prompt, a frozen reward model scores it, a frozen reference model
(a copy of the starting policy, made by TRL) turns the per-token log-ratio into a KL penalty, and a value
model predicts the return at every response token for the GAE advantages.

TRL removed ``PPOTrainer`` after 1.12 (``trl.experimental.ppo`` is missing from the 1.16 main install), so
this module imports only inside the PPO environment: ``make ppo-env`` builds ``.venv-ppo`` from
``requirements-ppo.txt`` (``trl==1.12.0``); ``make test-ppo`` runs ``tests/test_ppo.py`` there.

The four models:

* policy: the ``KDAMoEForCausalLM`` being trained (``model``);
* reference: TRL's frozen deep copy of the policy (``ref_model=None``); it never records router statistics
  (its forwards run under ``torch.no_grad``) and is not inside the trainer's model, so its biases never move;
* reward: a frozen ``KDAMoEForSequenceClassification`` (one label) from ``ppo.reward_model``, or, when that is
  not given, one trained first with TRL's ``RewardTrainer`` (Bradley-Terry loss) on
  :func:`kdamoe.posttraining.data.preference_dataset` pairs (careful episode preferred over hasty) and saved
  in ``output_dir/reward_model`` (reused when it is already there, so a rerun does not train it again);
* value: a trainable ``KDAMoEForSequenceClassification`` initialised from the reward model (the usual
  practice: its head already reads the reward) or from the base model (``ppo.value_model: base``).

Router biases (docs/architecture.md §4 and §8): TRL 1.12 wraps policy and value model in its
``PolicyAndValueWrapper`` (children ``policy``, ``value_model`` and ``critic_backbone`` = the value model's
backbone); :func:`kdamoe.callbacks.find_kdamoe_models` finds the policy and the value model in it, so the
callback run.py attaches balances both. TRL 1.12's PPO calls the callbacks' ``on_step_end`` once per PPO
update (one rollout batch), after all ``num_ppo_epochs × num_mini_batches × gradient_accumulation_steps``
optimizer steps of that update, so Quantile Balancing sees every training forward of the update in one
bias update. The reward model trained here gets its own callback in ``RewardTrainer``.

Auxiliary loss: ``PPOConfig`` (TRL 1.12) has no ``router_aux_loss_coef`` and PPO never passes ``labels``, so
no load-balancing loss enters its objective; a model config asking for one alongside a router-bias rule is
refused (Quantile Balancing replaces it).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_utils import TrainOutput
from trl import RewardConfig, RewardTrainer
from trl.experimental.ppo import PPOConfig, PPOTrainer

from kdamoe.callbacks import add_router_bias_callback
from kdamoe.model import KDAMoEForSequenceClassification
from kdamoe.posttraining.data import episode_messages, preference_dataset, user_message
from kdamoe.posttraining.environments import task_tool_schemas
from kdamoe.posttraining.recipes.common import trainer_args, training_tasks

logger = logging.getLogger(__name__)

CONFIG_CLASS = PPOConfig

VALUE_MODEL_SOURCES = ("reward", "base")
RESPONSE_MARGIN = 16  # tokens beyond the longest careful episode: room for a slightly different wording


# ----------------------------------------------------------------------------------------------------
# The `ppo:` section of a post-training config
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class PPOSection:
    """The ``ppo:`` section of a post-training YAML (everything PPO needs beyond ``PPOConfig``).

    Attributes:
        reward_model: folder (or Hub id) of a ``KDAMoEForSequenceClassification`` with one label; ``None``
            trains one first on the preference pairs and saves it in ``output_dir/reward_model``.
        reward_steps: optimizer steps of that reward-model training.
        reward_learning_rate: its learning rate.
        reward_batch_size: its preference pairs per device and step.
        value_model: where the value model starts: ``"reward"`` (the reward model's weights), ``"base"``
            (the base model's backbone, a fresh head) or a folder / Hub id of a ``KDAMoEForSequenceClassification``.

    Raises:
        ValueError: a non-positive step count / batch size / learning rate, or an empty ``value_model``.
    """

    reward_model: str | None = None
    reward_steps: int = 30
    reward_learning_rate: float = 1e-4
    reward_batch_size: int = 4
    value_model: str = "reward"

    def __post_init__(self):
        for name in ("reward_steps", "reward_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ppo.{name} must be a positive integer, got {value!r}")
        rate = self.reward_learning_rate
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"ppo.reward_learning_rate must be a positive number, got {rate!r}")
        if not isinstance(self.value_model, str) or not self.value_model:
            raise ValueError(f"ppo.value_model must be {' / '.join(VALUE_MODEL_SOURCES)} or a model folder, "
                             f"got {self.value_model!r}")
        if self.reward_model is not None and (not isinstance(self.reward_model, str) or not self.reward_model):
            raise ValueError(f"ppo.reward_model must be a model folder / Hub id or null, got {self.reward_model!r}")

    @classmethod
    def from_dict(cls, data: dict | None) -> PPOSection:
        """The section from its YAML mapping (``None`` = all defaults).

        Raises:
            ValueError: ``data`` is not a mapping, or has a key that is not a field (with the closest name).
        """
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ValueError(f"the ppo section must be a mapping, got {type(data).__name__}: {data!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; fields: {names}"
                raise ValueError(f"unknown key ppo.{key}{hint}")
        data = dict(data)
        rate = data.get("reward_learning_rate")
        if isinstance(rate, str):  # YAML reads 1e-4 (no dot) as a string
            try:
                data["reward_learning_rate"] = float(rate)
            except ValueError:
                pass  # __post_init__ names the bad value
        return cls(**data)


# ----------------------------------------------------------------------------------------------------
# Private helpers
# ----------------------------------------------------------------------------------------------------
def _check_no_aux_loss(model) -> None:
    """Refuse a load-balancing aux loss next to a router-bias rule (Quantile Balancing replaces it)."""
    config = model.config
    if config.router_aux_loss_coef != 0 and config.router_bias_update != "none":
        raise ValueError(
            f"router_aux_loss_coef={config.router_aux_loss_coef} with "
            f"router_bias_update={config.router_bias_update!r}: "
            "the router-bias update balances the experts; set router_aux_loss_coef to 0"
        )


# ----------------------------------------------------------------------------------------------------
# Reward and value models
# ----------------------------------------------------------------------------------------------------
def _load_score_model(source: str, dtype: torch.dtype, pad_token_id: int) -> KDAMoEForSequenceClassification:
    """A one-label ``KDAMoEForSequenceClassification`` from ``source`` (a causal-LM folder gets a fresh head)."""
    model = KDAMoEForSequenceClassification.from_pretrained(source, num_labels=1, dtype=dtype)
    model.config.pad_token_id = pad_token_id
    _check_no_aux_loss(model)
    return model


def train_reward_model(cfg, section: PPOSection, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype) -> Path:
    """Train a reward model on the preference pairs (careful chosen over hasty) and save it.

    Starts from the base model ``cfg.model`` with a fresh one-label head, runs ``section.reward_steps`` steps of
    TRL's ``RewardTrainer`` (router biases balanced by the callback unless ``cfg.router_biases == "freeze"``)
    and saves model and tokenizer to ``output_dir/reward_model``, which is returned. When that folder already
    holds a model, it is returned as is (a rerun or resumed run reuses it).
    """
    out = Path(cfg.output_dir) / "reward_model"
    if (out / "config.json").is_file():
        logger.info(f"reusing the reward model in {out}")
        return out
    model = _load_score_model(cfg.model, dtype, tokenizer.pad_token_id)
    args = trainer_args(
        cfg, RewardConfig, trainer={}, output_dir=str(Path(cfg.output_dir) / "reward_training"), save_strategy="no",
        max_steps=section.reward_steps, learning_rate=section.reward_learning_rate,
        per_device_train_batch_size=section.reward_batch_size, max_length=None,
    )
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer,
                            train_dataset=preference_dataset(training_tasks(cfg), seed=cfg.data.seed))
    if getattr(cfg, "router_biases", "update") == "update":
        add_router_bias_callback(trainer)
    trainer.train()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------------
# Prompts and response budget
# ----------------------------------------------------------------------------------------------------
def _encode(tokenizer, messages, tools, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                              **kwargs)["input_ids"])


def prompt_token_dataset(tasks, tokenizer):
    """PPO's training set: one row per task, ``input_ids`` = the chat-templated user turn with the tool
    preamble and the assistant generation prompt (TRL's PPO takes tokenized prompts, no text)."""
    tools = task_tool_schemas(tasks)
    return Dataset.from_dict({"input_ids": [_encode(tokenizer, [user_message(t)], tools, add_generation_prompt=True)
                                            for t in tasks]})


def careful_response_length(tasks, tokenizer) -> int:
    """Tokens of the longest careful episode after its prompt (assistant calls, tool results, final turn):
    the whole episode is one PPO response, since no tool runs during PPO's generation."""
    longest, tools = 0, task_tool_schemas(tasks)
    for task in tasks:
        prompt = _encode(tokenizer, [user_message(task)], tools, add_generation_prompt=True)
        full = _encode(tokenizer, [user_message(task), *episode_messages(task)], tools)
        longest = max(longest, len(full) - len(prompt))
    return longest


# ----------------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------------
class _ReleaseHeldLog(TrainerCallback):
    """The last callback: after every ``on_step_end``, hands the update's held metrics to ``Trainer.log``."""

    def __init__(self, trainer: KDAMoEPPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._release_log()
        return control


class KDAMoEPPOTrainer(PPOTrainer):
    """TRL 1.12's ``PPOTrainer`` with the ``train`` signature of ``transformers.Trainer`` and its log order.

    TRL's ``train()`` takes no arguments and returns ``None``; run.py calls ``train(resume_from_checkpoint=...)``
    and reads a ``TrainOutput``. TRL's loop also logs an update's metrics *before* the callbacks' ``on_step_end``,
    whereas ``transformers.Trainer`` logs after it; the router-bias callback computes the expert load in
    ``on_step_end`` and adds it to the next log, so it would land one update late (and the last one never). The
    metrics of an update are therefore held and logged right after ``on_step_end`` (by the last callback).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._held_log: dict | None = None
        self._hold_logs = False
        self.add_callback(_ReleaseHeldLog(self))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._hold_logs:
            self._held_log = {**(self._held_log or {}), **logs}
            return
        super().log(logs, start_time)

    def _release_log(self) -> None:
        if self._held_log is not None:
            logs, self._held_log = self._held_log, None
            held, self._hold_logs = self._hold_logs, False
            try:
                super().log(logs)
            finally:
                self._hold_logs = held

    def train(self, resume_from_checkpoint=None, **kwargs) -> TrainOutput:
        """Run PPO; returns ``TrainOutput(global_step, nan, {"train_runtime": seconds})`` (PPO has no
        single training loss).

        Raises:
            ValueError: ``resume_from_checkpoint`` is set: TRL 1.12's PPO checkpoints hold the policy only
                (no value model), and its ``train`` cannot continue from a step.
        """
        if resume_from_checkpoint:
            raise ValueError(
                f"the ppo recipe cannot resume from {resume_from_checkpoint!r}: TRL 1.12's PPO checkpoints save the "
                "policy only (no value model) and its training loop always starts at step 0"
            )
        start = time.time()
        self._hold_logs = True
        try:
            super().train()
        finally:
            self._hold_logs = False
            self._release_log()
        return TrainOutput(self.state.global_step, float("nan"), {"train_runtime": time.time() - start})


def build_trainer(cfg, model, tokenizer) -> KDAMoEPPOTrainer:
    """The PPO trainer for ``model`` (a ``KDAMoEForCausalLM``) on the prompts of ``cfg.data``'s tasks.

    ``cfg`` is a post-training config (recipe ``ppo``): ``output_dir``, ``seed``, ``model`` (the base folder,
    also the start of a reward model trained here), ``data`` (the generated tasks), ``trainer`` (``PPOConfig`` keyword
    arguments), ``ppo`` (:class:`PPOSection` or its mapping) and ``router_biases``. Recipe defaults:
    ``stop_token="eos"`` (a response ends at the end of the assistant turn), ``missing_eos_penalty=1.0``,
    ``num_sample_generations=0`` (no eval set), ``response_length`` = longest careful episode + :data:`RESPONSE_MARGIN`,
    and, since TRL's PPO ignores ``max_steps``, ``total_episodes`` = ``max_steps`` × the rollout batch when
    ``max_steps`` is set.

    The returned trainer has no router-bias callback yet: run.py attaches it first
    (``kdamoe.callbacks.add_router_bias_callback``), and it reaches policy and value model.

    Raises:
        ValueError: a bad ``ppo`` section or ``trainer`` key; a policy in bf16 / fp16 on the CPU; an aux loss
            next to a router-bias rule; prompt + response longer than ``max_position_embeddings``; a tokenizer
            whose pad token is missing or equals its eos token (TRL's PPO finds the response end by the pad id).
    """
    section = cfg.ppo if isinstance(cfg.ppo, PPOSection) else PPOSection.from_dict(cfg.ppo)
    _check_no_aux_loss(model)
    if model.device.type == "cpu" and model.dtype != torch.float32:
        raise ValueError(f"the policy is {model.dtype} on the CPU; load it in float32 (CPUs train bf16 / fp16 badly)")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError(
            f"tokenizer pad token {tokenizer.pad_token!r} must exist and differ from eos {tokenizer.eos_token!r}: "
            "TRL's PPO treats every pad id as padding, so an eos that is also pad would vanish from the responses"
        )

    tasks = training_tasks(cfg)
    trainer_kwargs = dict(cfg.trainer or {})
    if "response_length" not in trainer_kwargs:
        trainer_kwargs["response_length"] = careful_response_length(tasks, tokenizer) + RESPONSE_MARGIN
    dataset = prompt_token_dataset(tasks, tokenizer)
    longest = max(len(ids) for ids in dataset["input_ids"]) + trainer_kwargs["response_length"]
    if longest > model.config.max_position_embeddings:
        raise ValueError(
            f"the longest prompt + trainer.response_length={trainer_kwargs['response_length']} is {longest} tokens, "
            f"more than the model's max_position_embeddings={model.config.max_position_embeddings}"
        )
    defaults = {"stop_token": "eos", "missing_eos_penalty": 1.0, "num_sample_generations": 0}
    max_steps = trainer_kwargs.get("max_steps", -1)
    if max_steps > 0 and "total_episodes" not in trainer_kwargs:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        rollout = (trainer_kwargs.get("per_device_train_batch_size", 8)
                   * trainer_kwargs.get("gradient_accumulation_steps", 1) * world)
        defaults["total_episodes"] = max_steps * rollout
    args = trainer_args(cfg, PPOConfig, trainer=trainer_kwargs, **defaults)

    dtype = model.dtype
    reward_source = section.reward_model or train_reward_model(cfg, section, tokenizer, dtype)
    reward_model = _load_score_model(str(reward_source), dtype, tokenizer.pad_token_id).eval().requires_grad_(False)
    value_source = {"reward": str(reward_source), "base": str(cfg.model)}.get(section.value_model, section.value_model)
    value_model = _load_score_model(value_source, dtype, tokenizer.pad_token_id)

    # PPO's collator pads the prompts, which must be on the left for generation; a copy keeps the caller's
    # tokenizer (saved with the final model) as it is.
    ppo_tokenizer = copy.deepcopy(tokenizer)
    ppo_tokenizer.padding_side = "left"
    return KDAMoEPPOTrainer(
        args=args, processing_class=ppo_tokenizer, model=model, ref_model=None, reward_model=reward_model,
        value_model=value_model, train_dataset=dataset,
    )
