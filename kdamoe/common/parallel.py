"""Parallelism for both jobs: data parallel (DDP), FSDP2, FSDP2 + expert parallelism, and the consolidated export.

kdamoe runs no engine of its own. The model declares its sharding plans (``KDAMoEConfig.base_model_fsdp_plan`` /
``base_model_ep_plan``, ``KDAMoEForCausalLM._fsdp_plan``; docs/distributed.md) and this module applies an engine to
it from outside, as a training job needs it; the model itself keeps what it owns (``save_pretrained`` under FSDP2,
the all-reduce of the Quantile Balancing statistics in ``update_router_biases``).

The engines, by ``train.parallelism`` (pretraining, :data:`PARALLELISMS`) and the post-training config's fields:

* **DDP** (``ddp``; post-training's default): every process holds the whole model; accelerate wraps it in
  ``DistributedDataParallel``, which averages the gradients over the processes. Set up by :func:`make_accelerator`
  (pretraining) or by transformers' ``Trainer``; :func:`check_world_size` refuses a launch the accelerator did not
  take up.
* **FSDP2** (``fsdp2``; post-training ``trainer.fsdp``): parameters, gradients and optimizer state sharded over the
  processes by accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2)``, one ``fully_shard`` unit per
  ``KDAMoEDecoderLayer``. accelerate (up to 1.16 at least) drops the plugin on CPU processes;
  :func:`make_accelerator` and :func:`enable_fsdp2_on_cpu` make the switch it makes on GPUs.
* **FSDP2 + expert parallelism** (``fsdp2_ep``; post-training ``distributed_config``): transformers' own engine
  shards the model while it loads, ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N,
  ep_size=E))`` (:func:`load_sharded`, :func:`expert_parallel_model`): every rank holds ``num_experts / E`` whole
  experts and the routed tokens travel to them by all-to-all; the rest is FSDP2-sharded. accelerate is never given
  such a model (it would wrap or shard it again); :func:`deferred_reduction` stands in for its ``no_sync``.

:func:`consolidated_model` gathers any of them into one plain model on the main process for the export.

The checks (each a ``ValueError`` naming the config field) run when a config loads and again before anything is
set up: :func:`check_expert_parallel`, :func:`check_trainer_fsdp`, :func:`distributed_config_from_dict`,
:func:`check_distributed_launch`, :func:`check_distributed_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers.distributed import DistributedConfig
from transformers.distributed.utils import gather_full_state_dict

from ..model import KDAMoEConfig

PARALLELISMS = ("ddp", "fsdp2", "fsdp2_ep")  # the pretraining job's train.parallelism values
FSDP2_UNIT = "KDAMoEDecoderLayer"  # one fully_shard unit each (the model's _no_split_modules); the root takes the rest


def launched_processes() -> int:
    """The processes ``torchrun`` launched (its ``WORLD_SIZE``); 1 outside ``torchrun``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# ---------------------------------------------------------------------------------------------------------- checks


def check_expert_parallel(model: dict[str, Any], world_size: int) -> None:
    """Check that ``train.parallelism: fsdp2_ep`` can run on ``world_size`` processes: transformers'
    ``DistributedConfig(fsdp_size=N, ep_size=N)`` puts ``num_experts / N`` whole experts on every process.

    Called when the pretraining config loads under torchrun (its ``WORLD_SIZE``; a config loaded elsewhere, e.g. by a
    test or a tool, may be meant for another launch) and again by :func:`make_accelerator` before anything runs.

    Args:
        model: the ``model:`` section (``KDAMoEConfig`` keyword arguments).
        world_size: the number of processes N.
    Raises:
        ValueError: fewer than 2 processes (expert parallelism over one process is no parallelism; use ``ddp``),
            or ``num_experts`` (of the ``model:`` section, else ``KDAMoEConfig``'s default) not divisible by N.
    """
    if world_size < 2:
        raise ValueError(f"config field train.parallelism: fsdp2_ep needs at least 2 processes (torchrun "
                         f"--nproc_per_node N, N >= 2), got WORLD_SIZE={world_size}; one process trains unsharded, "
                         "use ddp")
    experts = model.get("num_experts", KDAMoEConfig().num_experts)
    if experts % world_size:
        raise ValueError(f"config field model.num_experts: {experts} experts cannot be split evenly over "
                         f"{world_size} processes (train.parallelism: fsdp2_ep puts num_experts / N whole experts "
                         "on each of the N processes)")


