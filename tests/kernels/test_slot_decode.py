"""The slot-pool decode kernels of the rollout engine: ``fused_recurrent_kda_slots`` and
``causal_conv1d_update_slots`` update the states of a pool in place, and must equal the engine's former path
(gather the slots' states, run the batch op, scatter the new states back) and a float64 brute force: the naive
recurrence (``naive_recurrent_kda_slots``) and a loop over the conv taps. Slots not named keep their bits.
``latent_attention_shared_prefix`` (a group's MLA prefix rows read once for its members, each member's own rows
apart) against a float64 softmax over each sequence's rows concatenated, and against ``latent_attention`` on them.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from kdamoe.kernels import (
    causal_conv1d_update_slots,
    fused_recurrent_kda,
    fused_recurrent_kda_slots,
    latent_attention,
    latent_attention_shared_prefix,
)
from kdamoe.kernels.kda.naive import naive_recurrent_kda_slots
from kdamoe.kernels.mla.naive import naive_latent_attention_shared_prefix
from kdamoe.kernels.utils import relative_error
from kdamoe.model.kda_torch import causal_conv1d_torch

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
    assert relative_error(o, ro) <= TOL[dtype] and relative_error(pool[ids.long()], rpool[ids.long()]) <= TOL[dtype]
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


def conv_brute_force(x, pool, slots, weight):
    """float64 loop over the taps: the new window of each named slot and the SiLU of its weighted sum."""
    pool = pool.double().clone()
    y = torch.zeros(x.shape, dtype=torch.float64)
    W = weight.shape[1]
    for n, s in enumerate(slots):
        window = torch.cat([pool[s, :, 1:], x[n].double()[:, None]], 1)
        for c in range(x.shape[1]):
            pre = sum(float(window[c, m]) * float(weight[c, m]) for m in range(W))
            y[n, c] = pre / (1 + torch.exp(torch.tensor(-pre, dtype=torch.float64)))
        pool[s] = window
    return y, pool


@pytest.mark.parametrize("dtype,C,W,slots,seed", [
    (torch.float32, 12, 4, [2, 0, 4], 41),
    (torch.float16, 70, 4, [1, 3], 42),  # C = 70: a masked channel block
    (torch.float32, 10, 3, [4], 43),
    (torch.float16, 8, 1, [0, 1], 44),  # W = 1: the window is the new input alone
])
def test_conv_slots_equals_gather_op_scatter_and_brute_force(dtype, C, W, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    N = len(slots)
    wide = torch.randn(N, C + 5, generator=gen).to(dtype).to(DEVICE)
    x = wide[:, 5:]  # a column slice: rows C + 5 apart, read in place
    weight = (torch.randn(C, W, generator=gen) / W ** 0.5).to(dtype).to(DEVICE)
    pool = torch.randn(5, C, W, generator=gen).to(dtype).to(DEVICE)
    before = pool.clone()
    ids = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    y = causal_conv1d_update_slots(x, pool, ids, weight)
    assert y.shape == (N, C) and y.dtype == dtype

    # the engine's former path on the CPU: gather, the PyTorch conv op on one token, scatter
    want_pool = before.clone().cpu()
    ref_y, new_state = causal_conv1d_torch(x.cpu()[:, None].double(), weight.cpu().double(),
                                           want_pool[ids.long().cpu()].double())
    want_pool[ids.long().cpu()] = new_state.to(dtype)
    assert relative_error(y, ref_y[:, 0]) <= TOL[dtype]
    assert torch.equal(pool.cpu(), want_pool)  # the window is copied, never rounded: bit for bit

    bf_y, bf_pool = conv_brute_force(x.cpu(), before.cpu(), slots, weight.cpu())
    assert relative_error(y, bf_y) <= TOL[dtype] and torch.equal(pool.cpu().double(), bf_pool)


def test_conv_slots_argument_errors():
    x = torch.randn(2, 6, device=DEVICE)
    weight = torch.randn(6, 4, device=DEVICE)
    pool = torch.zeros(3, 6, 4, device=DEVICE)
    ids = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[N, C\]"):
        causal_conv1d_update_slots(x[:, None], pool, ids, weight)
    with pytest.raises(ValueError, match=r"conv_pool must be \[num_slots, C, W\] = \(num_slots, 6, 4\)"):
        causal_conv1d_update_slots(x, pool[..., :3], ids, weight)
    with pytest.raises(ValueError, match="conv_pool dtype"):
        causal_conv1d_update_slots(x, pool.long(), ids, weight)
    with pytest.raises(ValueError, match="conv_pool must be contiguous"):
        causal_conv1d_update_slots(x, pool.transpose(1, 2).contiguous().transpose(1, 2), ids, weight)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d_update_slots(x, pool, ids, weight[:5])
    with pytest.raises(ValueError, match="slot_ids must be distinct"):
        causal_conv1d_update_slots(x, pool, ids * 0, weight)
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, num_slots=3\)"):
        causal_conv1d_update_slots(x, pool, ids + 1, weight)
    with pytest.raises(ValueError, match="slot_ids must be a torch.Tensor"):
        causal_conv1d_update_slots(x, pool, [0, 2], weight)
    with pytest.raises(ValueError, match="no backward"):
        causal_conv1d_update_slots(x.clone().requires_grad_(), pool, ids, weight)


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


def mla_inputs(H, R, DR, prefix_lens, own_lens, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    D = R + DR
    q = torch.randn(len(own_lens), H, D, generator=gen).to(dtype).to(DEVICE)
    prefixes = [torch.randn(n, D, generator=gen).to(dtype).to(DEVICE) for n in prefix_lens]
    own = [torch.randn(n, D, generator=gen).to(dtype).to(DEVICE) for n in own_lens]
    return q, prefixes, own


MLA_CASES = [  # dtype, H, R, Dr, prefix lengths, group of each sequence, own lengths, splits, seed
    # two groups, one member alone (-1); 140 own rows > one 128-row key block; the default split count
    (torch.float32, 2, 16, 0, [40, 200], [0, 1, 0, -1, 1], [3, 1, 5, 140, 2], None, 51),
    (torch.float32, 2, 16, 0, [40, 200], [0, 1, 0, -1, 1], [3, 1, 5, 140, 2], 3, 51),  # round robin over 3 splits
    (torch.float16, 4, 16, 8, [130], [0, 0, 0], [1, 2, 129], 2, 52),  # a shared key part (Dr = 8), 12 query rows
    (torch.float32, 8, 32, 0, [0, 7], [0, 1, -1], [4, 1, 0], 2, 53),  # an empty prefix; a sequence with no row
]


@pytest.mark.parametrize("dtype,H,R,DR,prefix_lens,group,own_lens,splits,seed", MLA_CASES)
def test_mla_shared_prefix_equals_float64(dtype, H, R, DR, prefix_lens, group, own_lens, splits, seed):
    q, prefixes, own = mla_inputs(H, R, DR, prefix_lens, own_lens, seed, dtype)
    scale = (R + DR) ** -0.5
    o = latent_attention_shared_prefix(q, prefixes, group, own, scale, value_dim=R, num_splits=splits)
    assert o.shape == (len(group), H, R) and o.dtype == dtype
    ref = naive_latent_attention_shared_prefix(q, prefixes, group, own, scale, value_dim=R)
    empty = [n for n in range(len(group)) if own_lens[n] == 0 and (group[n] < 0 or prefix_lens[group[n]] == 0)]
    seen = [n for n in range(len(group)) if n not in empty]
    assert relative_error(o[seen], ref[seen]) <= TOL[dtype]
    assert torch.equal(o[empty].cpu(), torch.zeros_like(o[empty].cpu()))  # no row: exactly 0


def test_mla_shared_prefix_equals_latent_attention_per_sequence():
    """Against the flash-decoding op of the same family on each sequence's rows concatenated (a copy per sequence:
    the engine's gather), so the two kernels agree where both apply."""
    q, prefixes, own = mla_inputs(2, 16, 8, [50], [3, 9, 4], 61, torch.float32)
    group = [0, 0, -1]
    o = latent_attention_shared_prefix(q, prefixes, group, own, 0.3, value_dim=16)
    for n in range(3):
        rows = torch.cat(([prefixes[group[n]]] if group[n] >= 0 else []) + [own[n]])
        want = latent_attention(q[n][None, None], rows[None], torch.tensor(rows.shape[0], device=DEVICE), 0.3,
                                value_dim=16)
        assert relative_error(o[n], want[0, 0]) <= 1e-6


