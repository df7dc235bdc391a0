"""moe_experts (Triton) against the float64 loop reference: outputs and all gradients.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA machine
the same tests run on the GPU (the references stay on the CPU), except those about the interpreter itself.
"""

import os

import pytest
import torch
import triton
import triton.language as tl
from moe_reference import moe_experts_ref

import kdamoe.kernels.moe.experts as experts
from kdamoe.kernels import moe_experts
from kdamoe.kernels.launch import autotune
from kdamoe.kernels.moe import grouped_gemm as gg
from kdamoe.kernels.moe.activation import ACT_SITU
from kdamoe.kernels.moe.experts import _Plan
from kdamoe.kernels.moe.permute import expert_permutation
from kdamoe.kernels.utils import relative_error

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs KDAMOE_TEST_ON_GPU=1 and a CUDA device")
interpreter_only = pytest.mark.skipif(ON_GPU, reason="about the CPU interpreter's launch")


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


def on_device(*tensors, grad=False):
    """Copies of ``tensors`` on the test device (leaves requiring grad with ``grad=True``)."""
    return [t.to(DEVICE).clone().requires_grad_(grad) for t in tensors]


def check(n, hid, inter, e, k, seed, activation="situ", tol=2e-5, **kw):
    """Output and the four gradients against the float64 reference; returns ``(idx, [x, w, w1, w2] leaves)`` with
    ``idx`` on the CPU and the leaves on the test device."""
    (x, w, w1, w2), idx = make_case(n, hid, inter, e, k, seed, **kw)
    ps = on_device(x, w, w1, w2, grad=True)
    out = moe_experts(ps[0], idx.to(DEVICE), ps[1], ps[2], ps[3], activation=activation)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7)).to(out.dtype)
    out.backward(dout.to(DEVICE))
    qs = [t.detach().double().requires_grad_() for t in (x, w, w1, w2)]
    ref = moe_experts_ref(qs[0], idx, qs[1], qs[2], qs[3], activation=activation)
    ref.backward(dout.double())
    assert out.dtype == x.dtype and out.shape == (n, hid)
    assert ref.norm() > 0
    errs = {"out": relative_error(out, ref)}
    for name, p, q in zip(["d_hidden", "d_weights", "d_gate_up", "d_down"], ps, qs, strict=True):
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
    assert (ps[1].grad.cpu()[idx == 6] == 0).all()


def test_experts_very_uneven_loads():
    skew = torch.tensor([40.0, 1.0, 0.5, 0.02, 0.02, 6.0, 0.0, 0.0, 3.0, 0.01, 0.0, 0.5, 0.0, 0.0, 2.0, 0.0])
    idx, _ = check(72, 32, 16, 16, 2, seed=2, skew=skew)
    _, counts, _ = expert_permutation(idx, 16)
    assert counts.max() > 64 and (counts == 0).sum() >= 6  # two 64-row tiles for one expert, many empty


def test_experts_several_blocks_along_every_dimension():
    """ℓ = 80 and I = 136: the K loops take two and three 64-wide steps with a masked tail; the gate/up tiles
    (64 gate and 64 up columns each) come in three with a tail; the weight gradients' 128 x 128 tiles cover ∂W1
    (272 x 80) in three x one and ∂W2 (80 x 136) in one x two, each with tails."""
    check(40, 80, 136, 3, 2, seed=11)


@interpreter_only
def test_experts_gpu_launch_under_the_interpreter(monkeypatch):
    """The GPU's launch (``ceil(M/BM) + E`` tiles, every expert in the weight gradients, uninitialised
    gradient buffers) gives the interpreter's results; empty experts get exactly zero gradients."""
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
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert results[1][3][[1, 4]].abs().max() == 0 and results[1][4][[1, 4]].abs().max() == 0


class _PoisonedTorch:
    """``torch`` as ``kdamoe.kernels.moe.experts`` sees it, with ``empty`` / ``empty_like`` filling float buffers
    with NaN: an element no kernel writes stays NaN, and an unwritten element that a kernel reads spreads NaN."""

    def __init__(self):
        self.poisoned = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def _poison(self, t):
        if t.is_floating_point():
            t.fill_(float("nan"))
            self.poisoned += 1
        return t

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


