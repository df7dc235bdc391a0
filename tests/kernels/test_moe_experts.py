"""moe_experts (Triton, interpreter on CPU) against the float64 loop reference: outputs and all gradients."""

import pytest
import torch
from moe_reference import moe_experts_ref

from kdamoe.kernels import moe_experts
from kdamoe.kernels.moe.permute import expert_permutation
from kdamoe.kernels.utils import relative_error


def make_case(n, hid, inter, e, k, seed, drop=0.0, skew=None, absent=(), scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hid, generator=g) * scale
    w1 = torch.randn(e, 2 * inter, hid, generator=g) * hid ** -0.5
    w2 = torch.randn(e, hid, inter, generator=g) * inter ** -0.5
    probs = torch.ones(e) if skew is None else skew
    probs = probs.clone()
    for a in absent:
        probs[a] = 0.0
    idx = torch.stack([torch.multinomial(probs, k, replacement=False, generator=g) for _ in range(n)])
    if drop:
        idx[torch.rand(idx.shape, generator=g) < drop] = e
    w = torch.rand(n, k, generator=g) + 0.1
    return [t.to(dtype) for t in (x, w, w1, w2)], idx


def check(n, hid, inter, e, k, seed, activation="situ", tol=2e-5, **kw):
    (x, w, w1, w2), idx = make_case(n, hid, inter, e, k, seed, **kw)
    ps = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
    out = moe_experts(ps[0], idx, ps[1], ps[2], ps[3], activation=activation)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7)).to(out.dtype)
    out.backward(dout)
    qs = [t.detach().double().requires_grad_() for t in (x, w, w1, w2)]
    ref = moe_experts_ref(qs[0], idx, qs[1], qs[2], qs[3], activation=activation)
    ref.backward(dout.double())
    assert out.dtype == x.dtype and out.shape == (n, hid)
    assert ref.norm() > 0
    errs = {"out": relative_error(out, ref)}
    for name, p, q in zip(["d_hidden", "d_weights", "d_gate_up", "d_down"], ps, qs):
        assert p.grad is not None and p.grad.dtype == p.dtype and q.grad.norm() > 0
        errs[name] = relative_error(p.grad, q.grad)
    assert all(v < tol for v in errs.values()), errs
    return idx, ps


@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_experts_basic_with_skipped_slots_and_empty_expert(activation):
    idx, ps = check(40, 32, 32, 6, 3, seed=1, activation=activation, drop=0.15, absent=(2,))
    assert (idx == 6).any() and not (idx == 2).any()
    # expert 2 got no tokens: its weight gradients are exactly zero (and match the reference)
    assert ps[2].grad[2].abs().max() == 0 and ps[3].grad[2].abs().max() == 0
    # skipped slots get no weight gradient
    assert (ps[1].grad[idx == 6] == 0).all()


def test_experts_very_uneven_loads():
    skew = torch.tensor([40.0, 1.0, 0.5, 0.02, 0.02, 6.0, 0.0, 0.0, 3.0, 0.01, 0.0, 0.5, 0.0, 0.0, 2.0, 0.0])
    idx, _ = check(72, 32, 16, 16, 2, seed=2, skew=skew)
    _, counts, _ = expert_permutation(idx, 16)
    assert counts.max() > 64 and (counts == 0).sum() >= 6  # two 64-row tiles for one expert, many empty


def test_experts_several_blocks_along_every_dimension():
    """ℓ = 80 and I = 136: the K loops take two and three 64-wide steps with a masked tail, the 128-wide
    column blocks of h and of ∂W1 come in two and three with a tail."""
    check(40, 80, 136, 3, 2, seed=11)


def test_experts_gpu_launch_under_the_interpreter(monkeypatch):
    """The GPU's launch (``ceil(M/BM) + E`` tiles, every expert in the weight gradients, uninitialised
    gradient buffers) gives the interpreter's results; empty experts get exactly zero gradients."""
    import kdamoe.kernels.moe.experts as experts

    (x, w, w1, w2), idx = make_case(30, 16, 16, 7, 2, seed=12, absent=(1, 4))
    results = []
    for trimmed in (True, False):
        if not trimmed:
            monkeypatch.setattr(experts, "_interpreter_launch", lambda plan, counts: None)
            monkeypatch.setattr(torch, "empty_like", lambda t, **kw: torch.full_like(t, float("nan"), **kw))
        ps = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
        out = moe_experts(ps[0], idx, ps[1], ps[2], ps[3])
        out.backward(torch.ones_like(out))
        results.append([out.detach()] + [p.grad for p in ps])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[1][3][[1, 4]].abs().max() == 0 and results[1][4][[1, 4]].abs().max() == 0


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-2x) = inf is how tanh saturates
def test_experts_saturating_situ():
    # large pre-activations: both tanh caps of SiTU-GLU are active (|a| >> 4, |b| ~ 25)
    check(24, 16, 16, 4, 2, seed=3, scale=40.0, tol=5e-5)


def test_experts_many_experts_top16():
    idx, _ = check(4, 16, 16, 1000, 16, seed=4, drop=0.05)
    assert idx.unique().numel() > 40 and idx.max() >= 900


def test_experts_odd_widths_int32_index_noncontiguous():
    (x, w, w1, w2), idx = make_case(20, 24, 20, 5, 2, seed=5)
    x_nc = torch.cat([x, torch.zeros_like(x)], 1)[:, :24]  # non-contiguous view
    assert not x_nc.is_contiguous()
    ps = [t.clone().requires_grad_() for t in (w, w1, w2)]
    out = moe_experts(x_nc, idx.int(), ps[0], ps[1], ps[2], activation="situ")
    ref = moe_experts_ref(x, idx, w, w1, w2)
    assert relative_error(out, ref) < 2e-5


