"""latent_attention_shared_prefix (one MLA decode query per sequence over its group's shared prefix rows, read once
for the group's members, and its own rows) against a float64 softmax over each sequence's rows concatenated
(``naive_latent_attention_shared_prefix``) and against ``latent_attention`` on them; argument errors.
``SharedPrefixPlan`` (the same kernels on fixed-capacity tables, refilled step after step, as the rollout engine's
captured decode steps use them) against the same float64 reference, and ``write_rows_at`` (rows written to
addresses read from a device table) against plain copies.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU.
"""

import os

import pytest
import torch

from kdamoe.kernels import SharedPrefixPlan, latent_attention, latent_attention_shared_prefix, write_rows_at
from kdamoe.kernels.mla.naive import naive_latent_attention_shared_prefix
from kdamoe.kernels.utils import relative_error

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# relative L2 against float64: float32 uses IEEE dots; float16 rounds the probabilities before the value dot
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


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
    (torch.float32, 2, 16, 0, [10, 30], [1, -1], [2, 3], None, 55),  # prefix 0 has no member in this step
]


if ON_GPU:  # the engine's shape on the GPU: bf16, 8 heads, R = 256, a 4K prefix shared by a group of 8
    MLA_CASES.append((torch.bfloat16, 8, 256, 0, [4096, 4096], [0] * 8 + [1] * 8, [300] * 15 + [1], None, 54))
    TOL[torch.bfloat16] = 1e-2


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


def _plan(N_cap=5, G_cap=3, H=2, R=16, DR=8, dtype=torch.float32, splits=2, **kwargs):
    return SharedPrefixPlan(max_sequences=N_cap, max_groups=G_cap, num_heads=H, key_dim=R + DR, value_dim=R,
                            dtype=dtype, device=DEVICE, num_splits=splits, **kwargs)


# one plan of capacity 5 sequences / 3 groups, refilled with steps of different shapes (the engine's buckets reuse
# one plan step after step): prefix lengths, group of each sequence, own lengths, seed
PLAN_STEPS = [
    ([40, 130], [0, 1, 0, -1, 1], [3, 1, 5, 140, 2], 81),  # full: ragged groups, one sequence alone
    ([7], [0, 0], [0, 4], 82),  # 2 of 5 sequences (the rest: padding rows), one own buffer empty
    ([0, 9, 20], [2, -1, 1], [1, 0, 3], 83),  # an empty prefix; a sequence with no row at all; 3 of 3 groups
    ([], [-1, -1, -1, -1], [2, 2, 1, 17], 84),  # no group at all
]


def test_shared_prefix_plan_refilled_step_after_step_equals_float64():
    """The tables of one plan rewritten by each step's update (fewer sequences and groups than the capacity, empty
    buffers), the launch reading only them: every step against the float64 reference; rows of q past the step's
    sequences (padding rows of a bucket) and sequences with no row give exactly 0."""
    plan = _plan()
    H, R, DR = 2, 16, 8
    for prefix_lens, group, own_lens, seed in PLAN_STEPS:
        q, prefixes, own = mla_inputs(H, R, DR, prefix_lens, own_lens, seed, torch.float32)
        q = torch.cat([q, torch.randn(5 - len(group), H, R + DR, device=DEVICE)])  # padding rows up to the bucket
        plan.update(prefixes, group, own)
        o = plan.launch(q, 0.3)
        assert o.shape == (5, H, R) and o.data_ptr() == plan.out.data_ptr()  # a fixed address
        ref = naive_latent_attention_shared_prefix(q[:len(group)], prefixes, group, own, 0.3, value_dim=R)
        empty = [n for n in range(len(group)) if own_lens[n] == 0 and (group[n] < 0 or prefix_lens[group[n]] == 0)]
        seen = [n for n in range(len(group)) if n not in empty]
        assert relative_error(o[seen], ref[seen]) <= TOL[torch.float32]
        zero = empty + list(range(len(group), 5))
        assert torch.equal(o[zero].cpu(), torch.zeros(len(zero), H, R))


def test_shared_prefix_plan_tables_in_a_callers_buffer():
    """``tables`` given (a slice of a caller's buffer) and filled by the caller from ``host_tables``, in one copy with
    its other data: the same output as ``update``."""
    q, prefixes, own = mla_inputs(2, 16, 0, [12], [3, 5], 91, torch.float32)
    size = SharedPrefixPlan.table_size(2, 2)
    buffer = torch.zeros(size + 16, dtype=torch.int64, device=DEVICE)
    plan = _plan(N_cap=2, G_cap=2, DR=0, tables=buffer[16:])
    values = plan.host_tables(prefixes, [0, 0], own)
    assert len(values) == size
    buffer.copy_(torch.tensor([7] * 16 + values))
    ref = naive_latent_attention_shared_prefix(q, prefixes, [0, 0], own, 0.5, value_dim=16)
    assert relative_error(plan.launch(q, 0.5), ref) <= TOL[torch.float32]


