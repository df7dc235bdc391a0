"""The rollout engine with the slot decode kernels against the same engine with them switched off.

With them, the one-token sequences of a step update their KDA and conv states in the pools in place
(``causal_conv1d_update_slots``, ``fused_recurrent_kda_slots``), the longer ones too (``causal_conv1d_varlen_slots``,
``chunk_kda`` with ``initial_state_indices``), and the one-token MLA queries read a group's prefix once and
their own rows where they are (``latent_attention_shared_prefix``). Without them, every sequence is gathered from the
pools, run through ``kernel_dispatch``'s ops and scattered back, and the MLA layers run in PyTorch; that path is
checked against the one-at-a-time cached rollout in ``tests/test_rollout_engine.py``.

A tiny model with ``kernel_backend="triton"`` on the CPU interpreter (``TRITON_INTERPRET=1``, tests/conftest.py), in
float32, with a KDA head dim of 16 (the kernels' smallest): five single-turn episodes on three slots, two of them a
GRPO group (a fork copies the leader's pools), so slots are refilled and new prompts prefill in the same steps as
other slots decode. That run takes about 90 s on the interpreter, so it is skipped unless ``KDAMOE_ENGINE_KERNEL_TEST``
is set (or on a GPU, ``KDAMOE_TEST_ON_GPU``); the always-on test runs the same episodes with the slot kernels forced
on a model whose other ops run in PyTorch.
"""

import os
import types

import pytest
import torch
from transformers import GenerationConfig

import kdamoe.kernels as kernels
from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining.engine import EpisodeSpec, RolloutEngine
from tests.helpers import tiny_config

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _model(backend: str, **overrides) -> KDAMoEForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(kda_head_dim=16, kernel_backend=backend, max_position_embeddings=256, **overrides)
    return KDAMoEForCausalLM(config).eval()


def _engine(model, slot_kernels: bool) -> RolloutEngine:
    engine = RolloutEngine(model, GenerationConfig(do_sample=False, max_new_tokens=5, pad_token_id=0), num_slots=3,
                           eos_token_ids=[2], max_completion_length=5, prefill_chunk_size=8)
    engine.use_slot_kernels = slot_kernels
    return engine