def check_fsdp2_processes(world_size: int) -> None:
    """Check that ``train.parallelism: fsdp2`` has a process group to shard over.

    Raises:
        ValueError: one CPU process, or one process not started by ``torchrun``: accelerate then sets up no process
            group, which ``fully_shard`` needs. One CUDA process under ``torchrun --nproc_per_node 1`` is allowed:
            it shards nothing, but runs the FSDP2 code path, which is how its overhead is measured
            (``benchmarks/bench_fsdp_overhead.py``).
    """
    one_cuda_rank = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    if world_size < 2 and not one_cuda_rank:
        raise ValueError("config field train.parallelism: fsdp2 needs at least 2 processes "
                         "(torchrun --nproc_per_node N, N >= 2; on CUDA, N = 1 under torchrun runs the FSDP2 "
                         "path unsharded); one process trains unsharded, use ddp")


def check_trainer_fsdp(trainer: dict[str, Any], peft: dict[str, Any] | None, world_size: int) -> None:
    """Check the post-training ``trainer.fsdp`` set-up (transformers' ``TrainingArguments.fsdp``); a no-op without it.

    Args:
        trainer: the ``trainer:`` section (keyword arguments of the recipe's TRL config class).
        peft: the ``peft:`` section, ``None`` for full fine-tuning.
        world_size: the number of processes launched.
    Raises:
        ValueError: ``trainer.fsdp`` on fewer than 2 processes; ``trainer.fsdp_config`` of a version other than 2
            (FSDP1); ``trainer.fsdp`` with a PEFT adapter (``final/`` merges the adapter on the main process, which
            needs the whole model there).
    """
    if not trainer.get("fsdp"):
        return
    if world_size < 2:
        raise ValueError(f"config field trainer.fsdp: needs at least 2 processes (torchrun --nproc_per_node N, "
                         f"N >= 2); WORLD_SIZE is {world_size}, and one process trains unsharded")
    fsdp_config = trainer.get("fsdp_config")  # a dict here; a JSON file's path is transformers' to read
    version = fsdp_config.get("version", 2) if isinstance(fsdp_config, dict) else 2
    if version != 2:
        raise ValueError(f"config field trainer.fsdp_config: version {version!r}: the recipes support FSDP2 only "
                         "(version 2, transformers' default)")
    if peft is not None:
        raise ValueError("config field trainer.fsdp: with a peft adapter: not supported by the recipes (train the "
                         "full model, peft: null)")


def distributed_config_from_dict(section: dict[str, Any]) -> DistributedConfig:
    """``transformers.distributed.DistributedConfig(**section)``, with every bad value named.

    Raises:
        ValueError: ``section`` is not a mapping, names a key that is not a field of ``DistributedConfig`` (with a
            "did you mean"), gives a size that is not a positive integer or a flag that is not a bool, or
            ``DistributedConfig`` rejects a value (e.g. ``ep_size`` not dividing ``fsdp_size``).
    """
    if not isinstance(section, dict):
        raise ValueError(f"config field distributed_config: expected a mapping of DistributedConfig fields, got "
                         f"{section!r}")
    fields = [f.name for f in dataclasses.fields(DistributedConfig)]
    for key in section:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(f"config field distributed_config.{key}: not a field of DistributedConfig{hint}")
    # DistributedConfig does not check its value types: a float or bool size reaches torch's device mesh
    for f in dataclasses.fields(DistributedConfig):
        value, kind = section.get(f.name), str(f.type)
        if value is None:
            continue
        if kind.startswith("int") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config field distributed_config.{f.name}: expected a positive integer, got {value!r}")
        if f.type is bool and not isinstance(value, bool):
            raise ValueError(f"config field distributed_config.{f.name}: expected true or false, got {value!r}")
    ep, fsdp, tp = section.get("ep_size"), section.get("fsdp_size"), section.get("tp_size") or 1
    if ep and fsdp and (fsdp * tp) % ep:  # DistributedConfig's own rule, said with the field's name
        raise ValueError(f"config field distributed_config.ep_size: {ep} must divide fsdp_size * tp_size = {fsdp * tp} "
                         "(the expert-parallel groups are cut out of the FSDP ranks)")
    try:
        return DistributedConfig(**section)
    except (TypeError, ValueError) as err:
        raise ValueError(f"config field distributed_config: {err}") from err