def test_shared_prefix_plan_argument_errors():
    q, prefixes, own = mla_inputs(2, 16, 8, [5, 6], [2, 3], 93, torch.float32)
    with pytest.raises(ValueError, match="max_sequences must be a positive int, got 0"):
        _plan(N_cap=0)
    with pytest.raises(ValueError, match="num_splits must be a positive int, got 0"):
        _plan(splits=0)
    with pytest.raises(ValueError, match="value_dim"):
        SharedPrefixPlan(max_sequences=2, max_groups=2, num_heads=2, key_dim=24, value_dim=12, dtype=torch.float32,
                         device=DEVICE)
    with pytest.raises(ValueError, match="dtype must be one of"):
        _plan(dtype=torch.int32)
    with pytest.raises(ValueError, match="tables must be a contiguous int64 tensor of"):
        _plan(tables=torch.zeros(3, dtype=torch.int64, device=DEVICE))
    plan = _plan(N_cap=2, G_cap=1)
    with pytest.raises(ValueError, match="2 prefixes exceed the plan's max_groups=1"):
        plan.update(prefixes, [0, 1], own)
    with pytest.raises(ValueError, match="3 sequences exceed the plan's max_sequences=2"):
        plan.update(prefixes[:1], [0, 0, 0], own + own[:1])
    with pytest.raises(ValueError, match=r"group entries must be ints in \[-1, 1\) \(G = len\(prefixes\)\), got 1"):
        plan.update(prefixes[:1], [0, 1], own)
    with pytest.raises(ValueError, match=r"own\[1\] dtype torch.float16"):
        plan.update(prefixes[:1], [0, 0], [own[0], own[1].half()])
    with pytest.raises(ValueError, match="one entry per sequence"):
        plan.update(prefixes[:1], [0], own)
    with pytest.raises(ValueError, match=r"q must be \[N, 2, 24\] with N <= 2"):
        plan.launch(q[:, :1], 1.0)
    # found by a user's probe: fewer q rows than the update's sequences read past q; a bad scale failed in the launch
    plan.update(prefixes[:1], [0, 0], own)
    with pytest.raises(ValueError, match="q has 1 rows but the last update named 2 sequences"):
        plan.launch(q[:1], 1.0)
    for scale in ("0.3", None, torch.tensor(0.3), float("nan"), True):
        with pytest.raises(ValueError, match="scale must be a finite Python float"):
            plan.launch(q, scale)
        with pytest.raises(ValueError, match="scale must be a finite Python float"):
            latent_attention_shared_prefix(q, prefixes, [0, 1], own, scale, value_dim=16)
    with pytest.raises(ValueError, match="device 'bogus' is not a torch device"):
        SharedPrefixPlan(max_sequences=2, max_groups=2, num_heads=2, key_dim=24, value_dim=16, dtype=torch.float32,
                         device="bogus")


def test_write_rows_at_writes_each_row_to_its_address():
    """Rows of a step to the next free row of buffers of different lengths (a strided source, as the engine's rows
    are a slice of a projection); entry 0 (a padding row) writes nothing."""
    gen = torch.Generator().manual_seed(95)
    source = torch.randn(4, 30, generator=gen).to(DEVICE)
    rows = source[:, 3:27]  # [4, 24], row stride 30
    buffers = [torch.zeros(n, 24, device=DEVICE) for n in (3, 1, 8, 2)]
    at = [2, 0, 5, None]  # row 3 is padding
    ptrs = torch.tensor([b[i].data_ptr() if i is not None else 0 for b, i in zip(buffers, at, strict=True)],
                        device=DEVICE)
    before = [b.clone() for b in buffers]
    write_rows_at(rows, ptrs)
    for n, (b, i) in enumerate(zip(buffers, at, strict=True)):
        want = before[n].clone()
        if i is not None:
            want[i] = rows[n]
        assert torch.equal(b, want)
    with pytest.raises(ValueError, match=r"row_ptrs must be an int64 tensor \[4\]"):
        write_rows_at(rows, ptrs[:3])
    with pytest.raises(ValueError, match="rows must be"):
        write_rows_at(rows[0], ptrs)
    with pytest.raises(ValueError, match="rows dtype must be float16, bfloat16 or float32, got torch.float64"):
        write_rows_at(rows.double(), ptrs)
