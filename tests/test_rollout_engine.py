"""The batched rollout engine (:mod:`kdamoe.posttraining.engine`, ``grpo.rollout: batched``) against the one-at-a-time
cached rollout (:func:`kdamoe.posttraining.rollout._episode`, itself checked against TRL's loop in
``tests/test_rollout.py``) and TRL 1.16's own tool loop, on the tiny base model in float32.

The tests whose forward depends on the architecture run twice (``any_policy``): on the default tiny model and on one
with every Kimi Linear option (:data:`KIMI_OPTIONS`: the MLA key part shared by every head, a q LoRA, the unbounded
KDA gate with ``A_log``, ...); one more plays tool episodes on a transformers ``KimiLinearForCausalLM`` loaded by
kdamoe, with a Kimi tokenizer.

A tiny random model never writes a tool call, so a logits processor forces the tool-call turns the test plans for
each episode (every turn not planned is the model's own choice), the same processor in ``generate`` (the references)
and in the engine (its ``logits_processor``). The references play each episode alone at batch 1; the engine plays
them together on fewer slots than episodes, so slots are refilled mid-run and prefills share steps with decodes.
"""

import json
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.utils import get_json_schema
from trl.chat_template_utils import parse_response

import kdamoe.posttraining.rollout as rollout_module
from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining import load_posttrain_config
from kdamoe.posttraining.agent import _tool_suffix_ids
from kdamoe.posttraining.chat_formats import attach_response_template
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine, episode_seed
from kdamoe.posttraining.environments.arithmetic import ArithmeticTask
from kdamoe.posttraining.recipes import build_trainer
from kdamoe.posttraining.rollout import BatchedRolloutGRPOTrainer
from tests.helpers import tiny_config
from tests.kimi_tokenizer import build_kimi_tokenizer, kimi_token_id
from tests.test_kimi_linear_checkpoints import _perturbed_reference
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)
from tests.test_posttrain_kimi import _reply_ids as _kimi_reply_ids
from tests.test_rollout import FAST, ScriptedToolCalls, _assistant_ids, _call, _play, _rows, _script

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


def submit(answer: int) -> str:
    """Submit the final result.

    Args:
        answer: The final number.
    """
    return "submitted"


SCHEMAS = [add, multiply, submit]


class PlannedTurns(LogitsProcessor):
    """Forces turn ``n`` of the episode marked ``EP<k>`` in its prompt to the assistant message ``plan[k][n]``; a turn
    past the plan (or ``None``) is left to the model. The turn number is the count of assistant headers after the
    prompt's own (the generation prompt)."""

    def __init__(self, tokenizer, plan: dict[int, list], reply_ids=_assistant_ids):
        self.tokenizer, self.plan, self.reply_ids = tokenizer, plan, reply_ids  # reply_ids: (tokenizer, message) -> ids
        user = [{"role": "user", "content": "x"}]
        with_header = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
        self.header = with_header[len(tokenizer.apply_chat_template(user, tokenize=True, return_dict=False)):]

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        n = len(self.header)
        for row, ids in enumerate(input_ids.tolist()):
            starts = [i for i in range(len(ids) - n + 1) if ids[i:i + n] == self.header]
            key = int(re.search(r"EP(\d+)", self.tokenizer.decode(ids[:starts[0]])).group(1))
            turns = self.plan.get(key, [])
            turn = len(starts) - 1
            if turn < len(turns) and turns[turn] is not None:
                want, done = self.reply_ids(self.tokenizer, turns[turn]), ids[starts[-1] + n:]
                if len(done) < len(want) and done == want[:len(done)]:
                    scores[row] = -float("inf")
                    scores[row, want[len(done)]] = 0.0
        return scores


def _prompt(tokenizer, key: int, words: int = 0) -> list[int]:
    text = f"EP{key} compute the value" + " and then some more" * words
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=SCHEMAS, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def policy(base):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return model, tokenizer


# Every Kimi Linear option of the architecture at once: the MLA key part shared by every head (a latent cache row is
# [normed latent | k_shared], 16 + 8 wide), a q LoRA, the MLA norms' own eps (1e-6; the others' 1e-5), MLA layers
# first and last, dense and sparse MLPs mixed, the unbounded KDA gate with A_log, no output-gate bias, no Block
# AttnRes, SwiGLU experts in the model width (no expert latent).
KIMI_OPTIONS = dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                    q_lora_rank=12, qk_head_dim=24, qk_rope_head_dim=8, v_head_dim=12, mla_rms_norm_eps=1e-6,
                    mlp_layer_types=["sparse", "dense", "sparse", "dense"], kda_lower_bound=None, kda_use_A_log=True,
                    kda_output_gate_bias=False, attnres_num_blocks=0, hidden_act="silu", moe_latent_size=None,
                    rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def kimi_policy(base, tmp_path_factory):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """The base folder's tokenizer with a tiny model of :data:`KIMI_OPTIONS`, saved and loaded back."""
    folder = tmp_path_factory.mktemp("kimi_options")
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(1)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         max_position_embeddings=1024, kda_head_dim=16, **KIMI_OPTIONS)
    KDAMoEForCausalLM(config).save_pretrained(folder)
    model = KDAMoEForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.model.layers[1].self_attn.A_log.dtype == torch.float32
    return model, tokenizer


