"""The host work of a rollout-engine step (docs/post-training.md, "Host work of a step"): a decode-only step builds
one tensor from host data (its layout, copied once) and reads the device once (every token and log-prob of the
step), whatever the number of slots; and the batched sampling of the row-wise processors (temperature, top-k, top-p
on every episode's row in one call) keeps each episode's seeded draws equal to the one-at-a-time cached rollout's.
"""

import os

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

import kdamoe.posttraining.engine as engine_module
from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine, episode_seed
from tests.helpers import tiny_config
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)
from tests.test_rollout_engine import _greedy, _prompt, _reference

ENGINE_FILE = os.path.abspath(engine_module.__file__)


@pytest.fixture(scope="module")
def policy(base):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    tokenizer = AutoTokenizer.from_pretrained(base)
    return KDAMoEForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), tokenizer


def test_row_wise_sampling_in_one_batch_equals_cached_rollout(policy, monkeypatch):
    """Five single-turn episodes (a GRPO group of three among them) on two slots, temperature + top-k + top-p, no
    extra processor: the engine applies the processors to every row at once (never reading an episode's ids, which
    the per-episode path does), and each episode's tokens equal its batch-1 ``generate`` under its own seed."""
    model, tokenizer = policy

    def no_ids(self, device):
        raise AssertionError("the row-wise processors read no ids")

    monkeypatch.setattr(engine_module._Episode, "ids_tensor", no_ids)
    specs = [EpisodeSpec(_prompt(tokenizer, k), seed=episode_seed(11, i)) for i, k in enumerate([0, 1, 1, 1, 2])]
    config = _greedy(tokenizer, do_sample=True, temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=12)
    want = _reference(model, tokenizer, {}, config, specs, budget=12, rounds=0)
    got = RolloutEngine(model, config, num_slots=2, eos_token_ids=[tokenizer.eos_token_id], max_completion_length=12,
                        logprob_temperature=0.7, prefill_chunk_size=16).run(specs)
    for g, w in zip(got, want, strict=True):
        assert g["completion_ids"] == w["completion_ids"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= 1e-5
    assert len({tuple(g["completion_ids"]) for g in got[1:4]}) > 1  # one prompt, three seeds: not one sample


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_a_decode_step_reads_the_device_once_and_copies_one_host_tensor(monkeypatch, do_sample):
    """Six episodes decoding side by side (two prompts, forks included) on the path a GPU takes (the slot kernels,
    forced on here as in ``tests/test_rollout_engine_kernels.py``; the other ops in PyTorch): every decode-only
    step's host reads (``.tolist()``, ``.item()``, ``int()`` / ``float()`` / ``bool()`` of a tensor) and tensors
    built from Python data, counted where the engine's own code makes them (the model's CPU paths and the kernels'
    wrappers have their own)."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, max_position_embeddings=256)).eval()
    monkeypatch.setattr(RolloutEngine, "_slot_kernels", lambda self, attn, x: True)
    counts = {"read": 0, "build": 0}

    def from_engine() -> bool:
        frame = __import__("sys")._getframe(2)
        return os.path.abspath(frame.f_code.co_filename) == ENGINE_FILE

    def counted(method, key):
        def wrapper(*args, **kwargs):
            if from_engine():
                counts[key] += 1
            return method(*args, **kwargs)
        return wrapper

    for name in ("tolist", "item", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), "read"))
    monkeypatch.setattr(torch, "tensor", counted(torch.tensor, "build"))
    per_step = []
    step = RolloutEngine._step

    def spy(self, runnable):
        before = dict(counts)
        decode_only = all(len(e.pending) == 1 for e in runnable)
        step(self, runnable)
        if decode_only:
            per_step.append((len(runnable), counts["read"] - before["read"], counts["build"] - before["build"]))

    monkeypatch.setattr(RolloutEngine, "_step", spy)
    config = GenerationConfig(do_sample=do_sample, temperature=0.9 if do_sample else None, max_new_tokens=8,
                              pad_token_id=0)
    prompts = [[5, 9, 14, 3, 22], [7, 30, 41]]
    specs = [EpisodeSpec(prompts[k % 2], seed=episode_seed(5, k)) for k in range(6)]
    RolloutEngine(model, config, num_slots=6, eos_token_ids=[96], max_completion_length=8,
                  prefill_chunk_size=64).run(specs)
    assert max(n for n, _, _ in per_step) == 6  # steps with every slot decoding were counted
    assert {(reads, builds) for _, reads, builds in per_step} == {(1, 1)}