def test_experts_grouped_path_writes_every_element_it_reads(monkeypatch):
    """Every ``torch.empty`` buffer of the grouped path filled with NaN: the output and all four gradients match the
    float64 reference, so every element of every output is written and no element left unwritten (rows of skipped
    slots in g, h, ∂g', ∂h; the tail past M of the last row tile) is read. Both launches: the interpreter's trimmed
    one and the GPU's (``ceil(M/BM) + E`` tiles, every expert in the weight gradients); on a GPU both are the GPU's."""
    # M = 37·3 = 111 rows: the GLU backward's 16-row blocks end in a tail; ℓ = 80 and I = 72 fill no block exactly
    (x, w, w1, w2), idx = make_case(37, 80, 72, 6, 3, seed=13, drop=0.2, absent=(4,))
    assert (idx == 6).any() and not (idx == 4).any()
    dout = torch.randn(37, 80, generator=torch.Generator().manual_seed(14))
    qs = [t.detach().double().requires_grad_() for t in (x, w, w1, w2)]
    ref = moe_experts_ref(qs[0], idx, qs[1], qs[2], qs[3])
    ref.backward(dout.double())
    monkeypatch.setattr(experts, "GEMV_MAX_ROWS", 0)
    for gpu_launch in (False, True):
        poisoned = _PoisonedTorch()
        with monkeypatch.context() as m:
            m.setattr(experts, "torch", poisoned)
            if gpu_launch:
                m.setattr(experts, "_interpreter_launch", lambda plan, counts: None)
            ps = on_device(x, w, w1, w2, grad=True)
            out = moe_experts(ps[0], idx.to(DEVICE), ps[1], ps[2], ps[3])
            out.backward(dout.to(DEVICE))
        assert poisoned.poisoned >= 8, poisoned.poisoned  # the buffers of the forward and the backward
        names = ["out", "d_hidden", "d_weights", "d_gate_up", "d_down"]
        got = [out.detach()] + [p.grad for p in ps]
        want = [ref.detach()] + [q.grad for q in qs]
        for name, a, b in zip(names, got, want, strict=True):
            assert torch.isfinite(a).all(), (gpu_launch, name)
            assert relative_error(a, b) < 2e-5, (gpu_launch, name)
        assert (ps[1].grad.cpu()[idx == 6] == 0).all()
        assert ps[2].grad[4].abs().max() == 0 and ps[3].grad[4].abs().max() == 0


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-2x) = inf is how tanh saturates
def test_experts_saturating_situ():
    # large pre-activations: both tanh caps of SiTU-GLU are active (|a| >> 4, |b| ~ 25)
    check(24, 16, 16, 4, 2, seed=3, scale=40.0, tol=5e-5)


def test_experts_many_experts_top16():
    idx, _ = check(4, 16, 16, 1000, 16, seed=4, drop=0.05)
    assert idx.unique().numel() > 40 and idx.max() >= 900


def test_experts_odd_widths_int32_index_noncontiguous():
    (x, w, w1, w2), idx = make_case(20, 24, 20, 5, 2, seed=5)
    x_nc = torch.cat([x, torch.zeros_like(x)], 1).to(DEVICE)[:, :24]  # non-contiguous view
    assert not x_nc.is_contiguous()
    ps = on_device(w, w1, w2, grad=True)
    out = moe_experts(x_nc, idx.int().to(DEVICE), ps[0], ps[1], ps[2], activation="situ")
    ref = moe_experts_ref(x, idx, w, w1, w2)
    assert relative_error(out, ref) < 2e-5


def test_experts_float16():
    (x, w, w1, w2), idx = make_case(32, 32, 16, 4, 2, seed=6, dtype=torch.float16)
    ps = on_device(x, w, w1, w2, grad=True)
    out = moe_experts(*ps[:1], idx.to(DEVICE), *ps[1:])
    out.float().sum().backward()
    qs = [t.detach().double().requires_grad_() for t in (x, w, w1, w2)]
    ref = moe_experts_ref(qs[0], idx, qs[1], qs[2], qs[3])
    ref.sum().backward()
    assert out.dtype == torch.float16
    assert relative_error(out, ref) < 5e-3
    for p, q in zip(ps, qs, strict=True):
        assert relative_error(p.grad, q.grad) < 1e-2


def test_experts_under_autocast_float32_weights():
    (x, w, w1, w2), idx = make_case(16, 32, 16, 4, 2, seed=10)
    ps = on_device(x, w, w1, w2, grad=True)
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = moe_experts(*ps[:1], idx.to(DEVICE), *ps[1:])
    assert out.dtype == torch.float16
    out.float().sum().backward()
    ref = moe_experts_ref(x, idx, w, w1, w2)
    assert relative_error(out, ref) < 5e-3
    assert ps[2].grad.dtype == torch.float32 and ps[2].grad.abs().max() > 0