@pytest.fixture(params=["defaults", "kimi_options"])
def any_policy(request):
    """The default tiny model, then the one of :data:`KIMI_OPTIONS`: the tests whose forward differs with the
    architecture options (the engine's mixers, its rows, adapters on the projections) run on both."""
    return request.getfixturevalue("policy" if request.param == "defaults" else "kimi_policy")


def _planned(tokenizer, plan) -> PlannedTurns:
    return plan if isinstance(plan, PlannedTurns) else PlannedTurns(tokenizer, plan)


def _reference_trainer(model, tokenizer, generation_config, *, budget, rounds, max_len=None, eos=None):
    """The attributes :func:`kdamoe.posttraining.rollout._episode` reads of a GRPO trainer (``eos``: the id that ends
    a turn, default the tokenizer's)."""
    return SimpleNamespace(
        max_completion_length=budget, generation_config=generation_config,
        eos_token_ids=[tokenizer.eos_token_id if eos is None else eos],
        temperature=0.7, _tokenizer=tokenizer, max_tool_calling_iterations=rounds,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=max_len
                                                     or model.config.max_position_embeddings)),
        _get_tool_suffix_ids=lambda messages: _tool_suffix_ids(tokenizer, messages))


def _reference(model, tokenizer, plan, generation_config, specs, *, budget, rounds, max_len=None, eos=None):
    """Each episode alone at batch 1 through the cached rollout, under ``torch.manual_seed(spec.seed)``."""
    trainer = _reference_trainer(model, tokenizer, generation_config, budget=budget, rounds=rounds, max_len=max_len,
                                 eos=eos)
    generate = model.generate
    _script(model, _planned(tokenizer, plan))
    try:
        out = []
        for spec in specs:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed if spec.seed is not None else 0)
                out.append(rollout_module._episode(model, trainer, spec.prompt_ids, spec.schemas, spec.tools))
        return out
    finally:
        model.generate = generate


def _engine(model, tokenizer, plan, generation_config, *, slots, budget, rounds, max_len=None, timeout=None,
            cls=RolloutEngine, step_tokens=8192, eos=None):
    eos = tokenizer.eos_token_id if eos is None else eos
    return cls(model, generation_config, num_slots=slots, eos_token_ids=[eos],
               max_completion_length=budget, logprob_temperature=0.7, max_tool_calling_iterations=rounds,
               max_position_embeddings=max_len,
               parse_turn=lambda ids, prefix, schemas: parse_response(tokenizer, ids, prefix=prefix, tools=schemas),
               tool_suffix_ids=lambda messages: _tool_suffix_ids(tokenizer, messages), tool_timeout_s=timeout,
               prefill_chunk_size=16, max_step_tokens=step_tokens,
               logits_processor=LogitsProcessorList([_planned(tokenizer, plan)]))


def _assert_same(got: dict, want: dict, check_logprobs: bool = True):
    for key in ("completion_ids", "tool_mask", "completion", "tool_calls", "tool_failures"):
        assert got[key] == want[key], key
    if check_logprobs:
        diff = (torch.tensor(got["logprobs"]) - torch.tensor(want["logprobs"])).abs()
        assert float(diff.max()) <= 1e-5


GREEDY = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0)


def _greedy(tokenizer, **changes):
    config = GenerationConfig(**{**GREEDY.to_dict(), "eos_token_id": [tokenizer.eos_token_id], **changes})
    return config


def test_engine_equals_cached_rollout_with_refills_forks_errors_and_budgets(any_policy):
    """Seven episodes on two slots: ragged prompts, a GRPO group of three sharing a prompt (slots for two, so it
    splits), a raising tool, episodes hitting the per-turn cap, the tool-round limit and the completion budget."""
    model, tokenizer = any_policy

    def failing_add(a: int, b: int) -> int:
        raise ValueError("add is broken today")

    calls = {0: [_call("add", a=2, b=3), _call("submit", answer=5)],  # two tool rounds, then a free turn
             1: [_call("multiply", a=4, b=5)],  # one round, then free
             2: [_call("add", a=1, b=1), _call("add", a=2, b=2), _call("add", a=3, b=3)],  # past the round limit
             3: [_call("add", a=7, b=8)]}  # on the raising tool
    keys = [0, 1, 1, 1, 2, 3, 4]  # episode 4 makes no call: one free turn
    words = {0: 0, 1: 3, 2: 1, 3: 7, 4: 2}
    tools = {"add": add, "multiply": multiply, "submit": submit}
    specs = [EpisodeSpec(_prompt(tokenizer, k, words[k]), tools=dict(tools, add=failing_add) if k == 3 else tools,
                         schemas=SCHEMAS, seed=i) for i, k in enumerate(keys)]
    plan = calls
    config = _greedy(tokenizer, max_new_tokens=45)  # a tool-call turn is 34-39 tokens; a free turn hits the cap
    want = _reference(model, tokenizer, plan, config, specs, budget=200, rounds=2)
    engine = _engine(model, tokenizer, plan, config, slots=2, budget=200, rounds=2, step_tokens=20)
    got = engine.run(specs)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert engine.stats["forks"] == 6  # 5 distinct prompts; the group of three splits into two and one
    assert engine.stats["tokens"] <= 20 * engine.stats["steps"]  # max_step_tokens: 16-token chunks cut to fit 20
    assert len({len(s.prompt_ids) for s in specs}) == 5
    ended = [g["ended"] for g in got]
    assert ended[4] == "iterations" and got[4]["tool_calls"] == 2  # the third call is never run
    assert got[5]["tool_failures"] == 1 and "add is broken today" in got[5]["completion"][1]["content"]
    assert any(e == "turn_cap" for e in ended)
    assert [m.count(0) > 0 for m in (g["tool_mask"] for g in got)] == [True, True, True, True, True, True, False]


