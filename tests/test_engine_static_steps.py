"""The rollout engine's static decode steps (docs/post-training.md, "Host work of a step"): a step whose sequences are
all one token and whose every layer runs the slot kernels runs on the static inputs of its batch-size bucket (token
ids, slots with padding rows on a scratch slot, each MLA layer's ``SharedPrefixPlan`` tables and new-row addresses,
filled in one copy) — on a GPU, the step a CUDA graph captures and replays.

Checked on the CPU (the kernels under the Triton interpreter, tests/conftest.py): episodes on the static path equal
the engine's plain gather → op → scatter path (``use_slot_kernels=False``, which uses no kernel), greedy and sampled,
with GRPO groups, tool turns of uneven lengths and episodes ending at different steps, so the buckets change and
padding rows occur (the steps with prompt chunks or tool turns run those on the pools in place, next to the
decodes); the capture decisions (warm-up, capture, replay, recapture after a parameter is replaced or moved
or an address the graph read changed) and the buckets. The capture itself needs CUDA (skipped without it).
"""

import types

import pytest
import torch
from transformers import GenerationConfig

import kdamoe.posttraining.engine as engine_module
from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine, episode_seed
from tests.helpers import tiny_config

MARK = 90  # the first id of every tool turn; the turn's other ids count down from 89


def echo(n: int) -> int:
    """The tool: returns its argument, which sets the length of the tool turn."""
    return n


def parse_turn(ids, prefix, schemas):
    """A tool call while the episode has had fewer tool turns than ``schemas["rounds"]`` (counted by the ids of
    ``MARK`` before the turn), its argument ``schemas["suffix"]`` plus that count: tool turns of uneven lengths."""
    rounds = prefix.count(MARK)
    if rounds < schemas["rounds"]:
        call = {"type": "function", "function": {"name": "echo", "arguments": {"n": schemas["suffix"] + rounds}}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "assistant", "content": "done"}


def tool_suffix_ids(messages) -> list[int]:
    return [MARK] + [MARK - 1 - i for i in range(int(messages[-1]["content"]))]


@pytest.fixture(scope="module")
def model():
    """Two layers (one KDA, one MLA), one KDA head of 16 (the kernels' smallest): few interpreter programs."""
    torch.manual_seed(0)
    config = tiny_config(kda_head_dim=16, kda_num_heads=1, num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], max_position_embeddings=256)
    return KDAMoEForCausalLM(config).eval()


def _forced_slot_kernels(self, attn, x):
    # the slot kernels on a model whose other ops run in PyTorch (fast on the CPU), as tests/test_rollout_engine_kernels
    # does; the engine would take them where kernel_backend resolves to the kdamoe kernels (CUDA)
    return self.use_slot_kernels and getattr(attn, "lower_bound", 0) is not None


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_static_steps_equal_the_plain_path(model, monkeypatch, do_sample):
    monkeypatch.setattr(RolloutEngine, "_slot_kernels", _forced_slot_kernels)
    filled = []
    fill = engine_module._StaticStep.fill

    def spy_fill(self, engine, feeds):
        filled.append((self.B, len(feeds)))
        return fill(self, engine, feeds)

    monkeypatch.setattr(engine_module._StaticStep, "fill", spy_fill)
    chunks, kda_chunks = [], RolloutEngine._kda_chunks

    def spy_chunks(self, attn, qkv, f, beta, rest, o):
        chunks.append(o is not None)  # o is given when the step's decodes ran first: a mixed step
        return kda_chunks(self, attn, qkv, f, beta, rest, o)

    monkeypatch.setattr(RolloutEngine, "_kda_chunks", spy_chunks)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 80, (n,), generator=gen).tolist() for n in (6, 3, 9)]
    # a group of three (two tool rounds), a group of two (none), two episodes alone with one and three rounds
    plan = [(0, 2, 1), (0, 2, 1), (0, 2, 1), (1, 0, 0), (1, 0, 0), (2, 1, 3), (2, 3, 0)]
    specs = [EpisodeSpec(prompts[k] + ([] if i < 5 else [i]), tools={"echo": echo},
                         schemas={"rounds": rounds, "suffix": suffix}, seed=episode_seed(3, i))
             for i, (k, rounds, suffix) in enumerate(plan)]
    config = GenerationConfig(do_sample=do_sample, temperature=0.9 if do_sample else None, max_new_tokens=3,
                              pad_token_id=0)
    results = {}
    for slot_kernels in (False, True):
        engine = RolloutEngine(model, config, num_slots=4, eos_token_ids=[2], max_completion_length=24,
                               max_tool_calling_iterations=3, parse_turn=parse_turn, tool_suffix_ids=tool_suffix_ids,
                               prefill_chunk_size=8)
        engine.use_slot_kernels = slot_kernels
        results[slot_kernels] = engine.run(specs)
        assert engine.stats["graph_captures"] == engine.stats["graph_replays"] == 0  # no graph on the CPU
    for got, want in zip(results[True], results[False], strict=True):
        for key in ("completion_ids", "tool_mask", "ended", "tool_calls"):
            assert got[key] == want[key], key
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) <= 1e-5
    assert sum(g["tool_calls"] for g in results[True]) >= 4  # tool turns were played
    # prompt chunks and tool turns ran on the pools in place (causal_conv1d_varlen_slots, chunk_kda with
    # initial_state_indices), in some steps next to decodes
    assert any(chunks) and not all(chunks)
    buckets = {B for B, _ in filled}
    assert len(buckets) >= 2 and any(n < B for B, n in filled)  # the bucket changed and padding rows ran
    assert all(B == min(1 << (n - 1).bit_length(), 4) for B, n in filled)