def check_distributed_launch(section: dict[str, Any], world_size: int) -> DistributedConfig:
    """Check a ``distributed_config`` section against what kdamoe shards with it and against the launch.

    Args:
        section: ``DistributedConfig`` keyword arguments.
        world_size: the number of processes launched.
    Returns:
        The ``DistributedConfig`` (:func:`distributed_config_from_dict`).
    Raises:
        ValueError: a bad section (:func:`distributed_config_from_dict`); fewer than 2 processes; ``tp_size`` or
            ``pp_size`` above 1 (kdamoe has no tensor- or pipeline-parallel plan); ``dp_replicate_size`` above 1
            (HSDP, not tested); ``fsdp_size`` other than the process count (every process trains its own rows, so
            the model's data-parallel size must be all of them).
    """
    config = distributed_config_from_dict(section)
    if world_size < 2:
        raise ValueError(f"config field distributed_config: needs at least 2 processes (torchrun --nproc_per_node N, "
                         f"N >= 2); WORLD_SIZE is {world_size}")
    if config.tp_size != 1 or config.pp_size != 1:
        raise ValueError(f"config field distributed_config: tp_size={config.tp_size}, pp_size={config.pp_size}: "
                         "kdamoe has no tensor- or pipeline-parallel plan (fsdp_size and ep_size shard it)")
    if config.dp_replicate_size != 1:
        raise ValueError(f"config field distributed_config.dp_replicate_size: {config.dp_replicate_size}: HSDP is not "
                         "tested with the recipes (shard over all processes with fsdp_size)")
    if config.fsdp_size != world_size:
        raise ValueError(f"config field distributed_config.fsdp_size: {config.fsdp_size} must be the number of "
                         f"processes, WORLD_SIZE={world_size}: the Trainer gives every process its own rows, and the "
                         "model's data-parallel size is fsdp_size")
    return config


def check_distributed_config(section: dict[str, Any], model_config) -> None:
    """Refuse a ``distributed_config`` whose ``ep_size`` does not split the model's experts evenly.

    Args:
        section: ``DistributedConfig`` keyword arguments.
        model_config: the base's config (a ``KDAMoEConfig``, or anything with ``num_experts``).
    Raises:
        ValueError: a bad section (:func:`distributed_config_from_dict`), or ``model_config.num_experts`` not
            divisible by ``ep_size`` (every rank of an expert-parallel group holds ``num_experts / ep_size`` whole
            experts).
    """
    ep_size = distributed_config_from_dict(section).ep_size
    experts = getattr(model_config, "num_experts", None)
    if ep_size > 1 and (not experts or experts % ep_size):
        raise ValueError(f"config field distributed_config.ep_size: {ep_size} does not divide the model's "
                         f"num_experts={experts} (each rank holds num_experts / ep_size whole experts)")


