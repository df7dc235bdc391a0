"""The shipped recipes on a base folder that carries Kimi's tokenizer and chat format (a converted Kimi Linear model):
one SFT step and one GRPO step (environment mode, TRL's own tool loop) through :func:`run_recipe`, the function
``kdamoe-posttrain`` runs.

The tokenizer is :func:`tests.kimi_tokenizer.build_kimi_tokenizer` (Kimi's special tokens, ids and flags, its chat
format; ``eos_token`` ``[EOS]`` while the model config's ``eos_token_id`` is ``<|im_end|>``, as released). A tiny
random model never writes a tool call, so the GRPO test replaces ``generate`` with a scripted agent that writes Kimi
tool calls (``<|tool_calls_section_begin|>...``) as the chat template renders them: in a group of two rollouts of one
prompt, the first does the task's operation with the tool and submits the tool's result, the second submits the
start value at once. Their environment rewards (1.0 and 0.0, the environment's rule) differ, so the step moves the
weights. What is checked: the step ran (finite loss, weights moved), the tool calls were parsed and executed (the
tool-result turn, with the value only the tool computed, sits in the completion where the tool mask is 0), and
``final/`` carries the base folder's tokenizer files and chat template.

Two base folders: a KDAMoE model saved with the Kimi tokenizer, and a tiny transformers ``KimiLinearForCausalLM``
saved with it and converted by ``kdamoe.conversion.convert_checkpoint(..., to="kda_moe")``, which carries the
tokenizer files over. On the first also: GRPO with cached rollouts (``grpo.rollout: cached``, a logits processor
forcing the scripted turns on the model's own ``generate``) and the held-out evaluation (:func:`run_episodes`).
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, KimiLinearConfig, KimiLinearForCausalLM, LogitsProcessor, LogitsProcessorList
from trl import GRPOTrainer

from kdamoe import KDAMoEForCausalLM
from kdamoe.conversion import convert_checkpoint
from kdamoe.posttraining import load_posttrain_config, run_recipe
from kdamoe.posttraining.agent import run_episodes
from kdamoe.posttraining.environments import tool_schemas
from kdamoe.posttraining.environments.arithmetic import ArithmeticEnvironment, ArithmeticTask, make_tasks
from tests.helpers import tiny_config
from tests.kimi_tokenizer import SPECIAL, build_kimi_tokenizer, kimi_token_id

FAST = ["trainer.max_steps=1", "trainer.warmup_steps=0", "trainer.per_device_train_batch_size=2",
        "trainer.save_strategy='no'", "trainer.learning_rate=1e-2", "data.num_tasks=2", "data.environment=arithmetic",
        "data.min_calls=1", "data.max_calls=1", "data.max_operand=5"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
IM_END = 2  # offset of <|im_end|> among the reserved ids


def _texts():
    """What the small BPE learns its merges from: task prompts, the tool schemas and Kimi's call / result text."""
    tasks = make_tasks(30, seed=5, max_ops=2, max_operand=5)
    return [t.prompt() + ' functions.add:0 {"a": 3, "b": 4} ## Return of functions.submit:1 submitted Done.'
            for t in tasks] + [json.dumps(tool_schemas(ArithmeticEnvironment))] * 3


@pytest.fixture(scope="module")
def kimi_tokenizer():
    return build_kimi_tokenizer(_texts(), base_vocab_size=400)


def _ids(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=kimi_token_id(tokenizer, IM_END))


@pytest.fixture(scope="module")
def kdamoe_base(tmp_path_factory, kimi_tokenizer):
    """A tiny KDAMoE folder saved with the Kimi tokenizer."""
    folder = tmp_path_factory.mktemp("kimi_tok_base")
    torch.manual_seed(0)
    config = tiny_config(**_ids(kimi_tokenizer), max_position_embeddings=2048, kda_head_dim=16)
    KDAMoEForCausalLM(config).save_pretrained(folder)
    kimi_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def converted_base(tmp_path_factory, kimi_tokenizer):
    """A tiny random transformers Kimi Linear folder with the Kimi tokenizer, converted to a kdamoe folder."""
    src, dst = tmp_path_factory.mktemp("kimi_linear_src"), tmp_path_factory.mktemp("kimi_linear_converted")
    torch.manual_seed(0)
    raw = dict(  # the key names of the released config.json
        model_type="kimi_linear", **_ids(kimi_tokenizer), hidden_size=32, intermediate_size=32,
        moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, moe_renormalize=True, num_expert_group=1, topk_group=1,
        mla_use_nope=True, model_max_length=2048, hidden_act="silu", first_k_dense_replace=1,
        linear_attn_config=dict(full_attn_layers=[4], kda_layers=[1, 2, 3], num_heads=2, head_dim=16,
                                short_conv_kernel_size=4))
    config = KimiLinearConfig.from_dict(raw)
    KimiLinearForCausalLM(config).save_pretrained(src)
    kimi_tokenizer.save_pretrained(src)
    convert_checkpoint(src, dst, to="kda_moe")
    for name in TOKENIZER_FILES:  # the recipes read the tokenizer from the model folder
        assert (Path(dst) / name).read_bytes() == (Path(src) / name).read_bytes(), name
    return dst