def test_bucket_is_the_next_power_of_two_up_to_the_slots(model):
    engine = RolloutEngine(model, GenerationConfig(do_sample=False, pad_token_id=0), num_slots=6, eos_token_ids=[2],
                           max_completion_length=4)
    assert [engine._bucket(n) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert all(pool.shape[0] == 6 + 1 for pool in (*engine.recurrent.values(), *engine.conv.values()))  # + scratch
    assert not engine._graphs_apply()  # CPU: no graphs
    with pytest.raises(ValueError, match="cuda_graphs must be a bool, got 'yes'"):
        RolloutEngine(model, GenerationConfig(do_sample=False, pad_token_id=0), num_slots=2, eos_token_ids=[2],
                      max_completion_length=4, cuda_graphs="yes")


def test_capture_decisions(model):
    """``_StepGraphs.action``: a bucket's first step warms up, the next captures, later ones replay; a replaced
    parameter (a new ``Parameter`` in its slot), a moved one (``.data =``), another model or a changed address of the
    step (a pool, a buffer) recaptures; an in-place update of a weight (an optimizer step) does not."""
    graphs = engine_module._StepGraphs()
    addresses = [11, 22]
    assert graphs.action(4, model, addresses) == "warm_up"
    graphs.warm.add(4)
    assert graphs.action(4, model, addresses) == "capture"
    graphs.entries[4] = types.SimpleNamespace(watch=engine_module.ParameterWatch(model), addresses=list(addresses))
    assert graphs.action(4, model, addresses) == "replay"
    assert graphs.action(2, model, addresses) == "warm_up"  # buckets are separate
    with torch.no_grad():
        model.lm_head.weight.add_(0.0)  # in place: the graph reads the new values where they are
    assert graphs.action(4, model, addresses) == "replay"
    assert graphs.action(4, model, [11, 23]) == "capture"
    other = KDAMoEForCausalLM(model.config).eval()
    assert graphs.action(4, other, addresses) == "capture"
    norm = model.model.norm
    weight = norm.weight
    try:
        norm.weight = torch.nn.Parameter(weight.detach().clone())
        assert graphs.action(4, model, addresses) == "capture"
        norm.weight = weight
        assert graphs.action(4, model, addresses) == "replay"
        old = weight.data
        weight.data = old.clone()
        assert graphs.action(4, model, addresses) == "capture"
    finally:
        norm.weight = weight
        weight.data = old


def test_static_step_addresses_stay_when_an_episode_buffer_grows(model, monkeypatch):
    """An episode's MLA buffer that grows moves to a new address: that address travels in the step's tables, the
    addresses a graph bakes in stay (no recapture for it)."""
    monkeypatch.setattr(RolloutEngine, "_slot_kernels", _forced_slot_kernels)
    engine = RolloutEngine(model, GenerationConfig(do_sample=False, pad_token_id=0), num_slots=2, eos_token_ids=[2],
                           max_completion_length=4)
    step = engine_module._StaticStep(engine, 2)
    episodes = [engine_module._Episode(i, EpisodeSpec([5, 6])) for i in range(2)]
    for i, episode in enumerate(episodes):
        episode.slot = i
    mla = step.mla[0].layer_idx
    before = engine._graph_addresses(step)
    moved = False
    for _ in range(20):  # past the buffers' first 16 rows: they reallocate
        first = episodes[0].own[mla].data.data_ptr() if mla in episodes[0].own else None
        step.fill(engine, [(e, [7]) for e in episodes])
        moved |= first is not None and episodes[0].own[mla].data.data_ptr() != first
        rows = episodes[0].own[mla]
        assert step.new_rows[mla][0].item() == rows.data[rows.length - 1].data_ptr()  # the new row's address
    assert moved and engine._graph_addresses(step) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capturing a CUDA graph needs a CUDA device")
def test_graph_replay_equals_the_eager_static_steps():
    """On CUDA with the kdamoe kernels: the same episodes with ``cuda_graphs`` on and off give the same tokens, and the
    graphs were captured and replayed."""
    torch.manual_seed(0)
    config = tiny_config(kda_head_dim=16, kernel_backend="triton", max_position_embeddings=256)
    model = KDAMoEForCausalLM(config).cuda().eval()
    specs = [EpisodeSpec([5, 9, 14, 3, 22][: 2 + k % 3], seed=k) for k in range(5)]
    results, stats = {}, {}
    for graphs in (False, True):
        engine = RolloutEngine(model, GenerationConfig(do_sample=False, max_new_tokens=12, pad_token_id=0),
                               num_slots=4, eos_token_ids=[96], max_completion_length=12, cuda_graphs=graphs)
        results[graphs], stats[graphs] = engine.run(specs), engine.stats
    assert stats[False]["graph_captures"] == 0 and stats[True]["graph_captures"] >= 1
    assert stats[True]["graph_replays"] > stats[True]["graph_captures"]
    for got, want in zip(results[True], results[False], strict=True):
        assert got["completion_ids"] == want["completion_ids"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) <= 1e-4