# A released Kimi Linear model's layout: transformers' own class, saved as it saves it, read by kdamoe's loader.
KIMI_LINEAR = dict(
    model_type="kimi_linear", hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, num_experts=6, num_experts_per_token=2, num_shared_experts=1,
    routed_scaling_factor=2.446, moe_renormalize=True, num_expert_group=1, topk_group=1, mla_use_nope=True,
    model_max_length=1024, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
    mlp_layer_types=["sparse", "dense", "sparse", "dense"],
    linear_attn_config=dict(full_attn_layers=[1, 4], kda_layers=[2, 3], num_heads=2, head_dim=16,
                            short_conv_kernel_size=4))


def test_engine_on_a_converted_kimi_linear_model_with_its_kimi_tokenizer(tmp_path):
    """A tiny transformers ``KimiLinearForCausalLM`` (every weight moved by seeded noise, so no norm, bias or
    ``A_log`` sits at its init) saved with a Kimi tokenizer and loaded by ``KDAMoEForCausalLM.from_pretrained``:
    the engine's greedy tool episodes (Kimi's tool-call format, turns ending at ``<|im_end|>``) on three slots, a
    group of two forked from one prompt, the fourth episode taking a freed slot and prefilling in the steps where
    another decodes, equal the cached rollout's."""
    texts = [json.dumps(get_json_schema(f)) for f in SCHEMAS] * 3 + [
        "EP0 compute the value and then some more. You are Kimi, an AI assistant created by Moonshot AI.",
        'functions.add:0 {"a": 2, "b": 3} ## Return of functions.multiply:0 20 submitted']
    tokenizer = build_kimi_tokenizer(texts, base_vocab_size=400)
    im_end = kimi_token_id(tokenizer, 2)  # where a Kimi turn ends (the model config's eos; the tokenizer's is [EOS])
    raw = dict(KIMI_LINEAR, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=im_end)
    _perturbed_reference(raw, seed=3).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = KDAMoEForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.config.qk_rope_head_dim == 4 and model.config.kda_lower_bound is None
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert attach_response_template(tokenizer, needs_tool_calls=True) == "kimi"

    plan = PlannedTurns(tokenizer, {0: [_call("add", a=2, b=3)], 1: [_call("multiply", a=4, b=5)]},
                        reply_ids=_kimi_reply_ids)
    tools = {"add": add, "multiply": multiply, "submit": submit}
    specs = [EpisodeSpec(_prompt(tokenizer, k, w), tools=tools, schemas=SCHEMAS, seed=i)
             for i, (k, w) in enumerate([(0, 0), (1, 2), (1, 2), (2, 1)])]  # episode 2 makes no call
    config = _greedy(tokenizer, max_new_tokens=30, eos_token_id=[im_end])
    want = _reference(model, tokenizer, plan, config, specs, budget=90, rounds=2, eos=im_end)
    engine = _engine(model, tokenizer, plan, config, slots=3, budget=90, rounds=2, eos=im_end)
    got = engine.run(specs)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert engine.stats["forks"] == 3  # three distinct prompts: the group of two prefilled its prompt once
    assert [g["tool_calls"] for g in got] == [1, 1, 1, 0]
    assert got[0]["completion"][1]["content"] == "5" and got[1]["completion"][1]["content"] == "20"
    assert tokenizer.decode(got[0]["completion_ids"]).startswith("<|tool_calls_section_begin|>")