def _compare(model, monkeypatch, index_rows=False):
    """Five episodes with the slot kernels and without; checks the kernels ran (on every KDA layer of the steps
    with decodes, next to prefills in some) and that the episodes are the same. ``index_rows``: the decode rows of a
    mixed step (and the longer sequences' rows) are picked by an index tensor, as for a step whose decodes do not come
    first, instead of a slice."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in (5, 11, 3, 7)]
    specs = [EpisodeSpec(prompts[i]) for i in (0, 1, 1, 2, 3)]  # episodes 1 and 2: one group, one prompt

    calls, steps = {"kda": 0, "conv": 0, "mla": 0, "chunk_kda": 0, "conv_varlen": 0}, []
    def counted(op, key):
        def spy(*args, **kwargs):
            # chunk_kda: only its pool-indexed calls (on the triton backend the ops of kernel_dispatch call it too)
            calls[key] += key != "chunk_kda" or kwargs.get("initial_state_indices") is not None
            return op(*args, **kwargs)

        return spy

    for name, key in (("fused_recurrent_kda_slots", "kda"), ("causal_conv1d_update_slots", "conv"),
                      ("latent_attention_shared_prefix", "mla"), ("chunk_kda", "chunk_kda"),
                      ("causal_conv1d_varlen_slots", "conv_varlen")):
        monkeypatch.setattr(kernels, name, counted(getattr(kernels, name), key))
    split = RolloutEngine._decode_split

    def spy_split(self):
        decode, rest = split(self)
        steps.append((decode is not None, rest is not None))
        if index_rows and decode is not None and isinstance(decode.tokens, slice):  # the gather path's positions
            decode.tokens = torch.arange(decode.tokens.stop, device=decode.slots.device)
        if index_rows and rest is not None:  # the longer sequences' rows by rest.tokens too, not a view
            rest.span = None
        return decode, rest

    monkeypatch.setattr(RolloutEngine, "_decode_split", spy_split)
    static_forward, static = RolloutEngine._static_forward, []

    def spy_static(self, feeds):
        static.append(len(feeds))
        return static_forward(self, feeds)

    monkeypatch.setattr(RolloutEngine, "_static_forward", spy_static)

    without = _engine(model, False).run(specs)
    assert calls == {"kda": 0, "conv": 0, "mla": 0, "chunk_kda": 0, "conv_varlen": 0} and not steps and not static
    engine = _engine(model, True)
    got = engine.run(specs)
    kda_layers = sum(layer.layer_type == "linear_attention" for layer in model.model.layers)
    mla_layers = len(model.model.layers) - kda_layers
    # the decode-only steps take the static path (tests/test_engine_static_steps.py), every other step asks every
    # KDA layer for its split
    assert static and len(steps) == kda_layers * (engine.stats["steps"] - len(static))
    with_decodes = sum(decode for decode, _ in steps)
    assert calls["kda"] == calls["conv"] == with_decodes + kda_layers * len(static) and with_decodes > 0
    assert calls["mla"] == with_decodes // kda_layers * mla_layers
    # the multi-token sequences (prompt chunks) on the pools in place: one varlen conv and one pool-indexed chunk_kda
    # per KDA layer of every step that has them
    with_chunks = sum(rest for _, rest in steps)
    assert with_chunks > 0 and calls["conv_varlen"] == calls["chunk_kda"] == with_chunks
    assert (True, True) in steps  # a step where prefills and decodes ran side by side
    for g, w in zip(got, without, strict=True):
        assert g["completion_ids"] == w["completion_ids"]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"], strict=True)) <= 1e-5
    assert [len(g["completion_ids"]) for g in got] == [5] * 5  # every turn ran to its cap: decodes on every slot


# The MLA options of Kimi Linear: a key part shared by every head (cache rows [c | k_shared], 16 + 8 wide) and a q LoRA
SHARED_KEY = dict(q_lora_rank=12, qk_head_dim=24, qk_rope_head_dim=8, v_head_dim=12)


@pytest.mark.skipif(ON_GPU, reason="the slot kernels on CPU tensors: a CPU-interpreter test")
@pytest.mark.parametrize("options,index_rows", [({}, False), (SHARED_KEY, True)], ids=["defaults", "shared_key"])
def test_engine_with_slot_kernels_equals_engine_without(monkeypatch, options, index_rows):
    """The model's other ops on PyTorch (fast on the CPU), the slot kernels forced on (the engine would take them
    only where ``kernel_backend`` resolves to the kdamoe kernels; the next test runs that set-up)."""
    monkeypatch.setattr(RolloutEngine, "_slot_kernels",
                        lambda self, attn, x: self.use_slot_kernels and getattr(attn, "lower_bound", 0) is not None)
    _compare(_model("torch", **options), monkeypatch, index_rows)


@pytest.mark.skipif(not (ON_GPU or os.environ.get("KDAMOE_ENGINE_KERNEL_TEST")),
                    reason="every op on the Triton interpreter: about 90 s on 2 cores; set KDAMOE_ENGINE_KERNEL_TEST=1")
def test_engine_with_slot_kernels_equals_engine_without_on_the_triton_backend(monkeypatch):
    """The set-up the engine takes the kernels in: ``kernel_backend="triton"`` (CUDA, or the CPU interpreter)."""
    _compare(_model("triton").to(DEVICE), monkeypatch)


@pytest.mark.parametrize("backend,bounded,expected", [("triton", True, True), ("auto", True, False),
                                                     ("torch", True, False), ("fla", True, False),
                                                     ("triton", False, False)])
@pytest.mark.skipif(ON_GPU, reason="the CPU's backend choice: a CPU-interpreter test")
def test_slot_kernels_only_where_the_kdamoe_kernels_run(backend, bounded, expected):
    """On the CPU only ``"triton"`` under the interpreter takes the kernels (``"auto"`` resolves to PyTorch there,
    as for every op of the model); Kimi Linear's unbounded gate never does in a KDA layer (the kernels refuse it),
    while its MLA layers still may."""
    model = _model("torch", **({} if bounded else dict(kda_lower_bound=None, kda_use_A_log=True)))
    engine = _engine(model, True)
    model.config.kernel_backend = backend  # the engine reads the backend at every step, as the model does
    x = torch.zeros(1, 1, 32)
    kda, mla = (next(layer.self_attn for layer in model.model.layers if layer.layer_type == kind)
                for kind in ("linear_attention", "full_attention"))
    assert engine._slot_kernels(kda, x) is expected
    assert engine._slot_kernels(mla, x) is (backend == "triton")
    engine.use_slot_kernels = False
    assert engine._slot_kernels(kda, x) is False and engine._slot_kernels(mla, x) is False


@pytest.mark.parametrize("lengths", [[3, 1, 2, 1], [1, 1, 4], [1, 2], [2, 5]])
def test_decode_split_positions(lengths):
    """The step's one-token sequences and the rest, for any order of the step (the engine puts decodes first today, a
    scheduler may not): their flat token positions and slots, against positions counted by hand."""
    engine = _engine(_model("torch"), True)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    lay = types.SimpleNamespace(lengths=torch.tensor(lengths), starts=torch.tensor(starts),
                                slots=torch.tensor([7, 2, 5, 0][:len(lengths)]))
    engine._layout = lay
    decode, rest = engine._decode_split()
    one = [i for i, n in enumerate(lengths) if n == 1]
    many = [i for i, n in enumerate(lengths) if n > 1]
    if one:
        rows = torch.arange(sum(lengths))[decode.tokens] if decode.tokens is not None else torch.arange(sum(lengths))
        assert rows.tolist() == [starts[i] for i in one]
        assert decode.slots.dtype == torch.int32 and decode.slots.tolist() == [lay.slots[i] for i in one]
    else:
        assert decode is None
    if many:
        assert rest.tokens.tolist() == [starts[i] + c for i in many for c in range(lengths[i])]
        assert rest.row.tolist() == [j for j, i in enumerate(many) for _ in range(lengths[i])]
        assert rest.col.tolist() == [c for i in many for c in range(lengths[i])]
        assert rest.lengths.tolist() == [lengths[i] for i in many] and rest.t_max == max(lengths[i] for i in many)
        assert rest.slots.tolist() == [lay.slots[i] for i in many]
        assert rest.cu_seqlens.tolist() == [sum(lengths[i] for i in many[:j]) for j in range(len(many) + 1)]
        if rest.span is not None:  # a view of the step's rows: the same positions
            assert torch.arange(sum(lengths))[rest.span].tolist() == rest.tokens.tolist()
    else:
        assert rest is None
    assert engine._decode_split() is lay.split  # computed once per forward
