"""Cached multi-turn rollouts for TRL's ``GRPOTrainer``: each turn prefills only its new tokens on the kept cache.

TRL 1.16's tool loop (``GRPOTrainer._tool_call_loop``) re-submits the whole token sequence every turn — prompt,
every earlier turn, the new tool result — to a fresh ``model.generate``, so an episode of ``n`` turns and length
``L`` prefills ``O(n·L)`` tokens. A kdamoe model keeps an ``O(1)`` state per KDA layer and a small latent cache per
MLA layer (:class:`kdamoe.KDAMoECache`), and a continuation from a returned cache equals a re-prefill
(docs/long-context.md, "The latent-only MLA cache"). :func:`cached_rollout` plays the same episodes as TRL's loop
but keeps each rollout's cache from turn to turn: a turn feeds the model the previous turn's last sampled token
(``generate`` never feeds it), the tool-result tokens and the next assistant header — nothing else.

What it reproduces of TRL's loop (``trl/trainer/grpo_trainer.py``, ``_generate`` / ``_tool_call_loop`` /
``_get_tool_suffix_ids``), so that greedy decoding gives the same tokens:

* the prompt ids are TRL's own ``_tokenize_prompts`` (chat template with each rollout's tools);
* generation uses the trainer's ``generation_config`` (temperature, top-k/p, min-p, repetition penalty, the eos
  ids, ``generation_kwargs``) under TRL's ``unwrap_model_for_generation``; a turn ends at the first eos;
* tool calls are parsed with TRL's ``parse_response`` against the ids before the turn and the rollout's tools;
  each call runs on the rollout's tool dict (``trainer._sync_tool_dicts``: the standalone ``tools=`` and the
  methods of its ``environment_factory`` instance); a raised error becomes ``{"error": str(err)}``, an unknown
  name ``"Tool <name> not found."``; a result becomes ``{"role": "tool", "name", "content": str(result)}``;
* the tool-turn ids are TRL's ``_get_tool_suffix_ids`` of the turn's tool messages;
* a tool result that would push the completion past ``max_completion_length``, or the sequence to
  ``max_position_embeddings``, is dropped and the rollout ends; a later turn is cut so the whole completion stays
  within ``max_completion_length``; at most ``max_tool_calling_iterations`` tool rounds;
* ``tool_mask`` is 1 on generated tokens and 0 on tool-turn tokens; ``logprobs`` are 0.0 on tool-turn tokens.

Log-probabilities: ``log_softmax(logits / temperature)`` of the model's raw logits (``output_logits``, before the
sampling processors) at the sampled token, float32 — what TRL's training forward scores (its fused LM head at
``args.temperature``). TRL's own transformers path returns none (``logprobs=None``); with these, TRL's off-policy
mask (``off_policy_mask_threshold``) reads the sampling-time values instead of a recomputed forward.

Batching: rollouts run one at a time (batch 1 per trajectory): rows of a batch reach their turn boundaries at
different lengths, and a batch-1 cache needs no padding in the KDA recurrence. TRL's loop batches the rows of a
turn; the two agree on tokens (greedy) and log-probs to float32 rounding (``tests/test_rollout.py``). To decode many
episodes together, use :func:`batched_rollout` (``grpo.rollout: batched``, :mod:`kdamoe.posttraining.engine`).

Why a trainer subclass as well as ``rollout_func``: TRL 1.16's ``_generate`` calls ``rollout_func(prompts, trainer)``
whether or not vLLM is used, but when the trainer has tools (``tools=`` or ``environment_factory=``) it then runs
its own ``_tool_call_loop`` on the returned completions — it would execute every tool call again and re-generate —
and it reads a rollout's ``env_mask`` only without tools. :class:`CachedRolloutGRPOTrainer` overrides that one
method to return the turns :func:`cached_rollout` already played (tool mask, conversational completions, tool-call
counts). Everything else — environments and their ``reset`` from the dataset row, the environment's
``get_reward`` as a reward, the ``environments`` passed to reward functions, metrics, the loss — is TRL's.

Cost per turn of ``t`` new tokens after ``L`` cached ones: the KDA layers do ``O(t)`` work (their state does not
grow); the MLA layers do ``O(t)`` projections and read the ``L`` cached latents once per new token (``O(t·L)``
attention reads, against ``O((L + t)²)`` for a re-prefill).

Seeds: each episode samples from its own seed, :func:`rollout_seeds` (the run's ``args.seed``, the rollout call, the
process, the episode's row), under ``torch.random.fork_rng`` — so an episode's tokens depend on nothing else that
runs, and ``grpo.rollout: batched`` (:func:`batched_rollout`, :class:`BatchedRolloutGRPOTrainer`: the same episodes
played together on :class:`~kdamoe.posttraining.engine.RolloutEngine` cache slots) reproduces them.
"""

