"""chunk_kda with ``initial_state_indices`` (each packed sequence starts from its row of a state pool and its final
state is written back there in place, forward only) against the float64 token-by-token recurrence of each sequence
from its pool row (``naive_recurrent_kda``); rows not named keep their bits; the same kernels without indices give
the same bits; argument errors.

Runs on the CPU interpreter (tests/conftest.py) in float32; with KDAMOE_TEST_ON_GPU=1 on a CUDA machine the same tests
run on the GPU.
"""

import os

import pytest
import torch

from kdamoe.kernels import chunk_kda
from kdamoe.kernels.kda.naive import naive_kda_lowerbound_gate, naive_l2norm, naive_recurrent_kda
from kdamoe.kernels.utils import relative_error

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = 5e-3 if ON_GPU else 2e-5  # relative L2 against float64 (tests/kernels/test_kda_chunk.py's)
H, K, V, P = 2, 16, 32, 8


def kda_inputs(lengths, seed, gate_in):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V),
             g=r(1, T, H, K) * 2 if gate_in else -5 * torch.rand(1, T, H, K, generator=gen),
             beta=torch.rand(1, T, H, generator=gen), pool=r(P, H, K, V), A_log=r(H) * 0.5, dt_bias=r(H * K),
             cu=torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32))
    return {n: t.to(DEVICE) for n, t in x.items()}


def reference(x, lengths, slots, gate_in, l2):
    """float64: every sequence alone from its pool row; returns ``(o [1, T, H, V], {slot: final state})``."""
    q, k = (naive_l2norm(x[n].double()) if l2 else x[n] for n in ("q", "k"))
    g = naive_kda_lowerbound_gate(x["g"], x["A_log"], x["dt_bias"], -5.0) if gate_in else x["g"]
    o, finals, start = [], {}, 0
    for s, L in zip(slots, lengths, strict=True):
        part = slice(start, start + L)
        on, fn = naive_recurrent_kda(q[:, part], k[:, part], x["v"][:, part], g[:, part], x["beta"][:, part],
                                     initial_state=x["pool"][s][None], output_final_state=True)
        o.append(on)
        finals[s] = fn[0]
        start += L
    return torch.cat(o, 1), finals


@pytest.mark.parametrize("lengths,slots,gate_in,l2,seed", [
    ([5, 1, 70, 17], [4, 0, 6, 2], True, True, 1),  # the engine's call; 70 tokens: two 64-token chunks
    ([1, 9], [7, 3], False, False, 2),  # the log decay given
])
def test_pool_rows_equal_float64_recurrence(lengths, slots, gate_in, l2, seed):
    x = kda_inputs(lengths, seed, gate_in)
    pool, before = x["pool"], x["pool"].clone()
    ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    gate = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"]) if gate_in else {}
    with torch.no_grad():
        o, final = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, initial_state_indices=ids,
                             output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=x["cu"],
                             lower_bound=-5.0, **gate)
    ref_o, ref_final = reference(dict(x, pool=before), lengths, slots, gate_in, l2)
    assert final is None
    assert relative_error(o, ref_o) <= TOL
    for s, state in ref_final.items():
        assert relative_error(pool[s], state) <= TOL, s
    others = [r for r in range(P) if r not in slots]
    assert torch.equal(pool[others], before[others])  # not named: every bit kept
    if gate_in:  # the same stages without indices (states gathered, returned): the same bits
        o2, final2 = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before[ids.long()],
                               output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=x["cu"],
                               lower_bound=-5.0, **gate)
        assert torch.equal(o, o2.detach()) and torch.equal(pool[ids.long()], final2.detach())


def test_without_output_final_state_the_pool_is_only_read():
    lengths, slots = [3, 4], [5, 2]
    x = kda_inputs(lengths, 3, False)
    before = x["pool"].clone()
    with torch.no_grad():
        o, final = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["pool"],
                             initial_state_indices=torch.tensor(slots, device=DEVICE), cu_seqlens=x["cu"])
    assert final is None and torch.equal(x["pool"], before)
    assert relative_error(o, reference(x, lengths, slots, False, False)[0]) <= TOL


@pytest.mark.parametrize("slots,match", [
    ([0, 8], "max 8"),  # P = 8 rows
    ([-2, 1], "min -2"),
    ([4, 4], r"distinct .*\[4, 4\]"),
    ([1, 2, 3], r"initial_state_indices must be \[N\] = \[2\]"),
])
def test_bad_indices_are_refused(slots, match):
    x = kda_inputs([2, 3], 4, False)
    before = x["pool"].clone()
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["pool"], output_final_state=True,
                  initial_state_indices=torch.tensor(slots, device=DEVICE), cu_seqlens=x["cu"])
    assert torch.equal(x["pool"], before)


def test_other_argument_errors():
    x = kda_inputs([2, 3], 5, False)
    ids = torch.tensor([0, 1], device=DEVICE)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="initial_state_indices dtype"):
        chunk_kda(*args, initial_state=x["pool"], initial_state_indices=ids.float(), cu_seqlens=x["cu"])
    with pytest.raises(ValueError, match=r"pool \[P, H, K, V\]"):
        chunk_kda(*args, initial_state=x["pool"][:, :1], initial_state_indices=ids, cu_seqlens=x["cu"])
    with pytest.raises(ValueError, match="contiguous float32"):
        chunk_kda(*args, initial_state=x["pool"].double(), initial_state_indices=ids, cu_seqlens=x["cu"])
    with pytest.raises(ValueError, match="but q requires grad"):
        chunk_kda(x["q"].requires_grad_(), *args[1:], initial_state=x["pool"], initial_state_indices=ids,
                  cu_seqlens=x["cu"])
    # an empty step (no sequence): named with the value it got, not a bare "[N+1]" (a user's probe)
    empty = {name: t[:, :0] for name, t in zip(("q", "k", "v", "g", "beta"), args, strict=True)}
    with torch.no_grad(), pytest.raises(ValueError, match=r"with N >= 1 sequence, got torch.int\d+ of shape \(1,\)"):
        chunk_kda(**empty, initial_state=x["pool"], initial_state_indices=ids[:0], cu_seqlens=x["cu"][:1])