def test_engine_raising_tool_and_budget_drop(policy):
    model, tokenizer = policy

    def broken(a: int, b: int) -> int:
        raise RuntimeError("no such number")

    plan = {0: [_call("add", a=2, b=3)], 1: [_call("add", a=1, b=2), _call("add", a=3, b=4)]}
    specs = [EpisodeSpec(_prompt(tokenizer, 0), tools={"add": broken}, schemas=SCHEMAS, seed=0),
             EpisodeSpec(_prompt(tokenizer, 1, 4), tools={"add": add}, schemas=SCHEMAS, seed=1)]
    config = _greedy(tokenizer)
    # budget 100: episode 0 (33 + 47 tokens) gets a 20-token free turn; episode 1's second tool result (34 + 22 + 32
    # + 22 tokens) would pass it: dropped, the episode ends on its call
    want = _reference(model, tokenizer, plan, config, specs, budget=100, rounds=5)
    got = _engine(model, tokenizer, plan, config, slots=1, budget=100, rounds=5).run(specs)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert got[0]["tool_failures"] == 1 and "no such number" in got[0]["completion"][1]["content"]
    assert got[1]["ended"] == "budget" and got[1]["completion"][-1]["tool_calls"]
    # the context limit: a tool turn that would reach max_position_embeddings ends the episode the same way
    short = len(specs[1].prompt_ids) + 30
    want = _reference(model, tokenizer, plan, config, specs[1:], budget=200, rounds=5, max_len=short)
    got = _engine(model, tokenizer, plan, config, slots=1, budget=200, rounds=5, max_len=short).run(specs[1:])
    _assert_same(got[0], want[0])
    assert got[0]["ended"] == "budget"


@pytest.mark.parametrize("kind", ["sync", "async", "malformed"])
def test_engine_raises_what_a_tool_round_raises_outside_a_tool_error(policy, kind):
    """A tool's own ``Exception`` is the tool's result (TRL's loop); a ``KeyboardInterrupt`` raised in a tool, or a
    call dict without ``"function"``, stops TRL's loop, which runs the calls on the main thread. The engine runs them
    on a worker thread: it must raise the same from ``run`` (it swallowed them, found by a user's probe), and play
    the next ``run`` as if nothing happened."""
    model, tokenizer = policy

    def interrupted(a: int, b: int) -> int:
        raise KeyboardInterrupt

    async def interrupted_async(a: int, b: int) -> int:
        raise KeyboardInterrupt

    tool = {"sync": interrupted, "async": interrupted_async, "malformed": add}[kind]
    plan = {0: [_call("add", a=2, b=3)]}
    spec = EpisodeSpec(_prompt(tokenizer, 0), tools={"add": tool}, schemas=SCHEMAS, seed=0)
    config = _greedy(tokenizer)
    engine = _engine(model, tokenizer, plan, config, slots=1, budget=80, rounds=3)
    if kind == "malformed":
        engine.parse_turn = lambda ids, prefix, schemas: {"role": "assistant", "content": "",
                                                          "tool_calls": [{"type": "function"}]}
    with pytest.raises(KeyError if kind == "malformed" else KeyboardInterrupt):
        engine.run([spec])
    engine.parse_turn = _engine(model, tokenizer, plan, config, slots=1, budget=80, rounds=3).parse_turn
    if kind == "sync":  # the tool turn's ids: a 1-D integer tensor is taken as its list, None is named
        real = engine.tool_suffix_ids
        engine.tool_suffix_ids = lambda messages: torch.tensor(real(messages))
        ok = EpisodeSpec(spec.prompt_ids, tools={"add": add}, schemas=SCHEMAS, seed=0)
        _assert_same(engine.run([ok])[0], _reference(model, tokenizer, plan, config, [ok], budget=80, rounds=3)[0])
        engine.tool_suffix_ids = lambda messages: None
        with pytest.raises(ValueError, match="tool_suffix_ids.*must return a list of token ids .* got NoneType"):
            engine.run([ok])
        engine.tool_suffix_ids = real
    ok = EpisodeSpec(spec.prompt_ids, tools={"add": add}, schemas=SCHEMAS, seed=0)
    _assert_same(engine.run([ok])[0], _reference(model, tokenizer, plan, config, [ok], budget=80, rounds=3)[0])


def test_engine_seeded_sampling_equals_cached_rollout(policy):
    model, tokenizer = policy
    plan = {0: [_call("add", a=2, b=3)], 1: [None, None]}
    specs = [EpisodeSpec(_prompt(tokenizer, k), tools={"add": add}, schemas=SCHEMAS, seed=episode_seed(7, i))
             for i, k in enumerate([0, 0, 1, 1, 0])]
    config = _greedy(tokenizer, do_sample=True, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1)
    want = _reference(model, tokenizer, plan, config, specs, budget=60, rounds=3)
    got = _engine(model, tokenizer, plan, config, slots=2, budget=60, rounds=3).run(specs)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    assert got[0]["completion_ids"] != got[1]["completion_ids"]  # one prompt, two seeds, two samples
    with pytest.raises(ValueError, match="no seed"):
        _engine(model, tokenizer, plan, config, slots=2, budget=60, rounds=3).run([EpisodeSpec(specs[0].prompt_ids)])