from __future__ import annotations

import copy

import torch
from trl import GRPOTrainer
from trl.chat_template_utils import parse_response
from trl.models import unwrap_model_for_generation

from .engine import EpisodeSpec, RolloutEngine, episode_seed


def _check_trainer(trainer, rollout: str = "cached") -> None:
    """Refuse the TRL set-ups the cached and batched paths do not run (each with a ``ValueError`` naming it)."""
    if trainer.use_vllm:
        raise ValueError(f"grpo.rollout='{rollout}' generates with the policy itself; use_vllm=True is not supported")
    if trainer.use_transformers_continuous_batching:
        raise ValueError(f"grpo.rollout='{rollout}' keeps its own caches; "
                         "use_transformers_continuous_batching=True is not supported")
    if trainer._is_vlm:
        raise ValueError(f"grpo.rollout='{rollout}' supports text models only (the processing class is a processor)")


def rollout_seeds(trainer, count: int) -> list[int]:
    """One sampling seed per episode of this rollout call: :func:`~kdamoe.posttraining.engine.episode_seed` of the
    run's ``args.seed``, the number of rollout calls so far on this trainer (counted here), the process index and
    the episode's row — the same for ``grpo.rollout: cached`` and ``batched`` given the same run."""
    trainer._rollout_calls = getattr(trainer, "_rollout_calls", 0) + 1
    rank = trainer.accelerator.process_index
    return [episode_seed(trainer.args.seed, trainer._rollout_calls, rank, i) for i in range(count)]


def _turn_cap(trainer, left: int) -> int:
    """Tokens of a turn: what is left of the completion budget, at most ``generation_config.max_new_tokens`` (TRL
    generates every turn with that config; its default is the whole budget)."""
    per_turn = trainer.generation_config.max_new_tokens
    return min(left, per_turn) if per_turn else left


def _generate_turn(model, trainer, ids: list[int], cache, max_new_tokens: int):
    """One assistant turn of one rollout, continuing ``cache`` (``None`` on the first turn: ``generate`` builds a
    :class:`~kdamoe.KDAMoECache`).

    Args:
        ids: the rollout's whole token sequence so far; ``generate`` feeds only what ``cache`` has not seen (the
            previous turn's last sampled token and the tool-turn tokens).
        max_new_tokens: at least 1.
    Returns:
        ``(new token ids up to and including the first eos, their log-probs at the trainer's temperature (floats),
        the cache)``.
    """
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    config = copy.deepcopy(trainer.generation_config)
    config.update(max_new_tokens=max_new_tokens, return_dict_in_generate=True, output_logits=True)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                         generation_config=config)
    new = out.sequences[0, len(ids):]
    is_eos = torch.isin(new, torch.tensor(trainer.eos_token_ids, device=device))
    if is_eos.any():
        new = new[: int(is_eos.int().argmax()) + 1]
    logits = torch.stack(out.logits[: len(new)], dim=1)[0].float()  # [T, V]
    logps = torch.log_softmax(logits / trainer.temperature, dim=-1).gather(-1, new[:, None])[:, 0]
    return new.tolist(), logps.tolist(), out.cache


def _run_tool_calls(tool_calls: list[dict], tools: dict) -> tuple[list[dict], int]:
    """Execute a turn's tool calls as TRL's loop does; returns ``(tool messages, number of failed calls)``."""
    messages, failures = [], 0
    for call in tool_calls:
        if call["type"] == "function":
            function = call["function"]
            name = function["name"]
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")
                result = tools[name](**function["arguments"])
            except Exception as err:  # the model reads the error as the tool's result, as in TRL
                failures += 1
                result = {"error": str(err)}
        else:
            failures += 1
            name = call.get("name", "unknown")
            result = {"error": f"Unsupported tool call type: {call['type']}"}
        messages.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
    return messages, failures


