"""fused_recurrent_kda_slots (one KDA decode token per sequence, its state updated in place in a slot pool) against
the engine's former path (gather the slots' states, ``fused_recurrent_kda``, scatter the final states back) and the
float64 naive recurrence (``naive_recurrent_kda_slots``); slots not named keep their bits; argument errors.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from kdamoe.kernels import fused_recurrent_kda, fused_recurrent_kda_slots
from kdamoe.kernels.kda.naive import naive_recurrent_kda_slots
from kdamoe.kernels.utils import relative_error

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
H, K, V, SLOTS = 2, 16, 32, 6
# relative L2 against float64: float32 lands near 1e-7 on the CPU (tf32 dots are not used: no tl.dot here);
# float16 inputs are rounded before either side sees them, so only the float16 output rounding remains
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def kda_inputs(N, seed, dtype, gate_in):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    qkv = r(N, 2 * H * K + H * V)  # q|k|v side by side, as the engine's conv writes them
    g = r(N, H, K) * 2 if gate_in else -5 * torch.rand(N, H, K, generator=gen)
    beta = torch.rand(N, H, generator=gen)
    pool = r(SLOTS, H, K, V)
    A_log, dt_bias = r(H) * 0.5, r(H * K)
    dev = {n: t.to(DEVICE) for n, t in dict(qkv=qkv.to(dtype), g=g, beta=beta, pool=pool, A_log=A_log,
                                             dt_bias=dt_bias).items()}
    x = dev["qkv"]
    # column views of the one [N, 2HK + HV] tensor: rows 2HK + HV apart, read in place by the kernel
    dev["q"], dev["k"] = x[:, :H * K].view(N, H, K), x[:, H * K:2 * H * K].view(N, H, K)
    dev["v"] = x[:, 2 * H * K:].view(N, H, V)
    return dev


@pytest.mark.parametrize("dtype,gate,l2,slots,seed", [
    (torch.float32, "in_kernel", True, [4, 0, 2], 1),  # the engine's call: gate and L2 norm in the kernel
    (torch.float16, "in_kernel", True, [5, 1], 2),
    (torch.float32, "no_A_log", False, [3], 3),  # A_log None: a factor of 1
    (torch.float32, "precomputed", False, [1, 5, 0, 3], 4),  # g given as the log decay
])
def test_kda_slots_equals_gather_op_scatter_and_float64(dtype, gate, l2, slots, seed):
    N = len(slots)
    x = kda_inputs(N, seed, dtype, gate != "precomputed")
    ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    A_log = x["A_log"] if gate == "in_kernel" else None
    kw = dict(use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate != "precomputed", A_log=A_log,
              dt_bias=x["dt_bias"] if gate != "precomputed" else None, lower_bound=-5.0)
    before = x["pool"].clone()
    pool = x["pool"]
    o = fused_recurrent_kda_slots(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, ids, **kw)
    assert o.shape == (N, H, V) and o.dtype == dtype and pool.dtype == torch.float32

    # the engine's former path: gather, the batch decode op on N one-token sequences, scatter
    want_pool = before.clone()
    want_o, final = fused_recurrent_kda(*(t[:, None] for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])),
                                        initial_state=want_pool[ids.long()], output_final_state=True, **kw)
    want_pool[ids.long()] = final
    assert relative_error(o, want_o[:, 0]) <= 1e-6 and relative_error(pool, want_pool) <= 1e-6

    # float64 brute force (explicit K×K transition per token)
    gate_args = None if gate == "precomputed" else (None if A_log is None else A_log.cpu(), x["dt_bias"].cpu(), -5.0)
    ro, rpool = naive_recurrent_kda_slots(*(x[n].cpu() for n in ("q", "k", "v", "g", "beta")), before.cpu(),
                                          ids.cpu(), use_qk_l2norm=l2, gate=gate_args)
    # the reference lives on the CPU: index it with CPU ids (on a GPU, CUDA ids cannot index a CPU tensor)
    rows = ids.long().cpu()
    assert relative_error(o, ro) <= TOL[dtype] and relative_error(pool[ids.long()], rpool[rows]) <= TOL[dtype]
    others = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(pool[others], before[others])  # untouched, bit for bit


def test_kda_slots_chain_of_steps_equals_one_recurrence():
    """Three steps on a pool, a different subset of slots each step, against the float64 recurrence per slot."""
    steps = [[0, 3], [3], [2, 0, 3]]
    x = kda_inputs(1, 11, torch.float32, True)
    pool = x["pool"]
    ref = pool.double().cpu().clone()
    for i, slots in enumerate(steps):
        step = kda_inputs(len(slots), 20 + i, torch.float32, True)
        ids = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        args = [step[n] for n in ("q", "k", "v", "g", "beta")]
        fused_recurrent_kda_slots(*args, pool, ids, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-3.0)
        _, ref = naive_recurrent_kda_slots(*(a.cpu() for a in args), ref, ids.cpu(), use_qk_l2norm=True,
                                           gate=(x["A_log"].cpu(), x["dt_bias"].cpu(), -3.0))
    assert relative_error(pool, ref) <= TOL[torch.float32]


def test_kda_slots_argument_errors():
    x = kda_inputs(2, 31, torch.float32, True)
    q, k, v, g, beta, pool = (x[n] for n in ("q", "k", "v", "g", "beta", "pool"))
    ids = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    gate = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    with pytest.raises(ValueError, match="unbounded KDA gate"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool, ids, **gate, lower_bound=None)
    with pytest.raises(ValueError, match="lower_bound must be in"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool, ids, **gate, lower_bound=-6.0)
    with pytest.raises(ValueError, match="state_pool must be a contiguous float32"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool.half(), ids, **gate)
    with pytest.raises(ValueError, match=r"state_pool must be \[num_slots, H, K, V\]"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool[..., :16], ids, **gate)
    with pytest.raises(ValueError, match="slot_ids dtype"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool, ids.float(), **gate)
    with pytest.raises(ValueError, match=r"slot_ids must be \[N\] = \[2\]"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool, ids[:1], **gate)
    with pytest.raises(ValueError, match="slot_ids must be distinct"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool, torch.zeros_like(ids), **gate)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, num_slots=6\)"):
        fused_recurrent_kda_slots(q, k, v, g, beta, pool, ids + 5, **gate)
    with pytest.raises(ValueError, match="beta must be"):
        fused_recurrent_kda_slots(q, k, v, g, beta[:, :1], pool, ids, **gate)
    with pytest.raises(ValueError, match="q must be a 3-D tensor"):
        fused_recurrent_kda_slots(q[None], k, v, g, beta, pool, ids, **gate)
    with pytest.raises(ValueError, match="no backward"):
        fused_recurrent_kda_slots(q.clone().requires_grad_(), k, v, g, beta, pool, ids, **gate)


def test_reference_delta_rule_write_on_a_hand_case():
    """A float64 sanity check of the reference itself on a hand case: one slot, K = V = 1-hot, β = 1 replaces the
    key's row of the decayed state by v (the delta rule's write), independent of the kernels."""
    pool = torch.ones(2, 1, 16, 16, dtype=torch.float64)
    e0 = F.one_hot(torch.tensor(0), 16).double()
    q = k = e0.view(1, 1, 16)
    v = torch.full((1, 1, 16), 3.0, dtype=torch.float64)
    g = torch.zeros(1, 1, 16, dtype=torch.float64)
    beta = torch.ones(1, 1, dtype=torch.float64)
    o, new = naive_recurrent_kda_slots(q, k, v, g, beta, pool, torch.tensor([1]), scale=1.0)
    assert torch.equal(new[1, 0, 0], torch.full((16,), 3.0, dtype=torch.float64))  # row 0 overwritten by v
    assert torch.equal(new[1, 0, 1:], torch.ones(15, 16, dtype=torch.float64))  # other rows kept
    assert torch.equal(new[0], pool[0]) and torch.equal(o[0, 0], torch.full((16,), 3.0, dtype=torch.float64))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_kda_and_conv_slots_replay_from_a_cuda_graph():
    """With ``check_slot_ids_values=False`` neither op reads a device value on the host, so a decode step can be
    captured once and replayed: two replays equal two eager calls (the pools advance in place)."""
    from kdamoe.kernels import causal_conv1d_update_slots  # noqa: PLC0415 (only this GPU test uses the conv op)

    x = kda_inputs(3, 91, torch.float32, True)
    ids = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
              check_slot_ids_values=False)
    conv_x = x["qkv"][:, :H * K]
    weight = torch.randn(H * K, 4, device=DEVICE) / 2
    pool, conv_pool = x["pool"].clone(), torch.randn(SLOTS, H * K, 4, device=DEVICE)
    want, want_conv = pool.clone(), conv_pool.clone()

    def step(p, cp):
        return (fused_recurrent_kda_slots(*args, p, ids, **kw),
                causal_conv1d_update_slots(conv_x, cp, ids, weight, check_slot_ids_values=False))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and autotune outside the capture, on copies
        step(pool.clone(), conv_pool.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, y = step(pool, conv_pool)
    for _ in range(2):
        graph.replay()
        want_o, want_y = step(want, want_conv)
    torch.cuda.synchronize()
    assert relative_error(pool, want) <= 1e-6 and relative_error(o, want_o) <= 1e-6
    assert torch.equal(conv_pool, want_conv) and relative_error(y, want_y) <= 1e-6