def test_engine_tool_timeout_ends_only_its_episode(policy):
    """A tool past its time limit ends its episode without the others waiting for it; a tool that runs while the
    engine decodes sees the engine step meanwhile."""
    model, tokenizer = policy
    release, retired, saw_steps = threading.Event(), [], []
    engine = None

    def stuck(a: int, b: int) -> int:
        release.wait(60)  # never set while the engine runs
        return 0

    def watching(a: int, b: int) -> int:
        first, deadline = engine.stats["steps"], time.monotonic() + 30
        while engine.stats["steps"] < first + 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        saw_steps.append(engine.stats["steps"] - first)
        return a + b

    plan = {0: [_call("add", a=2, b=3)], 1: [_call("add", a=4, b=4)], 2: [None]}
    specs = [EpisodeSpec(_prompt(tokenizer, 0), tools={"add": stuck}, schemas=SCHEMAS, seed=0,
                         on_timeout=lambda: retired.append(0)),
             EpisodeSpec(_prompt(tokenizer, 1), tools={"add": watching}, schemas=SCHEMAS, seed=1),
             EpisodeSpec(_prompt(tokenizer, 2, 2), tools={"add": add}, schemas=SCHEMAS, seed=2)]
    config = _greedy(tokenizer)
    engine = _engine(model, tokenizer, plan, config, slots=3, budget=80, rounds=3, timeout=0.5)
    try:
        got = engine.run(specs)
        assert not release.is_set()  # run() returned while the stuck call still blocks its worker
    finally:
        release.set()
    assert got[0]["ended"] == "tool_timeout" and retired == [0]
    first_turn = len(_assistant_ids(tokenizer, plan[0][0]))
    assert len(got[0]["completion_ids"]) == first_turn and got[0]["tool_mask"] == [1] * first_turn
    assert saw_steps and saw_steps[0] >= 3  # episode 2 decoded while episode 1's tool ran
    want = _reference(model, tokenizer, plan, config, [EpisodeSpec(s.prompt_ids, tools={"add": add},
                                                                   schemas=SCHEMAS, seed=s.seed) for s in specs[1:]],
                      budget=80, rounds=3)
    for g, w in zip(got[1:], want, strict=True):
        _assert_same(g, w)


def test_engine_awaits_async_tools_and_stops_at_stop_strings(policy):
    """An async tool is awaited on the worker (its result is the sync tool's, so the episode equals the cached
    rollout's with the sync tool); a stop string ends a turn where ``generate`` with the same ``stop_strings`` ends
    it."""
    model, tokenizer = policy

    async def async_add(a: int, b: int) -> int:
        return a + b

    async_add.__name__ = "add"
    plan = {0: [_call("add", a=2, b=3)]}
    config = _greedy(tokenizer)
    spec = EpisodeSpec(_prompt(tokenizer, 0), tools={"add": async_add}, schemas=SCHEMAS, seed=0)
    got = _engine(model, tokenizer, plan, config, slots=1, budget=80, rounds=2).run([spec])[0]
    want = _reference(model, tokenizer, plan, config, [EpisodeSpec(spec.prompt_ids, tools={"add": add},
                                                                   schemas=SCHEMAS, seed=0)], budget=80, rounds=2)[0]
    _assert_same(got, want)
    assert got["completion"][1]["content"] == "5"

    # the stop string: a piece of the text this prompt's free greedy turn writes
    prompt = _prompt(tokenizer, 9, 1)
    free = _engine(model, tokenizer, {}, config, slots=1, budget=40, rounds=0).run([EpisodeSpec(prompt)])[0]
    text = tokenizer.decode(free["completion_ids"])
    stop = text[len(text) // 2: len(text) // 2 + 3]
    stopping = _greedy(tokenizer, stop_strings=[stop])
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         generation_config=stopping, tokenizer=tokenizer)
    got = RolloutEngine(model, stopping, num_slots=1, eos_token_ids=[tokenizer.eos_token_id], max_completion_length=40,
                        tokenizer=tokenizer).run([EpisodeSpec(prompt)])[0]
    assert got["ended"] == "stop_string"
    assert got["completion_ids"] == out[0, len(prompt):].tolist()
    assert len(got["completion_ids"]) < len(free["completion_ids"])
    with pytest.raises(ValueError, match="stop_strings"):
        RolloutEngine(model, stopping, num_slots=1, eos_token_ids=[2], max_completion_length=8)


class PoisonedEngine(RolloutEngine):
    """Fills slot ``victim``'s KDA / conv states and its episode's MLA rows with NaN after every step."""

    victim = 1

    def _step(self, runnable):
        super()._step(runnable)
        for pool in (*self.recurrent.values(), *self.conv.values()):
            pool[self.victim].fill_(float("nan"))
        for episode in runnable:
            if episode.slot == self.victim:
                for rows in episode.own.values():
                    rows.data.fill_(float("nan"))