def _episode(model, trainer, prompt_ids: list[int], schemas, tools: dict | None) -> dict:
    """One rollout: the first turn, then tool rounds while the last turn called a tool (module docstring)."""
    budget = trainer.max_completion_length
    max_model_len = trainer.model.config.max_position_embeddings
    completion, logprobs, cache = _generate_turn(model, trainer, prompt_ids, None, _turn_cap(trainer, budget))
    mask = [1] * len(completion)
    if tools is None:  # no tool loop: TRL parses the completion itself
        return dict(completion_ids=completion, logprobs=logprobs)
    messages = [parse_response(trainer._tokenizer, completion, prefix=prompt_ids, tools=schemas)]
    calls = failures = rounds = 0
    while messages[-1].get("tool_calls") and rounds < trainer.max_tool_calling_iterations:
        tool_messages, failed = _run_tool_calls(messages[-1]["tool_calls"], tools)
        calls, failures = calls + len(messages[-1]["tool_calls"]), failures + failed
        suffix = trainer._get_tool_suffix_ids(tool_messages)
        before = prompt_ids + completion + suffix
        if len(completion) + len(suffix) > budget or len(before) >= max_model_len:
            break  # TRL drops this tool result; the rollout ends with its completion as it is
        messages += tool_messages
        left = budget - len(completion) - len(suffix)
        new, new_logprobs, cache = (_generate_turn(model, trainer, before, cache, _turn_cap(trainer, left)) if left > 0
                                    else ([], [], cache))
        completion, mask = before[len(prompt_ids):] + new, mask + [0] * len(suffix) + [1] * len(new)
        logprobs = logprobs + [0.0] * len(suffix) + new_logprobs
        reply = parse_response(trainer._tokenizer, new, prefix=before, tools=schemas) if new else {}
        if reply:
            messages.append(reply)
        rounds += 1
        if not reply:
            break
    return dict(completion_ids=completion, logprobs=logprobs, tool_mask=mask, completion=messages,
                tool_calls=calls, tool_failures=failures)


def _episode_inputs(prompts: list, trainer, rollout: str, allow_async: bool):
    """``(prompt ids, per-episode tool schemas, per-episode tool dicts)`` of TRL's batch (module docstring).

    Raises:
        ValueError: tools with a trainer that is not a :class:`CachedRolloutGRPOTrainer`, or async tools where
            ``allow_async`` is false.
    """
    has_tools = bool(trainer.tools)
    if has_tools and not isinstance(trainer, CachedRolloutGRPOTrainer):
        raise ValueError(f"{rollout}_rollout with tools needs {'Cached' if rollout == 'cached' else 'Batched'}"
                         "RolloutGRPOTrainer: GRPOTrainer would run its own tool loop on the finished rollouts")
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    prompt_ids = [list(ids) for ids in prompt_ids]
    schemas, tools = [None] * len(prompts), [None] * len(prompts)
    if has_tools:  # what TRL's loop would use for rollout i: its schemas (parsing) and its tool dict (calls)
        for i in range(len(prompts)):
            if trainer._async_tool_dicts[i] and not allow_async:
                raise ValueError(f"grpo.rollout='{rollout}' runs sync tools only; async: "
                                 f"{sorted(trainer._async_tool_dicts[i])}")
            envs = trainer.environment_factories is not None
            schemas[i] = trainer._env_tools[trainer._batch_environments[i]] if envs else trainer.tools
            tools[i] = {**trainer._sync_tool_dicts[i], **trainer._async_tool_dicts[i]}
    return prompt_ids, schemas, tools


def _generation_context(trainer):
    """TRL's context for generating with the policy: unwrapped (DeepSpeed / DDP), FSDP's parameters gathered."""
    args = trainer.args
    return (unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                        gather_deepspeed3_params=args.ds3_gather_for_generation,
                                        generation_kwargs=trainer.generation_kwargs,
                                        gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs),
            trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False))


def _rollout_output(trainer, prompt_ids, episodes, has_tools) -> dict:
    if has_tools:
        trainer._cached_turns = episodes
    return dict(prompt_ids=prompt_ids, completion_ids=[e["completion_ids"] for e in episodes],
                logprobs=[e["logprobs"] for e in episodes])