def test_experts_all_slots_skipped_gives_zero():
    (x, w, w1, w2), idx = make_case(8, 16, 16, 3, 2, seed=7)
    idx[:] = 3
    out = moe_experts(*on_device(x, idx, w, w1, w2))
    assert out.shape == x.shape and out.abs().max() == 0


def test_experts_no_tokens():
    (x, w, w1, w2), idx = make_case(3, 16, 16, 3, 2, seed=9)
    ps = on_device(x[:0], w[:0], w1, w2, grad=True)
    out = moe_experts(ps[0], idx[:0].to(DEVICE), ps[1], ps[2], ps[3])
    assert out.shape == (0, 16) and out.dtype == x.dtype
    out.sum().backward()
    assert ps[2].grad.shape == w1.shape and ps[2].grad.abs().max() == 0


def test_experts_errors():
    (x, w, w1, w2), idx = make_case(8, 16, 16, 3, 2, seed=8)
    x, idx, w, w1, w2 = on_device(x, idx, w, w1, w2)
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
        moe_experts(x, idx.clamp(max=2) + torch.tensor([[0, 2]], device=DEVICE), w, w1, w2)  # value 4 > E
    with pytest.raises(ValueError, match=r"\[0, num_experts=3\]"):
        moe_experts(x, idx - 3, w, w1, w2)
    with pytest.raises(ValueError, match="one device"):
        moe_experts(x, idx.to("meta"), w, w1, w2)
    with pytest.raises(ValueError, match="top_k_weights dtype"):
        moe_experts(x, idx, w.double(), w1, w2)
    with pytest.raises(ValueError, match="CUDA"):  # meta tensors: autocast knows no such device type
        moe_experts(x.to("meta"), idx.to("meta"), w.to("meta"), w1.to("meta"), w2.to("meta"))


@interpreter_only
def test_experts_bfloat16_under_the_interpreter_is_refused(monkeypatch):
    """Triton's CPU interpreter gets tl.dot wrong in bfloat16 (errors of order 1e9): the grouped path must refuse it,
    also when bf16 comes from torch.autocast('cpu'), rather than return garbage."""
    monkeypatch.setattr(experts, "GEMV_MAX_ROWS", 0)
    (x, w, w1, w2), idx = make_case(6, 16, 8, 3, 2, seed=21)
    with pytest.raises(ValueError, match="bfloat16"):
        moe_experts(x.bfloat16(), idx, w.bfloat16(), w1.bfloat16(), w2.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="bfloat16"):
        moe_experts(x, idx, w, w1, w2)


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


@interpreter_only
def test_interpreter_runs_the_first_autotune_config():

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


# ---------------------------------------------------------------------------------------------------
# Every autotune config of the grouped GEMMs, in bfloat16 on the GPU (the autotuner picks one per shape, so the
# model-level tests reach only the configs it happens to pick; the interpreter runs only the first)
# ---------------------------------------------------------------------------------------------------
def _grouped_case():
    """bf16 inputs on the GPU, 256 tokens top-4 over 8 experts (about 128 rows each, BM = 64), ℓ = 256, I = 192
    (gate/up halves of BN = 128 and the 256-row tiles of ∂W1 (384 x 256) end in masked tails)."""
    (x, w, w1, w2), idx = make_case(256, 256, 192, 8, 4, seed=31)
    x, w, w1, w2, idx = (t.cuda() for t in (x, w, w1, w2, idx))
    plan = _Plan(idx, 8)
    order = plan.order.long()
    tok, expert = order // 4, idx.flatten()[order]  # per sorted row: its token and its expert
    return [t.bfloat16() for t in (x, w1, w2)] + [w], idx, plan, order, tok, expert


