"""The post-training job's configuration (``kdamoe-posttrain``): one dataclass, loaded from YAML.

``load_posttrain_config(path_or_name, overrides)`` reads a YAML file (a path, or the name of a file shipped
in ``kdamoe/configs/posttrain/``), applies ``dotted.key=value`` overrides (values parsed as YAML, e.g.
``trainer.max_steps=2``) and validates every field. Any problem raises ``ValueError`` naming the field and
the bad value, before a model is loaded:

* ``recipe`` is one of :data:`RECIPES`; ``grpo.mode`` one of :data:`GRPO_MODES`; ``grpo.rollout`` one of
  :data:`GRPO_ROLLOUTS`;
* ``trainer`` keys are fields of the recipe's TRL config class (``SFTConfig``, ``GRPOConfig``, ...), with a
  "did you mean" hint (the values are checked by that class when the recipe builds it);
* ``peft`` builds a ``peft.LoraConfig``;
* ``trainer.fsdp`` fits the launch (:func:`kdamoe.common.parallel.check_trainer_fsdp`);
* ``distributed_config`` builds a ``transformers.distributed.DistributedConfig`` and fits the launch, the model and
  the recipe (:mod:`kdamoe.common.parallel`'s checks, :meth:`PostTrainConfig._check_distributed`);
* ``data`` names a task family and ranges its generator accepts.

Checks that need the model (the aux-loss coefficient against Quantile Balancing, the GRPO completion budget
against the context) run when the recipe is built (:mod:`kdamoe.posttraining.recipes.common`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..common.config import apply_override, build_dataclass, read_yaml
from ..common.parallel import check_distributed_config, check_distributed_launch, check_trainer_fsdp, launched_processes
from .environments import ENVIRONMENTS
from .recipes import RECIPES, config_class
from .recipes.common import lora_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "posttrain"
GRPO_MODES = ("single_turn", "tools", "environment")
GRPO_ROLLOUTS = ("trl", "cached", "batched")
ROUTER_BIASES = ("update", "freeze")
# Bounds of trainer values that TRL's config classes accept but torch's optimizer or data loader refuses only once
# training starts (with a traceback from inside them).
TRAINER_MINIMA = {"per_device_train_batch_size": 1, "per_device_eval_batch_size": 1, "gradient_accumulation_steps": 1,
                  "learning_rate": 0.0, "weight_decay": 0.0, "warmup_steps": 0, "num_train_epochs": 0.0,
                  "max_grad_norm": 0.0, "adam_epsilon": 0.0, "num_generations": 2, "max_completion_length": 1}
# Set from the top-level fields of the config; a value under `trainer:` would be a second source of truth.
RESERVED_TRAINER_KEYS = ("output_dir", "seed")


@dataclass
class TaskDataConfig:
    """The generated tasks a recipe trains on (:func:`kdamoe.posttraining.data.make_family_tasks`).

    ``environment``: ``keyhunt`` (:mod:`kdamoe.posttraining.environments.keyhunt`) or ``arithmetic``
    (:mod:`kdamoe.posttraining.environments.arithmetic`). ``min_calls`` / ``max_calls``: tool calls a task needs
    before its
    final call (key hunt: doors to open before ``take_key``; arithmetic: operations before ``submit``). ``max_operand``:
    arithmetic operands lie in ``[2, max_operand]``. ``hasty_fraction``: share of SFT demonstrations by the hasty agent
    (:func:`~kdamoe.posttraining.data.sft_dataset`). ``seed`` fixes the tasks.
    """

    environment: str = "keyhunt"
    num_tasks: int = 64
    min_calls: int = 1
    max_calls: int = 3
    max_operand: int = 9
    hasty_fraction: float = 0.0
    seed: int = 0


@dataclass
class GRPOSection:
    """``mode``: ``single_turn`` (no tools; reward: the completion states the answer), ``tools`` (TRL ``tools=``:
    stateless calculator functions; reward: the submitted value against the row's ``answer``) or
    ``environment`` (TRL ``environment_factory=`` the data's environment class; reward: its ``get_reward``).

    ``rollout``: ``trl`` (TRL's own generation and tool loop, which re-prefills the whole conversation every turn)
    or ``cached`` (:mod:`kdamoe.posttraining.rollout`: each turn continues the rollout's cache and prefills only
    its new tokens; the same tokens under greedy decoding) or ``batched`` (the same episodes played together on the
    cache slots of :class:`kdamoe.posttraining.engine.RolloutEngine`: ``rollout_slots`` of them, 0 = one per
    episode; a GRPO group prefills its prompt once; tool calls run on worker threads, each limited to
    ``tool_timeout_s`` seconds, None = no limit).

    ``long_context``: the memory-bounded update for long trajectories (docs/post-training.md, "Long-horizon agentic
    RL"): activation checkpointing per decoder layer, checked against the model's chunked prefill
    (:func:`kdamoe.posttraining.recipes.grpo.long_context_defaults`); TRL's fused LM head does the rest."""

    mode: str = "environment"
    rollout: str = "trl"
    long_context: bool = False
    rollout_slots: int = 0
    tool_timeout_s: float | None = None


@dataclass
class PostTrainConfig:
    """Everything one ``kdamoe-posttrain`` run needs (module docstring).

    Attributes:
        recipe: ``sft`` | ``grpo`` | ``dpo`` | ``rloo`` | ``ppo``.
        model: base model folder (``save_pretrained`` layout, e.g. a pretraining ``final/``) or Hub id.
        output_dir: TRL ``output_dir``: ``checkpoint-N/`` folders, then ``final/`` (and ``adapter/``), ``summary.json``.
        seed: the trainer's seed (``TrainingArguments.seed``).
        data: the generated tasks.
        grpo: GRPO's mode, rollout path and long-context update switch (ignored by other recipes).
        router_biases: ``update``: Quantile Balancing keeps moving the router biases once per optimizer step
            during full fine-tuning; ``freeze``: they stay as the base has them. Under PEFT they are always frozen
            (an adapter carries no buffers, docs/architecture.md §8).
        peft: ``None`` (full fine-tuning) or ``peft.LoraConfig`` keyword arguments (``target_parameters`` reaches
            the fused experts' ``gate_up_proj`` / ``down_proj``).
        trainer: keyword arguments of the recipe's TRL config class; they override the recipe's defaults.
        ppo: the PPO recipe's own section (value / reward model), :class:`~kdamoe.posttraining.recipes.ppo.PPOSection`.
        distributed_config: ``None`` (the Trainer's own data parallelism: DDP, or FSDP2 with ``trainer.fsdp``) or
            keyword arguments of transformers' ``DistributedConfig`` (``fsdp_size``, ``ep_size``, ...): the base is
            then sharded while it loads, by transformers' engine (FSDP2, expert parallelism with ``ep_size``;
            :func:`kdamoe.posttraining.run.load_base`), and the Trainer trains it without wrapping it
            (docs/post-training.md, "Several processes"). SFT and GRPO (multi-turn modes with ``grpo.rollout: batched``
            only).
    """

    recipe: str = "sft"
    model: str = "outputs/cpu_default/final"
    output_dir: str | None = None
    seed: int = 0
    data: TaskDataConfig = field(default_factory=TaskDataConfig)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    router_biases: str = "update"
    peft: dict[str, Any] | None = None
    trainer: dict[str, Any] = field(default_factory=dict)
    ppo: dict[str, Any] = field(default_factory=dict)
    distributed_config: dict[str, Any] | None = None

    def validate(self) -> "PostTrainConfig":
        """Check every field (module docstring); raises ``ValueError`` naming the first bad one. Returns ``self``."""
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"config field {name}: {why}")

        need(self.recipe in RECIPES, "recipe", f"{self.recipe!r} is not one of {RECIPES}")
        need(self.grpo.mode in GRPO_MODES, "grpo.mode", f"{self.grpo.mode!r} is not one of {GRPO_MODES}")
        need(self.grpo.rollout in GRPO_ROLLOUTS, "grpo.rollout",
             f"{self.grpo.rollout!r} is not one of {GRPO_ROLLOUTS}")
        slots = self.grpo.rollout_slots
        need(isinstance(slots, int) and not isinstance(slots, bool) and slots >= 0, "grpo.rollout_slots",
             f"must be an integer >= 0 (0: one slot per episode), got {slots!r}")
        need(self.grpo.rollout == "batched" or (slots == 0 and self.grpo.tool_timeout_s is None),
             "grpo.rollout_slots / grpo.tool_timeout_s", f"set for grpo.rollout={self.grpo.rollout!r}; only "
             "grpo.rollout: batched reads them")
        timeout = self.grpo.tool_timeout_s
        need(timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0),
             "grpo.tool_timeout_s", f"must be null or a number of seconds > 0, got {timeout!r}")
        need(self.router_biases in ROUTER_BIASES, "router_biases",
             f"{self.router_biases!r} is not one of {ROUTER_BIASES}")
        need(bool(self.model), "model", "must name a base model folder or Hub id")
        if self.output_dir is None:
            self.output_dir = f"outputs/posttrain/{self.recipe}"
        d = self.data
        need(d.num_tasks >= 1, "data.num_tasks", f"must be at least 1, got {d.num_tasks}")

        need(d.environment in ENVIRONMENTS, "data.environment", f"{d.environment!r} is not one of {list(ENVIRONMENTS)}")
        need(1 <= d.min_calls <= d.max_calls, "data.min_calls / data.max_calls",
             f"need 1 <= min_calls <= max_calls, got {d.min_calls}, {d.max_calls}")
        need(d.environment != "keyhunt" or d.max_calls <= 8, "data.max_calls",
             f"a key hunt has at most 8 rooms, got {d.max_calls}")
        need(self.recipe != "grpo" or self.grpo.mode != "tools" or d.environment == "arithmetic", "grpo.mode",
             "'tools' (stateless functions) needs data.environment: arithmetic; a key hunt's map lives in its "
             "environment (grpo.mode: environment)")
        need(d.max_operand >= 2, "data.max_operand", f"must be at least 2, got {d.max_operand}")
        single_turn = self.recipe == "rloo" or (self.recipe == "grpo" and self.grpo.mode == "single_turn")
        need(not single_turn or d.environment == "arithmetic", "data.environment",
             f"{d.environment!r}: a single-turn reward needs an answer in the text, and only arithmetic tasks have "
             "one (a key hunt is solved through its environment's tools)")
        need(self.recipe != "ppo" or self.peft is None, "peft",
             "the ppo recipe trains the full policy and value model (TRL 1.12's PPO here takes no PEFT config)")
        need(0.0 <= d.hasty_fraction <= 1.0, "data.hasty_fraction", f"must lie in [0, 1], got {d.hasty_fraction}")
        need(self.recipe == "grpo" or self.grpo == GRPOSection(), "grpo",
             f"set for recipe {self.recipe!r}, which does not read it (only the grpo recipe does): {self.grpo}")
        t = self.trainer
        if self.recipe == "grpo" and self.grpo.rollout in ("cached", "batched"):
            for key in ("use_vllm", "use_transformers_continuous_batching"):
                need(not t.get(key), f"trainer.{key}",
                     f"grpo.rollout: {self.grpo.rollout} generates with the policy itself on its own caches; it does "
                     f"not run with {key}=true (use grpo.rollout: trl)")
        check_trainer_fsdp(t, self.peft, launched_processes())
        sharded_by = "trainer.fsdp" if t.get("fsdp") else "distributed_config" if self.distributed_config else None
        if sharded_by and self.recipe == "grpo" and self.grpo.rollout != "batched":
            # Every forward of a sharded model is a collective (FSDP2 all-gathers, EP all-to-alls). One `generate`
            # keeps the ranks in step (transformers sets synced_gpus: torch's fully_shard marks the modules it
            # manages), but TRL's tool loop calls generate again only on the ranks whose completions hold a tool
            # call, and the cached rollout plays each rank's own turns: on 2 gloo processes with a tool call on one
            # rank only, every multi-turn recipe aborted on a collective mismatch (tests/test_posttrain_fsdp.py).
            # The batched engine steps every rank in lockstep (RolloutEngine's lockstep_group), so it is allowed.
            need(self.grpo.mode == "single_turn", "grpo.mode",
                 f"{self.grpo.mode!r} with {sharded_by} and grpo.rollout: {self.grpo.rollout}: the tool loop runs a "
                 "different number of generate calls on each process, and every forward of a sharded model is a "
                 "collective, so the processes fall out of step; use grpo.rollout: batched (its engines step every "
                 f"process in lockstep), train under DDP (leave {sharded_by} unset) or use grpo.mode: single_turn")
        if self.distributed_config is not None:
            self._check_distributed()
        self._check_trainer()
        if self.recipe == "ppo":  # importable only in the PPO venv; _check_trainer has already imported it
            from .recipes.ppo import PPOSection  # noqa: PLC0415 (trl.experimental.ppo, which recipes.ppo imports, exists only in the PPO venv)

            PPOSection.from_dict(self.ppo)
        if self.peft is not None:
            lora_config(self.peft)
        return self

    def _check_distributed(self) -> None:
        """The ``distributed_config`` refusals (each a ``ValueError`` naming the field): a bad ``DistributedConfig``,
        one process, sizes that are not the launch (:func:`kdamoe.common.parallel.check_distributed_launch`),
        ``trainer.fsdp`` next to it, a PEFT adapter, Trainer checkpoints, a recipe or GRPO mode whose collectives
        could not line up over the ranks, and (for a local model folder) ``num_experts`` not divisible by
        ``ep_size`` (:func:`kdamoe.common.parallel.check_distributed_config`)."""
        def need(ok: bool, name: str, why: str):
            if not ok:
                raise ValueError(f"config field {name}: {why}")

        section, t = self.distributed_config, self.trainer
        check_distributed_launch(section, launched_processes())
        need(not t.get("fsdp"), "trainer.fsdp", "set together with distributed_config: the model is sharded once, "
             "either by transformers' engine while it loads (distributed_config) or by accelerate (trainer.fsdp)")
        need(self.peft is None, "peft", "with distributed_config: not supported by the recipes (under ep_size a "
             "rank holds only its experts, and final/ merges the adapter into the whole base; train the full model, "
             "peft: null)")
        need(t.get("save_strategy", "no") == "no", "trainer.save_strategy",
             f"{t.get('save_strategy')!r} with distributed_config: transformers' Trainer cannot checkpoint the "
             "optimizer of a model sharded while it loads, so a run could not resume; leave it 'no' (final/ is "
             "written at the end)")
        need(self.recipe in ("sft", "grpo"), "recipe", f"{self.recipe!r} with distributed_config: only sft and grpo "
             "(grpo.mode: single_turn, or any mode with grpo.rollout: batched) run under transformers' engine here")
        if self.recipe == "grpo":  # grpo.mode is checked in validate, as for trainer.fsdp
            need(self.grpo.rollout != "cached", "grpo.rollout",
                 "cached with distributed_config: each rank steps its own caches (a different number of sharded "
                 "forwards per rank); use grpo.rollout: batched (lockstep engines) or trl")
            need(not self.grpo.long_context, "grpo.long_context", "not tested with distributed_config")
        model_config = Path(self.model).expanduser() / "config.json"
        if model_config.is_file():  # a Hub id is checked when the base loads (run.load_base)
            check_distributed_config(section, SimpleNamespace(**json.loads(model_config.read_text())))

    def _check_trainer(self) -> None:
        cls = config_class(self.recipe)
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        fields = list(types)
        for key, value in self.trainer.items():
            if key in RESERVED_TRAINER_KEYS:
                raise ValueError(f"config field trainer.{key}: set the top-level `{key}` instead")
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(f"config field trainer.{key}: not a field of {cls.__name__}{hint}")
            if isinstance(value, str) and _takes_float(types[key]):
                try:
                    self.trainer[key] = float(value)  # YAML reads 1e-5 (no dot) as a string
                except ValueError:
                    raise ValueError(f"config field trainer.{key}: expected a number, got {value!r}") from None
            elif _is_plain(types[key], int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"config field trainer.{key}: expected an integer, got {value!r}")
            elif _is_plain(types[key], bool) and not isinstance(value, bool):
                raise ValueError(f"config field trainer.{key}: expected true or false, got {value!r}")
            low = TRAINER_MINIMA.get(key)
            number = self.trainer[key]
            if low is not None and isinstance(number, (int, float)) and not (math.isfinite(number) and number >= low):
                raise ValueError(f"config field trainer.{key}: must be a finite number >= {low}, got {number!r} "
                                 "(torch or TRL would refuse it only once training starts)")


def _is_plain(tp, kind: type) -> bool:
    """A dataclass field annotated exactly ``kind`` (``int`` or ``bool``; also written as a string): its value is then
    checked here, where TRL's own check would fail deep inside the Trainer (``max_steps="abc"``)."""
    return tp is kind or tp == kind.__name__


def _takes_float(tp) -> bool:
    """A dataclass field annotation that is ``float`` or a union with ``float`` (also written as a string)."""
    if isinstance(tp, str):
        return "float" in tp.replace(" ", "").split("|")
    return tp is float or float in typing.get_args(tp)


def resolve_posttrain_config_path(path_or_name: str | Path) -> Path:
    """A YAML path as given, else ``kdamoe/configs/posttrain/<name>.yaml``.

    Raises:
        ValueError: neither exists (the message lists the shipped names).
    """
    p = Path(path_or_name)
    for candidate in (p, CONFIG_DIR / p, CONFIG_DIR / f"{p}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = sorted(f.stem for f in CONFIG_DIR.glob("*.yaml"))
    raise ValueError(f"post-training config {path_or_name}: no such file (shipped: {shipped})")


def load_posttrain_config(path_or_name: str | Path, overrides: list[str] | None = None) -> PostTrainConfig:
    """Read, override and validate a post-training configuration (module docstring).

    Args:
        path_or_name: a YAML file, or the name of one shipped in ``kdamoe/configs/posttrain/`` (``sft``, ``grpo``,
            ``grpo_long``, ``grpo_tools``, ``grpo_single_turn``, ``dpo``, ``rloo``, ``ppo``).
        overrides: ``dotted.key=value`` strings, values parsed as YAML.
    Raises:
        ValueError: naming the file, the override or the field.
    """
    data = read_yaml(resolve_posttrain_config_path(path_or_name))
    if not isinstance(data, dict):
        raise ValueError(f"post-training config {path_or_name}: expected a mapping at the top, got {data!r}")
    for assignment in overrides or []:
        apply_override(data, assignment)
    return build_dataclass(PostTrainConfig, data, "").validate()


def posttrain_config_to_dict(cfg: PostTrainConfig) -> dict:
    """Plain-data form of a config (``summary.json``, the card)."""
    return dataclasses.asdict(cfg)
