"""The cached multi-turn rollout (:mod:`kdamoe.posttraining.rollout`, ``grpo.rollout: cached``) against TRL 1.16's
own GRPO tool loop, on the tiny base model in float32 with greedy decoding.

A tiny random model never writes a tool call, so a *logits processor* (added to every ``model.generate`` call of
both paths, which see the whole sequence so far either way) forces the tool-call turns of a scripted agent — it
reads the task and the tool results from the ids, as a careful or a one-step-short agent would — and leaves
every other token to the model's own greedy choice: the first row's reply after its last tool result and, in
tools mode, the second row's first turn run free until eos or the completion budget. The log-probabilities are
those of the model's raw logits (the processor acts after them), so TRL's training forward
(``_get_per_token_logps_and_entropies``: the whole padded batch, no cache) is an independent reference for them.
"""

import os
import re

import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining import load_posttrain_config
from kdamoe.posttraining.environments.arithmetic import ArithmeticTask
from kdamoe.posttraining.recipes import build_trainer
from kdamoe.posttraining.rollout import CachedRolloutGRPOTrainer
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

FAST = ["trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.per_device_train_batch_size=2",
        "trainer.save_strategy='no'", "trainer.num_generations=2", "data.num_tasks=4", "data.environment=arithmetic",
        "data.min_calls=1", "data.max_calls=1", "data.max_operand=5",
        "trainer.generation_kwargs={do_sample: false}", "trainer.temperature=0.7",  # greedy; log-probs at T=0.7
        "trainer.max_completion_length=96"]  # cuts the careful episode: its second tool result is dropped
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)


def _assistant_ids(tokenizer, message) -> list[int]:
    """Token ids of an assistant message as the chat template renders it after the assistant header (eos included)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, message], tokenize=False)
    text = rendered.rsplit("<|im_start|>assistant\n", 1)[1].rstrip("\n")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _call(name, **arguments):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


class ScriptedToolCalls(LogitsProcessor):
    """Forces the scripted agent's tool-call turns (module docstring); ``free_first(task)``: leave its first turn
    to the model. The agent does ``steps_of(task)`` operations, each operand read from the last tool result, then
    submits the value it has; after ``submitted`` (or in a free turn) nothing is forced."""

    def __init__(self, tokenizer, steps_of, free_first=lambda task: False):
        self.tokenizer, self.steps_of, self.free_first = tokenizer, steps_of, free_first
        user = [{"role": "user", "content": "x"}]
        with_header = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
        self.header = with_header[len(tokenizer.apply_chat_template(user, tokenize=True, return_dict=False)):]

    def _reply(self, text):
        task = ArithmeticTask.from_json(re.search(r"TASK(\{.*?\})TASK", text).group(1))
        results = _RESPONSE.findall(text)
        if (not results and self.free_first(task)) or (results and results[-1] == "submitted"):
            return None
        current = int(results[-1]) if results else task.start
        if len(results) < self.steps_of(task):
            name, operand = task.ops[len(results)]
            return _call(name, a=current, b=operand)
        return _call("submit", answer=current)

    def __call__(self, input_ids, scores):
        scores = scores.clone()  # generate keeps the raw logits (output_logits) in the tensor it passes here
        n = len(self.header)
        for row, ids in enumerate(input_ids.tolist()):
            starts = [i for i in range(len(ids) - n + 1) if ids[i:i + n] == self.header]
            done = ids[starts[-1] + n:]  # this turn's tokens so far
            reply = self._reply(self.tokenizer.decode(ids[:starts[-1]]))
            if reply is not None:
                want = _assistant_ids(self.tokenizer, reply)
                if len(done) < len(want) and done == want[:len(done)]:
                    scores[row] = -float("inf")
                    scores[row, want[len(done)]] = 0.0
        return scores


def _script(model, processor):
    generate = model.generate

    def scripted(*args, **kwargs):
        return generate(*args, logits_processor=LogitsProcessorList([processor]), **kwargs)

    model.generate = scripted


def _trainer(base_dir, tmp_path, name, rollout, processor, *overrides):
    cfg = load_posttrain_config(name, [f"model={base_dir}", f"output_dir={tmp_path / rollout}", *FAST,
                                       f"grpo.rollout={rollout}", *overrides])
    torch.manual_seed(0)
    model = KDAMoEForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    trainer = build_trainer(cfg, model, AutoTokenizer.from_pretrained(base_dir))
    _script(model, processor)
    return trainer


def _rows(trainer, tasks):
    """Dataset rows of ``tasks`` with the task JSON also in the prompt text (so the script can read it)."""
    rows = []
    for task in tasks:
        row = dict(next(r for r in trainer.train_dataset if r["task"] == task.to_json()))
        row["prompt"] = [{"role": "user", "content": row["prompt"][0]["content"] + f" TASK{task.to_json()}TASK"}]
        rows.append(row)
    return rows


def _play(trainer, rows):
    """TRL's generation step on ``rows``: ``(_generate's return, _generate_and_score_completions' output)``."""
    seen = {}
    generate = trainer._generate

    def recording(prompts):
        seen["out"] = generate(prompts)
        return seen["out"]

    trainer._generate = recording
    trainer.model.eval()
    out = trainer._generate_and_score_completions(rows)
    return seen["out"], out