@pytest.fixture(params=["kdamoe_base", "converted_base"])
def base(request):
    return request.getfixturevalue(request.param)


def _weights(folder) -> dict:
    return load_file(str(Path(folder) / "model.safetensors"))


def _moved(before: dict, after: dict) -> float:
    return max((after[n].float() - before[n].float()).abs().max().item() for n in before if n in after)


def _carries_tokenizer(base, final):
    for name in TOKENIZER_FILES[1:]:
        assert (Path(final) / name).is_file(), name
    assert (Path(final) / "chat_template.jinja").read_text() == (Path(base) / "chat_template.jinja").read_text()
    saved, own = (json.loads((Path(d) / "tokenizer_config.json").read_text()) for d in (final, base))
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "added_tokens_decoder"):
        assert saved.get(key) == own.get(key), key
    assert json.loads((Path(final) / "tokenizer.json").read_text())["added_tokens"] == \
        json.loads((Path(base) / "tokenizer.json").read_text())["added_tokens"]


def _stops_at_im_end(final, tokenizer):
    """The saved generation config still ends a turn at <|im_end|> (transformers' Trainer adds the tokenizer's own
    eos, [EOS], to it: ``align_special_tokens``), and config.json keeps <|im_end|> as its eos."""
    eos = json.loads((Path(final) / "generation_config.json").read_text())["eos_token_id"]
    assert kimi_token_id(tokenizer, IM_END) in (eos if isinstance(eos, list) else [eos])
    # and config.json keeps the base's eos, as Kimi's release has it (what a conversion back to Kimi Linear reads)
    assert json.loads((Path(final) / "config.json").read_text())["eos_token_id"] == kimi_token_id(tokenizer, IM_END)


def test_sft_step_on_the_folders_own_kimi_tokenizer(base, tmp_path, kimi_tokenizer):
    cfg = load_posttrain_config("sft", [f"model={base}", f"output_dir={tmp_path / 'sft'}", *FAST])
    result = run_recipe(cfg)
    assert result["global_step"] == 1
    loss = result["log_history"][-1]["train_loss"]  # the run's mean: its only step
    assert math.isfinite(loss) and loss > 0
    assert _moved(_weights(base), _weights(result["final"])) > 0
    _carries_tokenizer(base, result["final"])
    _stops_at_im_end(result["final"], kimi_tokenizer)

    # what it was trained on: the assistant turns in Kimi's format, each ending with <|im_end|>, and nothing else
    trainer = result["trainer"]
    batch = next(iter(trainer.get_train_dataloader()))
    targets = batch["labels"][batch["labels"] != -100].tolist()
    text = kimi_tokenizer.decode(targets, skip_special_tokens=False)
    assert "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>" in text
    assert "## Return of" not in text and "Start with" not in text  # tool results and the task are not targets
    assert text.endswith("Done.<|im_end|>")


_RESULT = re.compile(r"## Return of functions\.(\w+):\d+\n(.*?)<\|im_end\|>", re.S)


HEADER = "<|im_assistant|>assistant<|im_middle|>"


def _reply(text, row):
    """The scripted agent's next message given the conversation so far (module docstring)."""
    task = _task_of(text)
    results = _RESULT.findall(text)
    if results and results[-1][0] == "submit":
        return {"role": "assistant", "content": "Done."}
    if not results and row % 2 == 0:
        name, operand = task.ops[0]
        call = {"name": name, "arguments": {"a": task.start, "b": operand}}
    else:
        call = {"name": "submit", "arguments": {"answer": int(results[-1][1]) if results else task.start}}
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}