def check_world_size(accelerator, set_up_by: str, hint: str) -> None:
    """Refuse a launch whose ``WORLD_SIZE`` (set by ``torchrun``) differs from the processes the accelerator set up.

    Without this, N processes that each built a one-process accelerator would train N unrelated copies and race on
    the output folder.

    Args:
        accelerator: the job's ``Accelerator`` (or anything with ``num_processes`` and ``distributed_type``).
        set_up_by: who built it, for the message (``"accelerate"``, ``"the Trainer"``).
        hint: what to do about it, for the message.
    Raises:
        ValueError: ``WORLD_SIZE`` != ``accelerator.num_processes``, naming both.
    """
    launched = launched_processes()
    if launched != accelerator.num_processes:
        raise ValueError(f"WORLD_SIZE={launched} processes were launched but {set_up_by} set up "
                         f"{accelerator.num_processes} ({accelerator.distributed_type}); {hint}")


# ---------------------------------------------------------------------------------------------------------- set-up


def fsdp2_plugin(use_bf16: bool) -> FullyShardedDataParallelPlugin:
    """The pretraining job's FSDP2 plugin: every ``KDAMoEDecoderLayer`` its own ``fully_shard`` unit and the root the
    rest (embeddings, final norm, head); parameters resharded after each forward; ``SHARDED_STATE_DICT`` checkpoints
    (each process writes its shards through torch.distributed.checkpoint); ``cpu_ram_efficient_loading`` off (every
    process builds the model from the same seed, so nothing needs broadcasting from rank 0). Gradients are averaged
    over the processes as under DDP, so the pretraining job's loss normalisation (its ``micro_batch_loss``) holds
    unchanged.

    With bf16 the plugin gets an explicit ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` and no
    ``output_dtype``: accelerate's own default (up to 1.15 at least) also sets ``output_dtype=bf16``, which casts the
    root's outputs, the loss included, to bf16 (bf16 losses were logged on the GPU machine); 1.16's default leaves it
    out, so the policy is the same on both.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if use_bf16 else None
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[FSDP2_UNIT],
        reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False,
        mixed_precision_policy=policy)


def _switch_cpu_processes_to_fsdp2(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """On CPU processes, make the switch to FSDP2 that accelerate makes on GPUs; a no-op on other devices.

    accelerate (1.15, 1.16) silently ignores an explicit ``fsdp_plugin`` on CPU: ``AcceleratorState`` switches to
    ``DistributedType.FSDP`` only for accelerator devices (MULTI_GPU, MULTI_XPU, ...), not for MULTI_CPU, so the
    model would be wrapped in DDP. The gloo process group supports what FSDP2 needs, so for MULTI_CPU this sets what
    that branch sets (distributed type, plugin) before anything is prepared; from then on it is accelerate's own
    FSDP2 path, the one CUDA runs."""
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    state = accelerator.state
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin


def _require_fsdp2(accelerator: Accelerator, what: str) -> None:
    """Raises ``RuntimeError`` when the accelerator did not end up in FSDP2 mode (an accelerate version whose gating
    differs from the one :func:`_switch_cpu_processes_to_fsdp2` mirrors)."""
    if not accelerator.is_fsdp2:
        raise RuntimeError(f"{what} but accelerate set up {accelerator.distributed_type}")


def make_accelerator(parallelism: str, use_bf16: bool, grad_accum_steps: int = 1,
                     model: dict[str, Any] | None = None) -> Accelerator:
    """The pretraining job's ``Accelerator`` for ``train.parallelism``: DDP for ``ddp`` (and one process), FSDP2
    (:func:`fsdp2_plugin`) for ``fsdp2``, and for ``fsdp2_ep`` a plain multi-process one that is never given the
    model (:func:`expert_parallel_model`).

    ``cpu=True`` without CUDA: accelerate 1.15 then reads torchrun's LOCAL_RANK / WORLD_SIZE as a multi-CPU (gloo)
    run; with ``cpu=False`` it would treat every CPU process as a lone run training on its own. FSDP2 on CPU
    processes: :func:`_switch_cpu_processes_to_fsdp2`.

    Args:
        parallelism: one of :data:`PARALLELISMS`.
        use_bf16: accelerate's ``mixed_precision="bf16"`` (and FSDP2's bf16 policy), else float32.
        grad_accum_steps: micro-batches per optimizer step.
        model: the ``model:`` section (``KDAMoEConfig`` keyword arguments), read for ``fsdp2_ep``'s expert count.
    Raises:
        ValueError: ``parallelism`` not one of :data:`PARALLELISMS`; ``fsdp2_ep`` with one process or with
            ``num_experts`` not divisible by the process count (:func:`check_expert_parallel`); ``fsdp2`` without a
            process group (:func:`check_fsdp2_processes`).
        RuntimeError: the accelerator did not end up in FSDP2 mode (an accelerate version whose gating differs).
    """
    if parallelism not in PARALLELISMS:
        raise ValueError(f"config field train.parallelism: must be one of {', '.join(PARALLELISMS)}, "
                         f"got {parallelism!r}")
    plugin = None
    if parallelism == "fsdp2_ep":  # the config check, again: WORLD_SIZE may have changed since it loaded
        check_expert_parallel(model or {}, launched_processes())
    if parallelism == "fsdp2":
        check_fsdp2_processes(launched_processes())
        plugin = fsdp2_plugin(use_bf16)
    accelerator = Accelerator(mixed_precision="bf16" if use_bf16 else "no", cpu=not torch.cuda.is_available(),
                              fsdp_plugin=plugin, gradient_accumulation_steps=grad_accum_steps)
    if plugin is not None:
        _switch_cpu_processes_to_fsdp2(accelerator, plugin)  # the plugin already holds its mixed-precision policy
        _require_fsdp2(accelerator, "train.parallelism=fsdp2")
    return accelerator


def enable_fsdp2_on_cpu(trainer) -> None:
    """Make a transformers ``Trainer`` configured for FSDP (``trainer.fsdp=full_shard``; transformers 5.24 defaults
    to FSDP2) shard on CPU processes too; a no-op without ``fsdp`` and on accelerator devices.

    The Trainer builds its accelerator itself, with an FSDP plugin that accelerate drops on CPU
    (:func:`_switch_cpu_processes_to_fsdp2`). Before anything is prepared this makes the switch accelerate makes on
    GPUs (distributed type, the plugin with the accelerator's mixed-precision policy) and sets the Trainer's
    ``is_fsdp_enabled`` flag as ``create_accelerator_and_postprocess`` would have.

    FSDP on one process, FSDP version 1 and FSDP with a PEFT adapter never get here: the config refuses them when it
    loads (:func:`check_trainer_fsdp`), before transformers would fail on them itself.

    Raises:
        RuntimeError: the accelerator did not end up in FSDP2 mode (an accelerate version whose gating differs).
    """
    plugin_args = trainer.args.fsdp_plugin_args
    if plugin_args is None:
        return
    accelerator = trainer.accelerator
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        plugin = FullyShardedDataParallelPlugin(**plugin_args)
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        _switch_cpu_processes_to_fsdp2(accelerator, plugin)
        trainer.is_fsdp_enabled = True
    _require_fsdp2(accelerator, "trainer.fsdp is set")


def load_sharded(model_cls, source: str | Path, section: dict[str, Any], **kwargs):
    """``model_cls.from_pretrained(source, distributed_config=DistributedConfig(**section), **kwargs)``: the model
    sharded while it loads by transformers' engine, on every process (each must call it).

    The engine applies the model's ``base_model_fsdp_plan`` / ``_fsdp_plan`` (FSDP2 over ``fsdp_size`` ranks) and,
    with ``ep_size``, its ``base_model_ep_plan`` (docs/distributed.md, "transformers DistributedConfig"). The result
    reports ``is_distributed_loading_by_transformers``; transformers' ``Trainer`` then trains it without wrapping it.

    Args:
        model_cls: a model class (``KDAMoEForCausalLM``); its ``config_class`` reads ``source``'s config first.
        source: a ``save_pretrained`` folder (or a sharded one, ``distributed_checkpoint=True``) or a Hub id.
        section: ``DistributedConfig`` keyword arguments.
        **kwargs: more ``from_pretrained`` arguments (``dtype``).
    Raises:
        ValueError: a bad section, or ``ep_size`` not dividing the model's ``num_experts``
            (:func:`check_distributed_config`).
    """
    check_distributed_config(section, model_cls.config_class.from_pretrained(source))
    return model_cls.from_pretrained(source, distributed_config=distributed_config_from_dict(section), **kwargs)


def expert_parallel_model(accelerator: Accelerator, model, source: Path, save_first: bool):
    """``train.parallelism: fsdp2_ep``: ``model`` sharded by transformers' engine on all N processes,
    ``DistributedConfig(fsdp_size=N, ep_size=N)`` (:func:`load_sharded`).

    Every process holds ``num_experts / N`` whole experts of each MoE layer (``base_model_ep_plan``) and 1/N of
    everything else (``base_model_fsdp_plan``: one FSDP2 group per decoder layer); the routed tokens travel to their
    experts by all-to-all.

    Args:
        accelerator: the job's (plain multi-process) ``Accelerator``.
        model: the unsharded model, the same on every process (built from the seed).
        source: the folder to load from: with ``save_first`` the main process first saves ``model`` there (a fresh
            run); else a sharded checkpoint's model folder (a resume).
        save_first: save ``model`` to ``source`` before loading.
    Returns:
        The sharded model, in training mode. It must not go through ``accelerator.prepare``: accelerate would wrap it
        in DDP (or shard it again); FSDP2 already reduces its gradients.
    """
    if save_first:
        if accelerator.is_main_process:
            model.save_pretrained(source)
        accelerator.wait_for_everyone()
    n = accelerator.num_processes
    return load_sharded(type(model), source, {"fsdp_size": n, "ep_size": n}).train()


@contextmanager
def deferred_reduction(model, defer: bool) -> Iterator[None]:
    """For a model sharded by transformers' engine, with ``defer``: no gradient reduce-scatter in this micro-batch's
    backward (FSDP2's ``set_requires_gradient_sync(False)``); the gradients accumulate unreduced until the optimizer
    step's micro-batch, as accelerate's ``no_sync`` does for its own FSDP2 models."""
    model.set_requires_gradient_sync(not defer)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------------------------------------------- export


def consolidated_model(accelerator: Accelerator, model, build_plain: Callable[[], torch.nn.Module]):
    """The trained model, whole: what the export writes. Call on every process.

    * DDP (or one process): every process already holds the whole model; its unwrapped module is returned as it is
      on every process (no second copy).
    * FSDP2 by accelerate (``accelerator.is_fsdp2``): ``accelerator.get_state_dict`` all-gathers the shards.
    * transformers' engine (``is_distributed_loading_by_transformers``: FSDP2, with expert parallelism):
      transformers' ``gather_full_state_dict`` gathers the FSDP2 shards and every rank's experts.

    A sharded model's full state dict reaches the main process only (a forward of the sharded model on the main
    process alone would wait forever for the others); it is loaded, ``strict``, into ``build_plain()`` there, and the
    other processes get ``None``. The state dict holds the persistent buffers too, so the router biases travel with
    the weights.

    Args:
        accelerator: the job's ``Accelerator`` (the Trainer's for post-training).
        model: the trained model as the job holds it (prepared by accelerate, or sharded by transformers).
        build_plain: a fresh unsharded model of the same architecture, called on the main process only.
    """
    raw = accelerator.unwrap_model(model)
    if getattr(raw, "is_distributed_loading_by_transformers", False):
        state = gather_full_state_dict(raw)  # collective: every rank takes part, rank 0 gets the tensors
    elif accelerator.is_fsdp2:
        state = accelerator.get_state_dict(model)  # collective
    else:
        return raw
    if not accelerator.is_main_process:
        return None
    plain = build_plain()
    plain.load_state_dict(state, strict=True)
    return plain