def _compare(base_dir, tmp_path, name, steps_of, free_first, *overrides):
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    script = ScriptedToolCalls(tokenizer, steps_of, free_first)
    results = {}
    for rollout in ("trl", "cached"):
        trainer = _trainer(base_dir, tmp_path, name, rollout, script, *overrides)
        tasks = [t for t in map(ArithmeticTask.from_json, trainer.train_dataset["task"])][:2]
        (prompt_ids, completion_ids, tool_mask, completions, logprobs, *_), out = _play(trainer, _rows(trainer, tasks))
        results[rollout] = dict(trainer=trainer, prompt_ids=prompt_ids, completion_ids=completion_ids,
                                tool_mask=tool_mask, completions=completions, logprobs=logprobs, out=out,
                                calls=trainer._metrics["train"]["tools/call_frequency"])
    assert isinstance(results["cached"]["trainer"], CachedRolloutGRPOTrainer)
    trl, cached = results["trl"], results["cached"]
    assert trl["logprobs"] is None  # TRL's transformers path computes none; the reference is its training forward
    assert cached["prompt_ids"] == [list(p) for p in trl["prompt_ids"]]
    assert cached["completion_ids"] == trl["completion_ids"]
    assert cached["tool_mask"] == trl["tool_mask"]
    assert cached["completions"] == trl["completions"]
    assert cached["calls"] == trl["calls"]
    # log-probs: TRL's own training forward on its whole padded batch at the trainer's temperature
    o, trainer = trl["out"], trl["trainer"]
    with torch.no_grad():
        reference, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([o["prompt_ids"], o["completion_ids"]], 1),
            torch.cat([o["prompt_mask"], o["completion_mask"]], 1), o["completion_ids"].size(1))
    masks = cached["tool_mask"] or [[1] * len(c) for c in cached["completion_ids"]]  # None: no tools
    for row, (logps, mask) in enumerate(zip(cached["logprobs"], masks, strict=True)):
        assert len(logps) == len(mask) == len(trl["completion_ids"][row])
        got, want, keep = torch.tensor(logps), reference[row, :len(logps)], torch.tensor(mask).bool()
        assert torch.allclose(got[keep], want[keep], atol=1e-5, rtol=0), (row, (got - want)[keep].abs().max())
        assert (got[~keep] == 0).all()
    return results


def test_cached_rollout_equals_trl_in_environment_mode(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    # the first two tasks start at 2 and 5: row 0 submits at once (a wrong answer), row 1 computes, submits, and
    # then writes freely until eos or the budget
    results = _compare(base, tmp_path, "grpo", steps_of=lambda task: task.n_ops if task.start % 2 else 0,
                       free_first=lambda task: False)
    masks, completions = results["trl"]["tool_mask"], results["trl"]["completions"]
    assert [m.count(0) > 0 for m in masks] == [True, True]
    assert len(masks[0]) == 96 and masks[0][-1] == 1  # row 0's free text is cut by max_completion_length
    # row 1's submit result would pass the budget: dropped (the tool has run), the rollout ends on the call
    assert completions[1][-1]["tool_calls"][0]["function"]["name"] == "submit"
    environments = results["cached"]["trainer"].environments
    assert [len(e.calls) for e in environments] == [1, 2]  # the tools ran once, on the rollout's own environment


def test_cached_rollout_equals_trl_in_tools_mode(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    # row 0 writes freely from its first turn (no tool call: no tool round for it), row 1 computes and submits
    results = _compare(base, tmp_path, "grpo_tools", steps_of=lambda task: task.n_ops,
                       free_first=lambda task: task.start % 2 == 0)
    masks = results["trl"]["tool_mask"]
    assert [m.count(0) > 0 for m in masks] == [False, True]


def test_cached_rollout_equals_trl_in_single_turn_mode(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    results = _compare(base, tmp_path, "grpo_single_turn", lambda task: 0, lambda task: True,
                       "trainer.max_completion_length=12")
    assert results["trl"]["tool_mask"] is None and [len(c) for c in results["trl"]["completion_ids"]] == [12, 12]


def test_cached_rollout_feeds_each_token_once(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """Every forward of the cached path after a rollout's prompt takes at most the new tokens of its turn (the last
    sampled token + the tool turn); over a rollout the model sees each token exactly once (the last one, never fed
    by ``generate``, excepted). TRL's loop re-feeds the whole sequence every turn."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    trainer = _trainer(base, tmp_path, "grpo_tools", "cached",
                       ScriptedToolCalls(tokenizer, lambda task: task.n_ops, lambda task: task.start % 2 == 0))
    fed = []
    hook = trainer.model.register_forward_pre_hook(lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape),
                                                   with_kwargs=True)
    tasks = [ArithmeticTask.from_json(t) for t in trainer.train_dataset["task"]][:2]
    (prompt_ids, completion_ids, tool_mask, *_), _ = _play(trainer, _rows(trainer, tasks))
    hook.remove()
    assert all(shape[0] == 1 for shape in fed)  # batch 1 per rollout
    sizes = [shape[1] for shape in fed]
    assert sizes.count(len(prompt_ids[0])) >= 2 and len(prompt_ids[0]) == len(prompt_ids[1])
    tool_turns = [m.count(0) for m in tool_mask]
    assert tool_turns == [0, 23]  # the second rollout got one tool turn, of 23 tokens
    assert sorted(sizes, reverse=True)[:3] == [len(prompt_ids[0]), len(prompt_ids[1]), 1 + 23]
    assert sum(sizes) == sum(len(p) + len(c) - 1 for p, c in zip(prompt_ids, completion_ids, strict=True))


def test_rollout_setting_is_validated(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    with pytest.raises(ValueError, match=r"grpo\.rollout.*'fast'"):
        load_posttrain_config("grpo", ["grpo.rollout=fast"])
    assert load_posttrain_config("grpo").grpo.rollout == "trl"
    cfg = load_posttrain_config("grpo_long")
    assert (cfg.recipe, cfg.grpo.rollout, cfg.grpo.mode, cfg.data.environment) == ("grpo", "cached", "environment",
                                                                                   "keyhunt")
    with pytest.raises(ValueError, match="rollout_func"):
        CachedRolloutGRPOTrainer(model=None, rollout_func=lambda prompts, trainer: {})