def _reply_ids(tokenizer, message) -> list[int]:
    """An assistant message as the chat template renders it after the assistant header, <|im_end|> included."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, message], tokenize=False)
    return tokenizer(rendered.rsplit(HEADER, 1)[1], add_special_tokens=False)["input_ids"]


def _scripted_generate(tokenizer):
    """``generate`` of the scripted agent (module docstring), in Kimi's format; rows of a first turn alternate
    careful / hasty, later turns follow from the tool results so far."""

    def generate(self, input_ids=None, attention_mask=None, **kwargs):
        rows = []
        for row, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
            text = tokenizer.decode(ids[mask.bool()], skip_special_tokens=False)
            rows.append(torch.tensor(_reply_ids(tokenizer, _reply(text, row))))
        new = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=tokenizer.pad_token_id)
        return torch.cat([input_ids, new.to(input_ids)], dim=1)

    return generate


_TASKS = {}


def _task_of(text) -> ArithmeticTask:
    return next(task for prompt, task in _TASKS.items() if prompt in text)


def _record_generate(monkeypatch) -> list:
    """Wrap TRL's ``GRPOTrainer._generate``; the returned list fills with its outputs (prompt ids, completion ids,
    tool mask, conversational completions, ...)."""
    played, generate = [], GRPOTrainer._generate

    def recording(self, prompts):
        played.append(generate(self, prompts))
        return played[-1]

    monkeypatch.setattr(GRPOTrainer, "_generate", recording)
    return played


def test_grpo_step_parses_kimi_tool_calls(base, tmp_path, kimi_tokenizer, monkeypatch):
    cfg = load_posttrain_config("grpo", [f"model={base}", f"output_dir={tmp_path / 'grpo'}", *FAST,
                                         "data.num_tasks=1", "trainer.num_generations=2"])
    task = make_tasks(1, cfg.data.seed, min_ops=1, max_ops=1, max_operand=cfg.data.max_operand)[0]
    _TASKS.clear()
    _TASKS[task.prompt()] = task
    monkeypatch.setattr(KDAMoEForCausalLM, "generate", _scripted_generate(kimi_tokenizer))
    played = _record_generate(monkeypatch)
    result = run_recipe(cfg)

    row = next(r for r in result["log_history"] if "reward" in r)
    assert row["tools/call_frequency"] > 0 and row["tools/failure_frequency"] == 0
    assert row["reward"] == pytest.approx(0.5)  # careful 1.0, hasty 0.0 (the environment's rule)
    assert math.isfinite(row["train_loss"])  # the one step logs in the run's last row
    assert _moved(_weights(base), _weights(result["final"])) > 0
    _carries_tokenizer(base, result["final"])
    _stops_at_im_end(result["final"], kimi_tokenizer)

    _, completion_ids, tool_mask, completions, *_ = played[0]
    assert len(completion_ids) == 2
    value = task.start + task.ops[0][1] if task.ops[0][0] == "add" else task.start * task.ops[0][1]
    careful_ids, careful_mask = completion_ids[0], tool_mask[0]
    tool_text = kimi_tokenizer.decode([t for t, m in zip(careful_ids, careful_mask, strict=True) if m == 0],
                                      skip_special_tokens=False)
    # the tool turns and the next assistant headers, written from the format: the result is the tool's own value.
    # TRL renders a tool turn from a one-call dummy conversation (`_get_tool_suffix_ids`), so each result reads
    # index 0, where a render of the whole conversation numbers the submit call 1.
    assert tool_text == (f"<|im_system|>{task.ops[0][0]}<|im_middle|>## Return of functions.{task.ops[0][0]}:0\n"
                         f"{value}<|im_end|><|im_assistant|>assistant<|im_middle|>"
                         f"<|im_system|>submit<|im_middle|>## Return of functions.submit:0\nsubmitted<|im_end|>"
                         f"<|im_assistant|>assistant<|im_middle|>")
    calls = [c["function"] for m in completions[0] for c in m.get("tool_calls") or []]
    assert calls == [{"name": task.ops[0][0], "arguments": {"a": task.start, "b": task.ops[0][1]}},
                     {"name": "submit", "arguments": {"answer": value}}]
    assert SPECIAL["eos_token"] == kimi_tokenizer.eos_token  # the turns ended at <|im_end|>, not the tokenizer's eos


def test_held_out_episodes_end_turns_at_im_end(kdamoe_base, kimi_tokenizer, monkeypatch):
    """:func:`run_episodes` (the held-out evaluation) with the folder's Kimi tokenizer: it attaches Kimi's response
    template itself and ends a turn at <|im_end|>, the model's eos, although the tokenizer's eos is [EOS]. The
    scripted ``generate`` stops only at the eos ids it is given (as ``generate`` does), else runs on with filler."""
    task = make_tasks(1, seed=4, min_ops=1, max_ops=1, max_operand=5)[0]
    _TASKS.clear()
    _TASKS[task.prompt()] = task
    script = _scripted_generate(kimi_tokenizer)
    im_end, filler = kimi_token_id(kimi_tokenizer, IM_END), kimi_tokenizer("x", add_special_tokens=False)["input_ids"]

    def generate(self, input_ids=None, attention_mask=None, max_new_tokens=None, eos_token_id=None, **kwargs):
        out = script(self, input_ids, attention_mask)[:, input_ids.shape[1]:]
        if im_end not in (eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]):
            out = torch.cat([out, torch.tensor(filler * max_new_tokens).expand(len(out), -1)], dim=1)
        return torch.cat([input_ids, out[:, :max_new_tokens]], dim=1)

    monkeypatch.setattr(KDAMoEForCausalLM, "generate", generate)
    model = KDAMoEForCausalLM.from_pretrained(kdamoe_base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(kdamoe_base)
    assert tokenizer.response_template is None  # the saved Kimi tokenizer has none of its own
    (episode,) = run_episodes(model, tokenizer, [task], max_new_tokens=64)
    assert (episode["reward"], episode["ended"], episode["tool_calls"]) == (1.0, "done", 2)
    name, operand = task.ops[0]
    value = task.start + operand if name == "add" else task.start * operand
    messages = [{"role": "user", "content": task.prompt()},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": task.start,
                                                                                                "b": operand}}}]},
                {"role": "tool", "name": name, "content": str(value)},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "submit", "arguments": {"answer": value}}}]}]
    # the episode's ids are its whole conversation and nothing more: no filler after any <|im_end|>
    whole = tokenizer.apply_chat_template(messages, tools=tool_schemas(ArithmeticEnvironment), tokenize=True,
                                          return_dict=False)
    assert episode["tokens"] == len(whole)


class ForceReplies(LogitsProcessor):
    """Forces each turn of the scripted agent token by token on the model's own ``generate`` (its logits are the
    model's, the choice is the script's): the turn so far is what follows the last assistant header."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.header = tokenizer(HEADER, add_special_tokens=False)["input_ids"]

    def __call__(self, input_ids, scores):
        scores = scores.clone()  # generate keeps the raw logits (output_logits) in the tensor it passes here
        n = len(self.header)
        for row, ids in enumerate(input_ids.tolist()):
            start = max(i for i in range(len(ids) - n + 1) if ids[i:i + n] == self.header)
            done, want = ids[start + n:], _reply_ids(self.tokenizer, _reply(self.tokenizer.decode(ids[:start]), 0))
            if len(done) < len(want) and done == want[:len(done)]:
                scores[row] = -float("inf")
                scores[row, want[len(done)]] = 0.0
        return scores