def cached_rollout(prompts: list, trainer) -> dict:
    """TRL ``rollout_func``: one multi-turn rollout per prompt, each continuing its own cache (module docstring).

    Args:
        prompts: TRL's per-process prompts, one per rollout (the sampler already repeats each ``num_generations``
            times), conversational (lists of messages, with the environments' ``reset`` observations applied).
        trainer: the :class:`CachedRolloutGRPOTrainer` calling it.
    Returns:
        ``{"prompt_ids", "completion_ids", "logprobs"}``: lists of per-rollout lists (token ids; float32
        log-probs, 0.0 on tool-turn tokens). The tool mask, the conversational completions and the tool-call
        counts go to the trainer's ``_tool_call_loop`` (they are not reward inputs).
    Raises:
        ValueError: vLLM, continuous batching, a vision-language processor, async tools, or a trainer that is not
            a :class:`CachedRolloutGRPOTrainer` while it has tools.
    """
    _check_trainer(trainer)
    prompt_ids, schemas, tools = _episode_inputs(prompts, trainer, "cached", allow_async=False)
    seeds = rollout_seeds(trainer, len(prompt_ids))
    unwrap, gathered = _generation_context(trainer)
    with unwrap as model, torch.no_grad(), gathered:
        devices = [next(model.parameters()).device] if next(model.parameters()).is_cuda else []
        episodes = []
        for i, ids in enumerate(prompt_ids):
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seeds[i])
                episodes.append(_episode(model, trainer, ids, schemas[i], tools[i]))
    return _rollout_output(trainer, prompt_ids, episodes, bool(trainer.tools))


def batched_rollout(prompts: list, trainer) -> dict:
    """TRL ``rollout_func`` of ``grpo.rollout: batched``: the episodes of :func:`cached_rollout`, played together on
    a :class:`~kdamoe.posttraining.engine.RolloutEngine` of ``trainer.rollout_slots`` cache slots (0: one per
    episode), GRPO groups prefilling their prompt once, tools on worker threads with ``trainer.tool_timeout_s``.

    Same arguments and return as :func:`cached_rollout`; async tools are awaited. A tool call that times out ends
    its episode and takes its environment out of TRL's pool (a fresh instance replaces it in the next batch). The
    engine's counters (``RolloutEngine.stats``: steps, sequences, prefill / decode tokens, forks, tool rounds,
    seconds idle on tools, seconds in forwards, idle steps) go to ``trainer.rollout_engine_stats`` and TRL's logged
    metrics as ``rollout/<name>``. With the policy sharded over the processes (FSDP2, ``distributed_config``) every
    process's engine steps in lockstep with the others (:func:`lockstep_group`; each process still plays its own
    episodes, as alone).

    Raises:
        ValueError: vLLM, continuous batching, a vision-language processor, or a trainer that is not a
            :class:`BatchedRolloutGRPOTrainer` while it has tools.
    """
    _check_trainer(trainer, "batched")
    prompt_ids, schemas, tools = _episode_inputs(prompts, trainer, "batched", allow_async=True)
    seeds = rollout_seeds(trainer, len(prompt_ids))
    specs = [EpisodeSpec(ids, tools=tools[i], schemas=schemas[i], seed=seeds[i], on_timeout=_retire(trainer, i))
             for i, ids in enumerate(prompt_ids)]
    has_tools = bool(trainer.tools)
    unwrap, gathered = _generation_context(trainer)
    with unwrap as model, torch.no_grad(), gathered:
        lockstep = lockstep_group(trainer, model)
        engine = RolloutEngine(
            model, trainer.generation_config, num_slots=getattr(trainer, "rollout_slots", 0) or len(specs),
            eos_token_ids=trainer.eos_token_ids, max_completion_length=trainer.max_completion_length,
            logprob_temperature=trainer.temperature,
            max_tool_calling_iterations=trainer.max_tool_calling_iterations if has_tools else None,
            max_position_embeddings=trainer.model.config.max_position_embeddings,
            parse_turn=lambda ids, prefix, schemas: parse_response(trainer._tokenizer, ids, prefix=prefix,
                                                                   tools=schemas),
            tool_suffix_ids=trainer._get_tool_suffix_ids, tool_timeout_s=getattr(trainer, "tool_timeout_s", None),
            tokenizer=trainer._tokenizer, lockstep_group=lockstep)
        episodes = engine.run(specs)
    trainer.rollout_engine_stats = dict(engine.stats)
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    for key, value in engine.stats.items():  # logged with TRL's metrics (averaged over the logging interval)
        metrics[f"rollout/{key}"].append(float(value))
    return _rollout_output(trainer, prompt_ids, episodes, has_tools)


