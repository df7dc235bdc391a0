"""Held-out evaluation of an agent in an environment: batched multi-turn episodes with tool calls.

The loop mirrors TRL's GRPO tool loop (``GRPOTrainer._tool_call_loop``, TRL 1.16) so a model is scored
the way it was trained: the prompt is rendered by the chat template with the environment's tools, each
turn is generated until the end-of-turn token, the turn is parsed with TRL's ``parse_response`` (the
tokenizer's ``response_template``), every tool call is executed on the episode's
environment (:func:`kdamoe.posttraining.data.environment_class` of the task; a raised error becomes the tool's
``{"error": ...}`` result), and the next turn continues from the token ids so far plus the rendered tool
turn — no re-tokenisation of generated text. Differences, on purpose: decoding is greedy (an evaluation,
not a rollout) unless ``do_sample``, an episode ends as soon as its final tool (``submit`` / ``take_key``) was
called (its reward is fixed then), and it also
ends when the context (``config.max_position_embeddings``) or the turn limit would be passed.

Metrics (:func:`evaluate_agent`), on the tasks that need at least ``min_calls`` tool calls before the
final ``submit`` (default 2):

* ``success``: share of episodes whose submitted value is the right answer (reward 1.0);
* ``mean_reward``: the environment's reward averaged over those episodes;
* ``multi_call_share``: share of those episodes that made at least 2 tool calls before ``submit``.
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback
from trl.chat_template_utils import parse_response

from .chat_formats import attach_response_template
from .environments import environment_class, environment_tools


def end_of_turn_ids(model, tokenizer) -> list[int]:
    """The ids that end an assistant turn, as TRL's GRPO trainer collects them: the tokenizer's ``eos_token_id`` and
    every id of the model's ``generation_config.eos_token_id``. They differ for Kimi's tokenizer, whose ``eos_token``
    is ``[EOS]`` while its turns end with ``<|im_end|>`` (the model config's eos)."""
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None) if config is not None else None
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return ids + [i for i in extra if i not in ids]


def _tool_suffix_ids(tokenizer, tool_messages: list[dict], ends: list[int] | None = None) -> list[int]:
    """Token ids of the tool turn(s) plus the next assistant header, as they follow an assistant turn that
    ended with an end-of-turn token (``ends``, default the tokenizer's eos): the rendering of ``[user, assistant
    call] + tool_messages`` with a generation prompt, minus the rendering of ``[user, assistant call]`` cut after
    its last end-of-turn token."""
    ends = [tokenizer.eos_token_id] if ends is None else ends
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(head + tool_messages, tokenize=True, return_dict=False,
                                         add_generation_prompt=True)
    eos = [i for i, t in enumerate(prefix) if t in ends]
    prefix = prefix[: eos[-1] + 1] if eos else prefix
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving around tool turns")
    return full[len(prefix):]