def test_cached_rollouts_parse_kimi_tool_calls(kdamoe_base, tmp_path, kimi_tokenizer, monkeypatch):
    """``grpo.rollout: cached`` (each turn continues the rollout's cache; :mod:`kdamoe.posttraining.rollout`) with the
    folder's Kimi tokenizer: the careful agent's calls are parsed from the generated ids, the tools run, the turns
    end at <|im_end|>; both rollouts of the group do the task (batch-1 rollouts: every row is row 0)."""
    cfg = load_posttrain_config("grpo", [f"model={kdamoe_base}", f"output_dir={tmp_path / 'cached'}", *FAST,
                                         "data.num_tasks=1", "trainer.num_generations=2", "grpo.rollout=cached",
                                         "trainer.generation_kwargs={do_sample: false}"])
    task = make_tasks(1, cfg.data.seed, min_ops=1, max_ops=1, max_operand=cfg.data.max_operand)[0]
    _TASKS.clear()
    _TASKS[task.prompt()] = task
    generate, force = KDAMoEForCausalLM.generate, ForceReplies(kimi_tokenizer)
    monkeypatch.setattr(KDAMoEForCausalLM, "generate", lambda self, *args, **kwargs: generate(
        self, *args, logits_processor=LogitsProcessorList([force]), **kwargs))
    played = _record_generate(monkeypatch)
    result = run_recipe(cfg)

    row = next(r for r in result["log_history"] if "reward" in r)
    assert (row["reward"], row["tools/call_frequency"], row["tools/failure_frequency"]) == (1.0, 2.0, 0.0)
    _, completion_ids, tool_mask, completions, *_ = played[0]
    name, operand = task.ops[0]
    value = task.start + operand if name == "add" else task.start * operand
    for ids, mask, messages in zip(completion_ids, tool_mask, completions, strict=True):
        said = kimi_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m == 1], skip_special_tokens=False)
        assert said == "".join(kimi_tokenizer.decode(_reply_ids(kimi_tokenizer, m), skip_special_tokens=False)
                               for m in ({"role": "assistant", "content": "", "tool_calls": [
                                   {"type": "function", "function": {"name": name, "arguments": {
                                       "a": task.start, "b": operand}}}]},
                                   {"role": "assistant", "content": "", "tool_calls": [
                                       {"type": "function", "function": {"name": "submit",
                                                                         "arguments": {"answer": value}}}]},
                                   {"role": "assistant", "content": "Done."}))
        assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert messages[1]["content"] == str(value) and messages[-1]["content"] == "Done."