def test_poisoned_neighbour_slot_changes_nothing(any_policy):
    model, tokenizer = any_policy
    plan = {0: [_call("add", a=2, b=3)], 1: [None], 2: [_call("multiply", a=3, b=3)]}
    specs = [EpisodeSpec(_prompt(tokenizer, k, k), tools={"add": add, "multiply": multiply}, schemas=SCHEMAS, seed=k)
             for k in (0, 1, 2)]
    config = _greedy(tokenizer)
    clean = _engine(model, tokenizer, plan, config, slots=3, budget=60, rounds=3).run(specs)
    poisoned = _engine(model, tokenizer, plan, config, slots=3, budget=60, rounds=3, cls=PoisonedEngine).run(specs)
    assert any(torch.tensor(poisoned[1]["logprobs"]).isnan())  # the victim itself is wrecked
    for i in (0, 2):  # the same up to float rounding (the NaN rows change how many tokens an expert's GEMM takes)
        _assert_same(poisoned[i], clean[i])
        assert not any(torch.tensor(poisoned[i]["logprobs"]).isnan())


def test_engine_decodes_with_the_weights_after_an_optimizer_step(policy):
    model, tokenizer = policy
    model = KDAMoEForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32)  # a copy this test may train
    plan = {0: [_call("add", a=2, b=3)]}
    specs = [EpisodeSpec(_prompt(tokenizer, 0), tools={"add": add}, schemas=SCHEMAS, seed=0)]
    config = _greedy(tokenizer)
    engine = _engine(model, tokenizer, plan, config, slots=1, budget=60, rounds=2)
    before = engine.run(specs)[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([specs[0].prompt_ids])
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    after = engine.run(specs)[0]  # the same engine object, after the step
    want = _reference(model, tokenizer, plan, config, specs, budget=60, rounds=2)[0]
    _assert_same(after, want)
    assert max(abs(a - b) for a, b in zip(after["logprobs"], before["logprobs"], strict=False)) > 1e-3


def test_engine_decodes_through_a_peft_adapter(any_policy):
    """A LoRA adapter (non-zero, on the KDA, MLA and MLP projections; with a q LoRA on ``q_b_proj`` too) is part of
    what the engine decodes with: the engine on the PEFT model equals the cached rollout on it, and differs from the
    base model's episode."""
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 (only this test needs PEFT)

    model, tokenizer = any_policy
    base_model = KDAMoEForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32).eval()
    plan = {0: [_call("add", a=2, b=3)]}
    specs = [EpisodeSpec(_prompt(tokenizer, 0), tools={"add": add}, schemas=SCHEMAS, seed=0)]
    config = _greedy(tokenizer, max_new_tokens=45)
    plain = _engine(base_model, tokenizer, plan, config, slots=1, budget=80, rounds=2).run(specs)[0]
    torch.manual_seed(3)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                      target_modules=["q_proj", "q_b_proj", "v_proj", "kv_b_proj", "kv_a_proj", "o_proj", "down_proj"])
    peft_model = get_peft_model(base_model, lora).eval()
    got = _engine(peft_model, tokenizer, plan, config, slots=1, budget=80, rounds=2).run(specs)[0]
    want = _reference(peft_model, tokenizer, plan, config, specs, budget=80, rounds=2)[0]
    _assert_same(got, want)
    assert max(abs(a - b) for a, b in zip(got["logprobs"], plain["logprobs"], strict=False)) > 1e-3


class RowWidths(RolloutEngine):
    """Records the (width, bytes per element) of every MLA row buffer an episode holds after a step."""

    def _step(self, runnable):
        super()._step(runnable)
        self.row_layout = getattr(self, "row_layout", set()) | {
            (rows.data.shape[1], rows.data.element_size()) for e in runnable for rows in e.own.values()}


def test_slot_bytes_is_the_documented_arithmetic(any_policy):
    """docs/post-training.md's per-slot memory: the KDA states, and per own token and MLA layer one row of
    ``kv_lora_rank + qk_rope_head_dim`` values (the shared key part, 8 wide on the Kimi-options model) — the width
    the engine's row buffers really have."""
    model, tokenizer = any_policy
    c = model.config
    engine = RowWidths(model, GREEDY, num_slots=3, eos_token_ids=[2], max_completion_length=2)
    n_kda, n_mla = c.layer_types.count("linear_attention"), c.layer_types.count("full_attention")
    H, K, W = c.kda_num_heads, c.kda_head_dim, c.kda_short_conv_kernel_size
    kda = n_kda * (H * K * K * 4 + 3 * H * K * W * 4)  # float32 recurrent state, float32 (model dtype) conv window
    row = c.kv_lora_rank + c.qk_rope_head_dim
    assert engine.slot_bytes() == kda
    assert engine.slot_bytes(own_tokens=10) == kda + 10 * n_mla * row * 4
    engine.run([EpisodeSpec(_prompt(tokenizer, 0)), EpisodeSpec(_prompt(tokenizer, 1))])
    assert engine.row_layout == {(row, 4)}