def test_mla_shared_prefix_argument_errors():
    q, prefixes, own = mla_inputs(2, 16, 0, [5], [2, 3], 71, torch.float32)
    group = [0, -1]
    with pytest.raises(ValueError, match=r"q must be \[N, H, D\]"):
        latent_attention_shared_prefix(q[0], prefixes, group, own, 1.0)
    with pytest.raises(ValueError, match="value_dim"):
        latent_attention_shared_prefix(q, prefixes, group, own, 1.0, value_dim=12)
    with pytest.raises(ValueError, match="N = 2 entries"):
        latent_attention_shared_prefix(q, prefixes, group, own[:1], 1.0)
    with pytest.raises(ValueError, match=r"group entries must be ints in \[-1, 1\)"):
        latent_attention_shared_prefix(q, prefixes, [0, 1], own, 1.0)
    with pytest.raises(ValueError, match=r"prefixes\[0\] dtype"):
        latent_attention_shared_prefix(q, [prefixes[0].half()], group, own, 1.0)
    with pytest.raises(ValueError, match=r"own\[1\] must be \[L, D\] with D = 16"):
        latent_attention_shared_prefix(q, prefixes, group, [own[0], own[1][:, :8]], 1.0)
    with pytest.raises(ValueError, match=r"own\[0\] must be contiguous"):
        latent_attention_shared_prefix(q, prefixes, group, [torch.randn(16, 4, device=DEVICE).T, own[1]], 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        latent_attention_shared_prefix(q, prefixes, group, own, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="no backward"):
        latent_attention_shared_prefix(q.clone().requires_grad_(), prefixes, group, own, 1.0)