def _launch(kernel, config, grid, *args, **kwargs):
    """``kernel`` (kdamoe.kernels.launch.FastLaunch around an autotuner) launched with one fixed config."""
    kernel.jit[grid](*args, **kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


@gpu_only
def test_every_gate_up_config_matches_torch():
    (x, w1, w2, w), idx, plan, order, tok, expert = _grouped_case()
    m, inter = plan.m, w1.shape[1] // 2
    h_ref = torch.einsum("rl,rnl->rn", x[tok].float(), w1[expert].float())  # [M, 2I]
    a, b = h_ref[:, :inter], h_ref[:, inter:]
    g_ref = 4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * (25.0 * torch.tanh(b / 25.0)) * w.flatten()[order, None]
    for config in gg._gate_up_fwd_kernel.autotuner.configs:
        g = torch.full((m, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
        h = torch.full((m, 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)
        grid = (plan.max_tiles * -(-inter // config.kwargs["BN"]),)
        _launch(gg._gate_up_fwd_kernel, config, grid, x, w1, plan.order, plan.tile_expert, plan.tile_offs,
                plan.row_offs, w, g, h, 8, inter, x.shape[1], 4.0, 25.0, TOPK=4, ACT=ACT_SITU, SAVE_H=True,
                PREC="tf32", BM=plan.bm)
        assert relative_error(h, h_ref) < 1e-2, config
        assert relative_error(g, g_ref) < 1e-2, config


@gpu_only
def test_every_rows_gemm_config_matches_torch():
    (x, w1, w2, _), idx, plan, order, tok, expert = _grouped_case()
    m, (hid, inter) = plan.m, w2.shape[1:]
    gen = torch.Generator(device="cuda").manual_seed(32)
    g = torch.randn(m, inter, device="cuda", generator=gen).bfloat16()
    # the forward's down projection: y[slot] = g[r] @ W2[e]ᵀ, stored at the slot (unsorted)
    want = torch.empty(m, hid, device="cuda")
    want[order] = torch.einsum("ri,rli->rl", g.float(), w2[expert].float())
    for config in gg._rows_gemm_kernel.autotuner.configs:
        y = torch.full((m, hid), float("nan"), device="cuda", dtype=torch.bfloat16)
        grid = (plan.max_tiles * -(-hid // config.kwargs["BN"]),)
        _launch(gg._rows_gemm_kernel, config, grid, g, w2, plan.order, plan.tile_expert, plan.tile_offs,
                plan.row_offs, y, 8, hid, inter, 4, inter, hid * inter, 1, inter, GATHER_A=False, SORTED_OUT=False,
                PREC="tf32", BM=plan.bm)
        assert relative_error(y, want) < 1e-2, config


@gpu_only
def test_every_wgrad_config_matches_torch():
    (x, w1, w2, _), idx, plan, order, tok, expert = _grouped_case()
    m, two_i, hid = plan.m, w1.shape[1], w1.shape[2]
    gen = torch.Generator(device="cuda").manual_seed(33)
    dh = torch.randn(m, two_i, device="cuda", generator=gen).bfloat16()
    # ∂W1[e] = Σ_{sorted rows r of e} dh[r]ᵀ x[tok(r)]  (A not gathered, B gathered by token)
    want = torch.zeros(8, two_i, hid, device="cuda").index_add_(
        0, expert, torch.einsum("rp,rq->rpq", dh.float(), x[tok].float()))
    experts = torch.arange(8, device="cuda", dtype=torch.int32)
    for config in gg._wgrad_kernel.autotuner.configs:
        out = torch.full((8, two_i, hid), float("nan"), device="cuda", dtype=torch.bfloat16)
        grid = (8 * -(-two_i // config.kwargs["BP"]) * -(-hid // config.kwargs["BQ"]),)
        _launch(gg._wgrad_kernel, config, grid, dh, x, plan.order, plan.row_offs, experts, out, 8, two_i, hid,
                two_i, hid, TOPK=4, GATHER_A=False, GATHER_B=True, PREC="tf32")
        assert relative_error(out, want) < 1e-2, config


# ---------------------------------------------------------------------------------------------------
# Decode fast path (kdamoe/kernels/moe/gemv.py): no gradient needed and N·k <= GEMV_MAX_ROWS
# ---------------------------------------------------------------------------------------------------
# Relative L2 against float64 on the same rounded inputs: float32 accumulates in float32 (SiTU's tanh via
# 2σ(2x) − 1 costs ~1e-6); float16 rounds h and the output once each (2^-11).
GEMV_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


class _RefusedGrouped:
    @staticmethod
    def apply(*args):
        raise AssertionError("the grouped path ran")


def _refused_gemv(*args):
    raise AssertionError("the GEMV path ran")


def run_path(path, monkeypatch, x, idx, w, w1, w2, **kw):
    """``moe_experts`` under ``torch.no_grad`` with the other path made to fail (so the caller knows which ran):
    ``"gemv"`` as dispatched, ``"grouped"`` forced by ``GEMV_MAX_ROWS = 0``."""
    with monkeypatch.context() as m:
        if path == "gemv":
            m.setattr(experts, "MoEExpertsFunction", _RefusedGrouped)
        else:
            m.setattr(experts, "GEMV_MAX_ROWS", 0)
            m.setattr(experts, "moe_experts_gemv", _refused_gemv)
        with torch.no_grad():
            return moe_experts(*(t.to(DEVICE) for t in (x, idx, w, w1, w2)), **kw)


def decode_case(n, k, seed, dtype, hid=72, inter=40):
    """A decode-sized case: E = k + 3 experts; token 1 routes to token 0's experts (rolled, so no duplicate
    inside a token), the last slot of the last token is another rank's (index E) once there are two slots."""
    e = k + 3
    (x, w, w1, w2), idx = make_case(n, hid, inter, e, k, seed, dtype=dtype)
    if n > 1:
        idx[1] = idx[0].roll(1)
    if n * k > 1:
        idx[-1, -1] = e
    return (x, w, w1, w2), idx


F32, F16 = torch.float32, torch.float16
# every N in {1, 3, 8}, k in {1, 2, 8}, activation and dtype; M = N·k = 64 = GEMV_MAX_ROWS in the last two
GEMV_CASES = [  # activation, N, k, dtype, ℓ, I
    ("situ", 1, 1, F32, 72, 40), ("silu", 1, 1, F16, 72, 40), ("situ", 1, 8, F16, 72, 40),
    ("silu", 1, 8, F32, 72, 40), ("situ", 3, 1, F16, 72, 40), ("silu", 3, 2, F32, 72, 40),
    ("situ", 3, 8, F32, 72, 40), ("silu", 3, 8, F16, 72, 40), ("situ", 8, 2, F16, 72, 40),
    ("silu", 8, 2, F32, 72, 40), ("situ", 8, 8, F32, 40, 24), ("silu", 8, 8, F16, 40, 24),
]


@pytest.mark.parametrize("activation,n,k,dtype,hid,inter", GEMV_CASES)
def test_gemv_path_matches_float64_reference(activation, n, k, dtype, hid, inter, monkeypatch):
    """ℓ and I are no multiples of the blocks (masked tails in both kernels); token 1 shares token 0's experts,
    one slot is another rank's."""
    (x, w, w1, w2), idx = decode_case(n, k, seed=100 + 10 * n + k, dtype=dtype, hid=hid, inter=inter)
    out = run_path("gemv", monkeypatch, x, idx, w, w1, w2, activation=activation)
    ref = moe_experts_ref(x, idx, w, w1, w2, activation=activation)
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out, ref) < GEMV_TOL[dtype]
    if n * k > 1:
        assert (idx == k + 3).any()
    if n > 1:
        assert set(idx[0].tolist()) & set(idx[1].tolist())


def test_gemv_path_several_blocks_along_every_dimension(monkeypatch):
    """ℓ = 200 and I = 136: the ℓ loop of the gate/up kernel takes two 128-wide steps with a tail, the I loop
    of the down kernel two 128-wide steps with a tail, several column blocks in both."""
    (x, w, w1, w2), idx = decode_case(2, 2, seed=21, dtype=torch.float32, hid=200, inter=136)
    out = run_path("gemv", monkeypatch, x, idx, w, w1, w2)
    assert relative_error(out, moe_experts_ref(x, idx, w, w1, w2)) < GEMV_TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_gemv_path_matches_grouped_path(activation, dtype, monkeypatch):
    (x, w, w1, w2), idx = decode_case(3, 4, seed=31, dtype=dtype)
    gemv = run_path("gemv", monkeypatch, x, idx, w, w1, w2, activation=activation)
    grouped = run_path("grouped", monkeypatch, x, idx, w, w1, w2, activation=activation)
    # same rounding of h; the grouped path also rounds each slot's weighted output before the combine
    assert relative_error(gemv, grouped) < {torch.float32: 1e-6, torch.float16: 2e-3}[dtype]


def test_gemv_path_never_reads_skipped_slots(monkeypatch):
    """Buffers from ``torch.empty`` filled with NaN: the rows of h of skipped slots (index E) are neither
    written nor read, every output element is written; all slots skipped gives exact zeros."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    (x, w, w1, w2), idx = decode_case(4, 3, seed=41, dtype=torch.float32)
    idx[0, 1] = idx[2, 0] = 6
    out = run_path("gemv", monkeypatch, x, idx, w, w1, w2)
    assert relative_error(out, moe_experts_ref(x, idx, w, w1, w2)) < GEMV_TOL[torch.float32]
    idx[:] = 6
    out = run_path("gemv", monkeypatch, x, idx, w, w1, w2)
    assert out.shape == x.shape and out.abs().max() == 0


def test_dispatch_takes_gemv_path_only_without_grad_and_few_rows(monkeypatch):
    class Grouped:
        @staticmethod
        def apply(*args):
            return "grouped"

    monkeypatch.setattr(experts, "MoEExpertsFunction", Grouped)
    monkeypatch.setattr(experts, "moe_experts_gemv", lambda *args: "gemv")
    assert experts.GEMV_MAX_ROWS == 64

    def path(n, k, requires_grad, context):
        (x, w, w1, w2), idx = make_case(n, 16, 8, 2 * k, k, seed=51)
        ps = [t.to(DEVICE).requires_grad_(requires_grad) for t in (x, w, w1, w2)]
        with context():
            return moe_experts(ps[0], idx.to(DEVICE), *ps[1:])

    grad = torch.enable_grad
    assert path(8, 8, False, torch.no_grad) == "gemv"  # M = 64 = GEMV_MAX_ROWS
    assert path(1, 1, True, torch.inference_mode) == "gemv"
    assert path(3, 2, False, grad) == "gemv"  # grad mode on, but no input requires grad
    assert path(13, 5, False, torch.no_grad) == "grouped"  # M = 65
    assert path(3, 2, True, grad) == "grouped"
    (x, w, w1, w2), idx = make_case(2, 16, 8, 4, 2, seed=52)
    for name, t in (("x", x), ("w", w), ("w1", w1), ("w2", w2)):  # any one float input requiring grad
        args = {"x": x, "w": w, "w1": w1, "w2": w2}
        args[name] = t.clone().requires_grad_()
        out = moe_experts(*(a.to(DEVICE) for a in (args["x"], idx, args["w"], args["w1"], args["w2"])))
        assert out == "grouped", name
    # argument checks come first on both paths
    with torch.no_grad(), pytest.raises(ValueError, match=r"\[0, num_experts=4\]"):
        moe_experts(x.to(DEVICE), (idx + 3).to(DEVICE), w.to(DEVICE), w1.to(DEVICE), w2.to(DEVICE))


@gpu_only
@pytest.mark.parametrize("n", [1, 4, 8])
def test_gemv_bf16_decode_shape_matches_grouped_and_float32(n, monkeypatch):
    """The decode shape the path exists for: E = 64 experts, top-8, I = 512, ℓ = 1024, bfloat16."""
    (x, w, w1, w2), idx = make_case(n, 1024, 512, 64, 8, seed=60 + n, dtype=torch.bfloat16)
    gemv = run_path("gemv", monkeypatch, x, idx, w, w1, w2)
    grouped = run_path("grouped", monkeypatch, x, idx, w, w1, w2)
    ref = moe_experts_ref(x, idx, w, w1, w2)
    assert relative_error(gemv, ref) < GEMV_TOL[torch.bfloat16]
    assert relative_error(grouped, ref) < GEMV_TOL[torch.bfloat16]
    assert relative_error(gemv, grouped) < GEMV_TOL[torch.bfloat16]


@gpu_only
def test_gemv_path_in_a_cuda_graph_replays_new_routing(monkeypatch):
    (x, w, w1, w2), idx = make_case(4, 1024, 512, 64, 8, seed=70, dtype=torch.bfloat16)
    x, idx, w, w1, w2 = (t.cuda() for t in (x, idx, w, w1, w2))
    with torch.no_grad():
        moe_experts(x, idx, w, w1, w2)  # compile and autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_experts(x, idx, w, w1, w2)
        g = torch.Generator().manual_seed(71)
        for _ in range(3):
            idx.copy_(torch.stack([torch.randperm(65, generator=g)[:8] for _ in range(4)]))  # 64 = skipped
            x.copy_(torch.randn(x.shape, generator=g))
            graph.replay()
            torch.testing.assert_close(out, moe_experts(x, idx, w, w1, w2), rtol=0, atol=0)