def test_engine_refuses_bad_arguments(policy):
    model, tokenizer = policy
    with pytest.raises(ValueError, match="num_slots"):
        RolloutEngine(model, GREEDY, num_slots=0, eos_token_ids=[2], max_completion_length=8)
    with pytest.raises(ValueError, match="tool_timeout_s"):
        RolloutEngine(model, GREEDY, num_slots=1, eos_token_ids=[2], max_completion_length=8, tool_timeout_s=0)
    with pytest.raises(ValueError, match="max_step_tokens"):
        RolloutEngine(model, GREEDY, num_slots=1, eos_token_ids=[2], max_completion_length=8, max_step_tokens=0)
    with pytest.raises(ValueError, match="KDAMoE causal LM"):
        RolloutEngine(torch.nn.Linear(2, 2), GREEDY, num_slots=1, eos_token_ids=[2], max_completion_length=8)
    engine = RolloutEngine(model, GREEDY, num_slots=1, eos_token_ids=[2], max_completion_length=8)
    with pytest.raises(ValueError, match="parse_turn"):
        engine.run([EpisodeSpec([5, 6], tools={"add": add})])
    with pytest.raises(ValueError, match="prompt_ids must be a non-empty list"):
        engine.run([EpisodeSpec([])])
    # each refused before a step runs, naming the value (a user's probe found these passing or failing deep inside)
    for kwargs, needle in [
            (dict(cuda_graphs="yes"), "cuda_graphs"), (dict(logprob_temperature=None), "logprob_temperature"),
            (dict(logprob_temperature=float("inf")), "logprob_temperature"),
            (dict(logprob_temperature=float("nan")), "logprob_temperature"),
            (dict(tool_timeout_s="5"), "tool_timeout_s"),
            (dict(max_tool_calling_iterations=1.5), "max_tool_calling_iterations"),
            (dict(max_position_embeddings=0), "max_position_embeddings"),
            (dict(parse_turn="x"), "parse_turn must be None or callable"),
            (dict(eos_token_ids=None), "eos_token_ids must be a list"),
            (dict(eos_token_ids=[-1]), r"eos_token_ids: -1 is not a token id"),
            (dict(eos_token_ids=[10 ** 9]), r"eos_token_ids: 1000000000 is not a token id"),
            (dict(generation_config={"do_sample": False}), "GenerationConfig"),
            (dict(logits_processor="x"), "logits_processor must be None or a LogitsProcessorList"),
            (dict(generation_config=GenerationConfig(do_sample=True, temperature=0.0, max_new_tokens=4)),
             "generation_config: .*temperature")]:
        args = dict(generation_config=GREEDY, num_slots=1, eos_token_ids=[2], max_completion_length=8) | kwargs
        with pytest.raises(ValueError, match=needle):
            RolloutEngine(model, **args)
    for specs, needle in [
            (EpisodeSpec([5, 6]), "specs must be a list"), ([[5, 6]], "episode 0: expected an EpisodeSpec"),
            ([EpisodeSpec([5, 6.7])], r"token id 6.7 is not an integer"),
            ([EpisodeSpec([5, True])], r"token id True is not an integer"),
            ([EpisodeSpec(torch.tensor([[5, 6]]))], "1-D integer ids"),
            ([EpisodeSpec([5, 6], seed=2 ** 64)], r"episode 0: seed must be .* got 18446744073709551616"),
            ([EpisodeSpec([5, 6]), EpisodeSpec([5, 6], seed="7")], r"episode 1: seed must be .* got '7'"),
            ([EpisodeSpec([5] * model.config.max_position_embeddings)], "no room for a reply"),
            ([EpisodeSpec([5, 6], tools=["add"])], r"episode 0: tools must be None or a dict of name -> callable"),
            ([EpisodeSpec([5, 6], tools={"add": 3})], r"tools must be None or a dict of name -> callable"),
            ([EpisodeSpec([5, 6], on_timeout=3)], r"episode 0: on_timeout must be None or callable, got 3")]:
        with pytest.raises(ValueError, match=needle):
            engine.run(specs)
    # a 1-D tensor of ids is what a transformers user holds: taken as its list
    assert engine.run([EpisodeSpec(torch.tensor([5, 6]))]) == engine.run([EpisodeSpec([5, 6])])
    with pytest.raises(ValueError, match="rollout_slots"):
        load_posttrain_config("grpo", ["grpo.rollout=batched", "grpo.rollout_slots=-1"])
    with pytest.raises(ValueError, match="only grpo.rollout: batched"):
        load_posttrain_config("grpo", ["grpo.rollout=cached", "grpo.tool_timeout_s=5"])
    with pytest.raises(ValueError, match="tool_timeout_s"):
        load_posttrain_config("grpo", ["grpo.rollout=batched", "grpo.tool_timeout_s=0"])