def test_experts_float16():
    (x, w, w1, w2), idx = make_case(32, 32, 16, 4, 2, seed=6, dtype=torch.float16)
    ps = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
    out = moe_experts(*ps[:1], idx, *ps[1:])
    out.float().sum().backward()
    qs = [t.detach().double().requires_grad_() for t in (x, w, w1, w2)]
    ref = moe_experts_ref(qs[0], idx, qs[1], qs[2], qs[3])
    ref.sum().backward()
    assert out.dtype == torch.float16
    assert relative_error(out, ref) < 5e-3
    for p, q in zip(ps, qs):
        assert relative_error(p.grad, q.grad) < 1e-2


def test_experts_under_autocast_float32_weights():
    (x, w, w1, w2), idx = make_case(16, 32, 16, 4, 2, seed=10)
    ps = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
    with torch.autocast("cpu", dtype=torch.float16):
        out = moe_experts(*ps[:1], idx, *ps[1:])
    assert out.dtype == torch.float16
    out.float().sum().backward()
    ref = moe_experts_ref(x, idx, w, w1, w2)
    assert relative_error(out, ref) < 5e-3
    assert ps[2].grad.dtype == torch.float32 and ps[2].grad.abs().max() > 0


def test_experts_all_slots_skipped_gives_zero():
    (x, w, w1, w2), idx = make_case(8, 16, 16, 3, 2, seed=7)
    idx[:] = 3
    out = moe_experts(x, idx, w, w1, w2)
    assert out.shape == x.shape and out.abs().max() == 0


def test_experts_no_tokens():
    (x, w, w1, w2), idx = make_case(3, 16, 16, 3, 2, seed=9)
    ps = [t[:0].clone().requires_grad_() if i < 2 else t.clone().requires_grad_() for i, t in enumerate((x, w, w1, w2))]
    out = moe_experts(ps[0], idx[:0], ps[1], ps[2], ps[3])
    assert out.shape == (0, 16) and out.dtype == x.dtype
    out.sum().backward()
    assert ps[2].grad.shape == w1.shape and ps[2].grad.abs().max() == 0


def test_experts_errors():
    (x, w, w1, w2), idx = make_case(8, 16, 16, 3, 2, seed=8)
    with pytest.raises(ValueError, match="activation"):
        moe_experts(x, idx, w, w1, w2, activation="relu")
    with pytest.raises(ValueError, match="hidden_states"):
        moe_experts(x[None], idx, w, w1, w2)
    with pytest.raises(ValueError, match="hidden_states dtype"):
        moe_experts(x.double(), idx, w, w1.double(), w2.double())
    with pytest.raises(ValueError, match="top_k_index"):
        moe_experts(x, idx[:4], w, w1, w2)
    with pytest.raises(ValueError, match="top_k_index dtype"):
        moe_experts(x, idx.float(), w, w1, w2)
    with pytest.raises(ValueError, match="top_k_weights"):
        moe_experts(x, idx, w[:, :1], w1, w2)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe_experts(x, idx, w, w1[:, :, :8], w2)
    with pytest.raises(ValueError, match="gate_up_proj"):
        moe_experts(x, idx, w, w1[:, :31], w2)
    with pytest.raises(ValueError, match="down_proj"):
        moe_experts(x, idx, w, w1, w2[:, :, :8])
    with pytest.raises(ValueError, match="dtype of hidden_states"):
        moe_experts(x, idx, w, w1.half(), w2)
    with pytest.raises(ValueError, match=r"\[0, num_experts=3\]"):
        moe_experts(x, idx.clamp(max=2) + torch.tensor([[0, 2]]), w, w1, w2)  # value 4 > E
    with pytest.raises(ValueError, match=r"\[0, num_experts=3\]"):
        moe_experts(x, idx - 3, w, w1, w2)
    with pytest.raises(ValueError, match="one device"):
        moe_experts(x, idx.to("meta"), w, w1, w2)


def test_expert_permutation_groups_slots_stably():
    g = torch.Generator().manual_seed(8)
    idx = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(37)])
    idx[::7, 2] = 9  # owned by another rank: sorts last, belongs to no expert
    order, counts, offsets = expert_permutation(idx, 9)
    flat = idx.flatten()
    order = order.long()
    assert sorted(order.tolist()) == list(range(37 * 3))
    assert (flat[order][1:] >= flat[order][:-1]).all()
    ref = torch.bincount(flat, minlength=10)[:9]
    assert torch.equal(counts.long(), ref)
    assert torch.equal(offsets.long(), torch.cat([torch.zeros(1, dtype=torch.long), ref.cumsum(0)]))
    for e in range(9):  # stable: tokens keep their order inside an expert
        seg = order[offsets[e]:offsets[e + 1]]
        assert (seg[1:] > seg[:-1]).all()


def test_interpreter_runs_the_first_autotune_config():
    import triton
    import triton.language as tl

    from kdamoe.kernels.utils import autotune

    @autotune(configs=[triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 8})], key=["n"])
    @triton.jit
    def write_block(out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, offs * 0 + BLOCK, mask=offs < n)

    out = torch.zeros(8, dtype=torch.int32)
    write_block[(1,)](out, 8)
    assert out.tolist() == [4] * 4 + [0] * 4


def test_relative_error_refuses_meaningless_comparisons():
    a = torch.tensor([1.0, 2.0])
    assert relative_error(a, torch.tensor([1.0, 1.0])) == pytest.approx(2 ** -0.5)
    with pytest.raises(ValueError, match="all zeros"):
        relative_error(a, torch.zeros(2))
    with pytest.raises(ValueError, match="non-finite"):
        relative_error(torch.tensor([float("nan"), 1.0]), a)
    with pytest.raises(ValueError, match="shapes"):
        relative_error(a, a[:1])