def _run_tool_calls(env, tool_calls: list[dict]) -> list[dict]:
    tools = {t.__name__: t for t in environment_tools(env)}
    messages = []
    for call in tool_calls:
        function = call.get("function", {})
        name = function.get("name", "unknown")
        try:
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            result = tools[name](**(function.get("arguments") or {}))
        except Exception as err:  # the model sees the error, as in TRL's loop
            result = {"error": str(err)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages


@torch.no_grad()
def run_episodes(model, tokenizer, tasks: list, *, batch_size: int = 64, max_new_tokens: int = 64,
                 max_turns: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                 seed: int = 0) -> list[dict]:
    """Multi-turn episodes, one per task, in batches: greedy, or sampled (``do_sample``) at ``temperature``
    from a generator seeded with ``seed`` (the same tasks and seed give the same episodes).

    Args:
        model: a causal LM (``KDAMoEForCausalLM`` or the remote-code class); put in eval mode here.
        tokenizer: its tokenizer with its chat template; without a ``response_template`` it gets one here when
            its format is known (:func:`~kdamoe.posttraining.chat_formats.attach_response_template`: Kimi's).
            A turn ends at any of :func:`end_of_turn_ids`.
        tasks: the tasks.
        batch_size: episodes generated together (left padding).
        max_new_tokens: tokens per assistant turn.
        max_turns: assistant turns per episode (default: the task's ``calls_needed + 2``).
    Returns:
        One dict per task, in order: ``task`` (the task), ``reward``, ``calls_before_submit``,
        ``tool_calls``, ``turns``, ``tokens`` (final sequence length), ``ended`` (``"done"`` (the final tool),
        ``"no_tool_call"``, ``"context"`` or ``"turns"``).
    Raises:
        ValueError: ``batch_size`` / ``max_new_tokens`` < 1, a tokenizer without ``response_template`` whose
            format is unknown.
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if do_sample:
        torch.manual_seed(seed)
    attach_response_template(tokenizer, needs_tool_calls=True)
    ends = end_of_turn_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    limit = model.config.max_position_embeddings
    pad = tokenizer.pad_token_id
    results = []
    for start in range(0, len(tasks), batch_size):
        batch = tasks[start:start + batch_size]
        envs = [environment_class(task)() for task in batch]
        for env, task in zip(envs, batch, strict=True):
            env.reset(task=task)
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t.prompt()}], tools=environment_tools(e),
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for t, e in zip(batch, envs, strict=True)]
        prompt_lengths = [len(x) for x in ids]
        turns, ended = [0] * len(batch), [None] * len(batch)
        active = list(range(len(batch)))
        while active:
            for i in list(active):
                cap = batch[i].calls_needed + 2 if max_turns is None else max_turns
                if turns[i] >= cap:
                    ended[i] = "turns"
                elif len(ids[i]) + max_new_tokens > limit:
                    ended[i] = "context"
            active = [i for i in active if ended[i] is None]
            if not active:
                break
            width = max(len(ids[i]) for i in active)
            input_ids = torch.full((len(active), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(active), width), dtype=torch.long)
            for row, i in enumerate(active):
                input_ids[row, width - len(ids[i]):] = torch.tensor(ids[i])
                attention_mask[row, width - len(ids[i]):] = 1
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 max_new_tokens=max_new_tokens, do_sample=do_sample,
                                 temperature=temperature if do_sample else None, top_k=None, top_p=None,
                                 eos_token_id=ends[0] if len(ends) == 1 else ends, pad_token_id=pad)
            for row, i in enumerate(active):
                generated = out[row, width:].tolist()
                end = next((k for k, t in enumerate(generated) if t in ends), None)
                if end is not None:
                    generated = generated[: end + 1]
                else:
                    generated = [t for t in generated if t != pad]
                message = parse_response(tokenizer, generated, prefix=ids[i], tools=environment_tools(envs[i]))
                ids[i] = ids[i] + generated
                turns[i] += 1
                calls = message.get("tool_calls") if isinstance(message, dict) else None
                if not calls:
                    ended[i] = "no_tool_call"
                    continue
                tool_messages = _run_tool_calls(envs[i], calls)
                if envs[i].done:
                    ended[i] = "done"
                    continue
                ids[i] = ids[i] + _tool_suffix_ids(tokenizer, tool_messages, ends)
            active = [i for i in active if ended[i] is None]
        for i, (task, env) in enumerate(zip(batch, envs, strict=True)):
            results.append(dict(task=task, reward=env.get_reward(),
                                calls_before_submit=env.tool_calls_before_submit, tool_calls=len(env.calls),
                                turns=turns[i], tokens=len(ids[i]), prompt_tokens=prompt_lengths[i], ended=ended[i]))
    model.train(was_training)
    return results


def summarize_episodes(episodes: list[dict], min_calls: int = 2) -> dict:
    """The metrics of the module docstring over the episodes whose task needs ``>= min_calls`` tool calls,
    plus ``n`` (their number) and ``success_all`` / ``mean_reward_all`` over every episode.

    Raises:
        ValueError: no episode has a task that needs ``>= min_calls`` tool calls.
    """
    multi = [e for e in episodes if e["task"].calls_needed >= min_calls]
    if not multi:
        raise ValueError(f"no episode needs >= {min_calls} tool calls; cannot report success on them")

    def mean(values):
        values = list(values)
        return sum(values) / len(values)

    return dict(n=len(multi), success=mean(e["reward"] == 1.0 for e in multi),
                mean_reward=mean(e["reward"] for e in multi),
                multi_call_share=mean(e["calls_before_submit"] >= 2 for e in multi),
                n_all=len(episodes), success_all=mean(e["reward"] == 1.0 for e in episodes),
                mean_reward_all=mean(e["reward"] for e in episodes))


def evaluate_agent(model, tokenizer, tasks: list, *, min_calls: int = 2, **kwargs) -> dict:
    """:func:`run_episodes` then :func:`summarize_episodes`; adds ``seconds`` (wall time of the episodes)."""
    start = time.perf_counter()
    episodes = run_episodes(model, tokenizer, tasks, **kwargs)
    return {**summarize_episodes(episodes, min_calls=min_calls), "seconds": round(time.perf_counter() - start, 1)}


class HeldOutSuccessCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that scores the policy on held-out tasks at chosen optimizer steps and
    logs the result through the Trainer: into ``state.log_history`` and the ``logs`` every ``report_to``
    integration (TensorBoard) receives.

    At each step of ``steps`` (``on_step_end``) it plays :func:`run_episodes` on ``tasks`` with the policy being
    trained (sampled at ``temperature`` from ``seed``, under ``torch.random.fork_rng`` so the training's own random
    stream is the same as without the callback) and asks the Trainer to log that step; ``on_log`` adds
    ``heldout/success``, ``heldout/mean_reward`` and ``heldout/multi_call_share`` (the :func:`summarize_episodes`
    metrics, fractions in ``[0, 1]``) to that step's ``logs`` and to its ``log_history`` row. Integrations see
    them only if this callback comes before them in the Trainer's callback list
    (:func:`kdamoe.posttraining.run.run_recipe`'s ``callbacks`` puts it there).

    Args:
        tokenizer: the policy's tokenizer (with ``response_template``).
        tasks: held-out tasks; at least one needs ``>= min_calls`` tool calls.
        steps: optimizer steps (``>= 1``) after which to evaluate.
        seed, temperature, batch_size, max_new_tokens, min_calls: as in :func:`run_episodes` /
            :func:`summarize_episodes` (sampled episodes; ``do_sample=True``).
    Attributes:
        points: ``[(step, metrics dict)]`` in step order; ``metrics`` also holds ``successes`` (one 0/1 per task
            that needs ``>= min_calls`` calls, in task order) and ``seconds`` (wall time of that evaluation).
        seconds: total wall time spent evaluating (seconds), to subtract from the training's own.
    Raises:
        ValueError: no tasks, a step below 1.
    """

    def __init__(self, tokenizer, tasks: list, steps, *, seed: int = 0, temperature: float = 1.0,
                 batch_size: int = 64, max_new_tokens: int = 64, min_calls: int = 2):
        if not tasks:
            raise ValueError("HeldOutSuccessCallback needs at least one held-out task")
        steps = sorted({int(s) for s in steps})
        if steps and steps[0] < 1:
            raise ValueError(f"steps must be >= 1, got {steps[0]}")
        self.tokenizer, self.tasks, self.steps = tokenizer, list(tasks), steps
        self.seed, self.temperature, self.batch_size = seed, temperature, batch_size
        self.max_new_tokens, self.min_calls = max_new_tokens, min_calls
        self.points: list[tuple[int, dict]] = []
        self.seconds = 0.0
        self._pending: dict[str, float] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step not in self.steps:
            return control
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            episodes = run_episodes(model, self.tokenizer, self.tasks, batch_size=self.batch_size,
                                    max_new_tokens=self.max_new_tokens, do_sample=True,
                                    temperature=self.temperature, seed=self.seed)
        metrics = summarize_episodes(episodes, min_calls=self.min_calls)
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        successes = [int(e["reward"] == 1.0) for e in episodes if e["task"].calls_needed >= self.min_calls]
        self.points.append((state.global_step, {**metrics, "successes": successes, "seconds": round(elapsed, 1)}))
        self._pending = {f"heldout/{k}": float(metrics[k]) for k in ("success", "mean_reward", "multi_call_share")}
        control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._pending:
            return control
        row = state.log_history[-1] if state.log_history else None
        if row is not None and row.get("step") == state.global_step:
            row.update(self._pending)  # the row Trainer.log stored for these logs
        logs.update(self._pending)
        self._pending = {}
        return control