def test_batched_rollout_loads_under_fsdp_in_every_mode(monkeypatch):
    """The engines of a sharded policy step in lockstep (tests/test_engine_lockstep.py): ``batched`` loads under
    ``trainer.fsdp`` in every GRPO mode, while multi-turn ``cached`` stays refused."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for mode in ("single_turn", "tools", "environment"):
        cfg = load_posttrain_config("grpo", ["grpo.rollout=batched", f"grpo.mode={mode}", "data.environment=arithmetic",
                                             "trainer.fsdp=true"])
        assert cfg.grpo.rollout == "batched" and cfg.grpo.mode == mode
    with pytest.raises(ValueError, match=r"with trainer.fsdp and grpo.rollout: cached"):
        load_posttrain_config("grpo", ["grpo.rollout=cached", "grpo.mode=tools", "data.environment=arithmetic",
                                       "trainer.fsdp=true"])


# ------------------------------------------------------------------------------------------ inside TRL's GRPOTrainer


def _trainer(base_dir, tmp_path, rollout, *overrides):
    cfg = load_posttrain_config("grpo", [f"model={base_dir}", f"output_dir={tmp_path / rollout}", *FAST,
                                         f"grpo.rollout={rollout}", *overrides])
    torch.manual_seed(0)
    model = KDAMoEForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return build_trainer(cfg, model, AutoTokenizer.from_pretrained(base_dir))


def test_batched_rollout_equals_cached_and_trl_in_grpo(base, tmp_path, monkeypatch):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """TRL's generation step on four rows (two prompts, each twice: two GRPO groups) on two slots, with the
    scripted tool agent of ``tests/test_rollout.py``: the batched rollout returns what the cached rollout and TRL's
    loop return (tokens, tool masks, conversational completions, tool-call counts; log-probs against TRL's
    training forward)."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    script = ScriptedToolCalls(tokenizer, lambda task: task.n_ops if task.start % 2 else 0)
    engine_class = rollout_module.RolloutEngine

    def scripted_engine(*args, **kwargs):
        return engine_class(*args, logits_processor=LogitsProcessorList([script]), **kwargs)

    monkeypatch.setattr(rollout_module, "RolloutEngine", scripted_engine)
    results = {}
    for rollout, extra in (("trl", []), ("cached", []), ("batched", ["grpo.rollout_slots=3"])):
        trainer = _trainer(base, tmp_path, rollout, *extra)
        _script(trainer.model, script)
        tasks = [ArithmeticTask.from_json(t) for t in trainer.train_dataset["task"]][:2]
        rows = _rows(trainer, [tasks[0], tasks[0], tasks[1], tasks[1]])
        (prompt_ids, completion_ids, tool_mask, completions, logprobs, *_), out = _play(trainer, rows)
        results[rollout] = dict(trainer=trainer, prompt_ids=[list(p) for p in prompt_ids], out=out,
                                completion_ids=completion_ids, tool_mask=tool_mask, completions=completions,
                                logprobs=logprobs, calls=trainer._metrics["train"]["tools/call_frequency"])
    batched = results["batched"]
    assert isinstance(batched["trainer"], BatchedRolloutGRPOTrainer)
    assert batched["trainer"].rollout_engine_stats["forks"] == 2
    for other in ("trl", "cached"):
        for key in ("prompt_ids", "completion_ids", "tool_mask", "completions", "calls"):
            assert batched[key] == results[other][key], (other, key)
    cached = results["cached"]["logprobs"]
    for got, want in zip(batched["logprobs"], cached, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
    o, trainer = results["trl"]["out"], results["trl"]["trainer"]
    with torch.no_grad():
        reference, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([o["prompt_ids"], o["completion_ids"]], 1),
            torch.cat([o["prompt_mask"], o["completion_mask"]], 1), o["completion_ids"].size(1))
    for row, (logps, mask) in enumerate(zip(batched["logprobs"], batched["tool_mask"], strict=True)):
        keep = torch.tensor(mask).bool()
        got, want = torch.tensor(logps), reference[row, :len(logps)]
        assert torch.allclose(got[keep], want[keep], atol=1e-5, rtol=0) and (got[~keep] == 0).all()
    assert [m.count(0) > 0 for m in batched["tool_mask"]] == [True, True, True, True]


def test_batched_training_run_equals_cached_training_run(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    """The "Done when" equality at a small size: two optimizer steps of sampled GRPO (environment mode, temperature
    1) with ``grpo.rollout: batched`` give the cached rollout's trajectories, rewards and weights."""
    runs = {}
    for rollout in ("cached", "batched"):
        trainer = _trainer(base, tmp_path, rollout, "trainer.max_steps=2", "trainer.generation_kwargs=null",
                           "trainer.temperature=1.0", "trainer.max_completion_length=24")
        seen = []
        generate = trainer._generate

        def recording(prompts, _generate=generate, _seen=seen):
            out = _generate(prompts)
            _seen.append(out[1])
            return out

        trainer._generate = recording
        trainer.train()
        runs[rollout] = dict(completions=seen, params=[p.detach().clone() for p in trainer.model.parameters()],
                             rewards=[row.get("reward") for row in trainer.state.log_history if "reward" in row])
    assert len(runs["cached"]["completions"]) == 2
    first = runs["cached"]["completions"][0]
    assert first[0] != first[1]  # sampled: one prompt, two different episodes
    assert runs["batched"]["completions"] == runs["cached"]["completions"]
    assert runs["batched"]["rewards"] == runs["cached"]["rewards"]
    for a, b in zip(runs["batched"]["params"], runs["cached"]["params"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