def lockstep_group(trainer, model):
    """The process group whose ranks must step their engines together (``RolloutEngine(lockstep_group=...)``), or
    None: the whole world when the policy is sharded over several processes — by accelerate's FSDP2
    (``trainer.fsdp``; the Trainer's ``is_fsdp_enabled``) or by transformers' engine while it loaded
    (``distributed_config``; the model's ``is_distributed_loading_by_transformers``) — since each of its forwards is
    a collective; None on one process and under DDP (every rank holds the whole model and steps alone)."""
    if trainer.accelerator.num_processes < 2:
        return None
    raw = model.get_base_model() if hasattr(model, "get_base_model") else model
    sharded = getattr(trainer, "is_fsdp_enabled", False) or getattr(raw, "is_distributed_loading_by_transformers",
                                                                    False)
    return torch.distributed.group.WORLD if sharded else None


def _retire(trainer, i: int):
    """The ``on_timeout`` of rollout ``i``: take its environment out of TRL's pool (its abandoned tool call may still
    be running on it), so the next batch draws a fresh ``environment_factory`` instance instead."""
    def retire():
        environments = getattr(trainer, "environments", None)
        if not environments:
            return
        env = environments[i]
        for pool in getattr(trainer, "_environment_pool", {}).values():
            pool[:] = [e for e in pool if e is not env]

    return retire


class CachedRolloutGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with :func:`cached_rollout` as its ``rollout_func`` (module docstring: why a subclass).

    Takes every ``GRPOTrainer`` argument except ``rollout_func``.

    Raises:
        ValueError: a ``rollout_func`` is passed.
    """

    rollout_function = staticmethod(cached_rollout)

    def __init__(self, *args, **kwargs):
        if kwargs.get("rollout_func") is not None:
            raise ValueError(f"{type(self).__name__} plays its own rollouts; got "
                             f"rollout_func={kwargs['rollout_func']!r}")
        kwargs["rollout_func"] = self.rollout_function
        super().__init__(*args, **kwargs)
        self._cached_turns = None

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """The turns :func:`cached_rollout` played for this batch, in TRL's return layout: ``(tool_mask,
        completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images)``.

        Raises:
            ValueError: no cached rollout is pending, or its ids are not the batch's (a caller other than TRL's
                ``_generate`` right after ``rollout_func``).
        """
        episodes, self._cached_turns = self._cached_turns, None
        if episodes is None or [e["completion_ids"] for e in episodes] != [list(c) for c in completion_ids]:
            raise ValueError("_tool_call_loop: no cached rollout of this batch is pending")
        return ([e["tool_mask"] for e in episodes], [e["completion"] for e in episodes], completion_ids,
                [e["logprobs"] for e in episodes], sum(e["tool_calls"] for e in episodes),
                sum(e["tool_failures"] for e in episodes), [[] for _ in episodes])



class BatchedRolloutGRPOTrainer(CachedRolloutGRPOTrainer):
    """``GRPOTrainer`` with :func:`batched_rollout` as its ``rollout_func`` (``grpo.rollout: batched``): the hook,
    the ``_tool_call_loop`` and the returned fields of :class:`CachedRolloutGRPOTrainer`.

    Args:
        rollout_slots: cache slots of the engine (episodes decoded together); 0 = one per episode of the batch.
        tool_timeout_s: seconds one tool call may run before its episode ends (None: no limit).
        Every other ``GRPOTrainer`` argument except ``rollout_func``.
    Raises:
        ValueError: a ``rollout_func`` is passed, ``rollout_slots`` < 0 or ``tool_timeout_s`` <= 0.
    """

    rollout_function = staticmethod(batched_rollout)

    def __init__(self, *args, rollout_slots: int = 0, tool_timeout_s: float | None = None, **kwargs):
        if isinstance(rollout_slots, bool) or not isinstance(rollout_slots, int) or rollout_slots < 0:
            raise ValueError(f"rollout_slots must be an integer >= 0 (0: one per episode), got {rollout_slots!r}")
        if tool_timeout_s is not None and not tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be None or > 0 seconds, got {tool_timeout_s!r}")
        self.rollout_slots, self.tool_timeout_s = rollout_slots, tool_timeout_s
        self.rollout_engine_stats = None
        super().__init__(*args, **kwargs)
