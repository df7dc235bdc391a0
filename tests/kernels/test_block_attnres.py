"""block_attnres (Triton) against two references: the Block AttnRes formula (arXiv:2603.15031) written out in
float64 and differentiated by torch.autograd (no rounding at all), and ``kdamoe.model.attnres_torch`` in the same dtype
(the model's torch path; in float32 only for the gradients, as in half precision that op's roundings of the
keys, softmax weights and products put it farther from float64 than the kernel). Output and the gradients of every
source, the query and the key-norm weight; S = 1..9 sources, odd widths and row counts, several row blocks per backward
program, parameters in float32 on low-precision sources, sources of mixed dtypes (autocast), strided sources, sources
without gradient, argument errors, the dispatch.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU, with bfloat16 added (the interpreter mishandles it).
"""

import os

import pytest
import torch

from kdamoe.kernels import block_attnres
from kdamoe.model import kernel_dispatch
from kdamoe.model.attnres_torch import block_attnres_torch

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative L2 against float64
EPS = 1e-6

# (S, leading dims, d): every S of the model's range; d = 33 packs many rows in one program, d = 1000 (4 rows per
# program) spreads 13 rows over 4 row blocks and the two backward programs of the interpreter.
CASES = [(S, (3, 5), 33) for S in range(1, 10)] + [(S, (13,), 1000) for S in (1, 2, 9)]


def rel(a, b):
    """Relative L2 error of a against the reference b (float64, on the CPU)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def make_inputs(S, lead, d, dtype, param_dtype, seed):
    """S sources of growing scale (source 0 with an all-zero row: only eps keeps its key finite), a non-zero
    query (so the softmax is not uniform), a key-norm weight near 1 and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    sources = [(0.5 + 0.5 * i) * torch.randn(*lead, d, generator=gen) for i in range(S)]
    sources[0].view(-1, d)[0] = 0
    query = 0.5 * torch.randn(d, generator=gen)
    gamma = 1 + 0.3 * torch.randn(d, generator=gen)
    dh = torch.randn(*lead, d, generator=gen)

    def leaf(t, dt):
        return t.to(DEVICE, dt).requires_grad_()

    return [leaf(v, dtype) for v in sources], leaf(query, param_dtype), leaf(gamma, param_dtype), dh.to(DEVICE)


def float64_reference(sources, query, gamma, dh):
    """``Σ_i softmax_i(q · γ ⊙ v_i / rms(v_i)) v_i`` in float64, and its autograd gradients (sources, q, γ)."""
    leaves = [t.detach().double().requires_grad_() for t in (*sources, query, gamma)]
    *vs, q, g = leaves
    logits = torch.stack([(g * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * q).sum(-1) for v in vs])
    p = logits.softmax(0)
    out = sum(p[i].unsqueeze(-1) * v for i, v in enumerate(vs))
    return out, torch.autograd.grad(out, leaves, dh.double())


def run(fn, sources, query, gamma, dh):
    out = fn(sources, query, gamma, EPS)
    return out, torch.autograd.grad(out, [*sources, query, gamma], dh.to(out.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("S, lead, d", CASES, ids=lambda v: str(v))
def test_mix_matches_float64_autograd_and_torch_op(S, lead, d, dtype):
    sources, query, gamma, dh = make_inputs(S, lead, d, dtype, dtype, seed=100 * S + d)
    out, grads = run(block_attnres, sources, query, gamma, dh)
    same_out, same_grads = run(block_attnres_torch, sources, query, gamma, dh)
    out64, grads64 = float64_reference(sources, query, gamma, dh)

    assert out.dtype == dtype and out.shape == sources[0].shape
    assert [g.dtype for g in grads] == [dtype] * (S + 2)
    assert rel(out, out64) < TOL[dtype]
    assert rel(out, same_out) < 2 * TOL[dtype]
    names = [f"source {i}" for i in range(S)] + ["query", "key_weight"]
    for name, g, g_same, g64 in zip(names, grads, same_grads, grads64, strict=True):
        if S == 1 and name in ("query", "key_weight"):
            # One source: softmax weight 1 whatever the logit, the query and the key norm get exactly no gradient.
            assert torch.equal(g, torch.zeros_like(g)) and float(g64.abs().max()) == 0, name
            continue
        assert rel(g, g64) < TOL[dtype], name
        if dtype == torch.float32:  # in half precision the torch op rounds keys, weights and products: farther off
            assert rel(g, g_same) < 2 * TOL[dtype], name
    if S == 1:
        assert torch.equal(out, sources[0])  # the mix of one source is that source, bit for bit
        assert torch.equal(grads[0], dh.to(dtype))


def test_float32_parameters_on_half_sources():
    """Mixed precision: float16 sources with float32 query and key weight (their grads in float32)."""
    sources, query, gamma, dh = make_inputs(4, (2, 7), 65, torch.float16, torch.float32, seed=11)
    out, grads = run(block_attnres, sources, query, gamma, dh)
    _, grads64 = float64_reference(sources, query, gamma, dh)
    assert out.dtype == torch.float16 and grads[-2].dtype == grads[-1].dtype == torch.float32
    for g, g64 in zip(grads, grads64, strict=True):
        assert rel(g, g64) < TOL[torch.float16]


def test_sources_of_mixed_dtypes_are_promoted():
    """Autocast: float32 embeddings and half-precision sublayer outputs mix into the promoted dtype (float32), each
    source's gradient in its own dtype."""
    sources, query, gamma, dh = make_inputs(3, (3, 5), 40, torch.float32, torch.float32, seed=13)
    sources = [sources[0]] + [v.detach().half().requires_grad_() for v in sources[1:]]
    out, grads = run(block_attnres, sources, query, gamma, dh)
    same_out, _ = run(block_attnres_torch, sources, query, gamma, dh)
    out64, grads64 = float64_reference(sources, query, gamma, dh)
    assert out.dtype == same_out.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.float32, torch.float16, torch.float16, torch.float32, torch.float32]
    assert rel(out, out64) < TOL[torch.float32] and rel(out, same_out) < TOL[torch.float32]
    for g, g64 in zip(grads, grads64, strict=True):
        assert rel(g, g64) < TOL[g.dtype]


def test_many_rows_sum_the_parameter_gradients_over_all_programs():
    """Many more row blocks than backward programs (each program loops over several): dq and dγ are full sums."""
    sources, query, gamma, dh = make_inputs(3, (151,), 100, torch.float32, torch.float32, seed=5)
    _, grads = run(block_attnres, sources, query, gamma, dh)
    _, grads64 = float64_reference(sources, query, gamma, dh)
    for g, g64 in zip(grads, grads64, strict=True):
        assert rel(g, g64) < TOL[torch.float32]


def test_strided_sources_and_sources_without_gradient():
    """A source read through a non-unit last stride (copied) and a source that needs no gradient: the results of
    contiguous copies, and no gradient asked of the frozen source."""
    sources, query, gamma, dh = make_inputs(3, (4, 6), 24, torch.float32, torch.float32, seed=9)
    frozen = sources[0].detach()
    strided = sources[1].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not strided.is_contiguous()
    out = block_attnres([frozen, strided, sources[2]], query, gamma, EPS)
    grads = torch.autograd.grad(out, [strided, sources[2], query, gamma], dh)
    out64, grads64 = float64_reference([frozen, strided, sources[2]], query, gamma, dh)
    assert rel(out, out64) < TOL[torch.float32]
    for g, g64 in zip(grads, grads64[1:], strict=True):
        assert rel(g, g64) < TOL[torch.float32]


def test_empty_input():
    sources = [torch.zeros(0, 3, 8, device=DEVICE, requires_grad=True) for _ in range(2)]
    query = torch.randn(8, device=DEVICE, requires_grad=True)
    gamma = torch.ones(8, device=DEVICE, requires_grad=True)
    out = block_attnres(sources, query, gamma, EPS)
    grads = torch.autograd.grad(out.sum(), [*sources, query, gamma])
    assert out.shape == (0, 3, 8) and grads[0].shape == (0, 3, 8)
    zero = torch.zeros(8, device=DEVICE)
    assert torch.equal(grads[-2], zero) and torch.equal(grads[-1], zero)


def test_bad_arguments_raise_value_errors_naming_them(monkeypatch):
    v = torch.randn(2, 8, device=DEVICE)
    q = torch.zeros(8, device=DEVICE)
    g = torch.ones(8, device=DEVICE)
    for fn in (block_attnres, block_attnres_torch):
        with pytest.raises(ValueError, match="non-empty list or tuple"):
            fn([], q, g, EPS)
        with pytest.raises(ValueError, match="non-empty list or tuple"):
            fn(torch.stack([v, v]), q, g, EPS)  # a stacked tensor is not a sequence of sources
        with pytest.raises(ValueError, match=r"sources\[1\] must be a torch.Tensor"):
            fn([v, None], q, g, EPS)
        with pytest.raises(ValueError, match=r"sources\[1\] is \(2, 7\)"):
            fn([v, torch.randn(2, 7, device=DEVICE)], q, g, EPS)
        with pytest.raises(ValueError, match=r"sources\[1\] is \(2, 8\) on meta"):
            fn([v, torch.randn(2, 8, device="meta")], q, g, EPS)
        with pytest.raises(ValueError, match=r"sources\[1\] dtype"):
            fn([v, v.long()], q, g, EPS)
        with pytest.raises(ValueError, match=r"query must be \[d\] = \(8,\)"):
            fn([v], torch.zeros(7, device=DEVICE), g, EPS)
        with pytest.raises(ValueError, match="key_weight must be a torch.Tensor"):
            fn([v], q, [1.0] * 8, EPS)
        with pytest.raises(ValueError, match="key_weight is on meta"):
            fn([v], q, torch.ones(8, device="meta"), EPS)
        with pytest.raises(ValueError, match="eps must be a float >= 0, got -1.0"):
            fn([v], q, g, -1.0)
    block_attnres_torch([v.double()], q, g, EPS)  # the torch op takes float64, the kernel does not
    with pytest.raises(ValueError, match=r"sources\[0\] dtype"):
        block_attnres([v.double()], q, g, EPS)
    with pytest.raises(ValueError, match="d = 8193 exceeds"):
        block_attnres([torch.randn(1, 8193, device=DEVICE)], torch.zeros(8193, device=DEVICE),
                      torch.ones(8193, device=DEVICE), EPS)
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="need CUDA tensors"):
            block_attnres([v], q, g, EPS)


def test_dispatch_picks_the_kernel_or_the_torch_op(monkeypatch):
    """``kernel_dispatch.block_attnres`` runs the kdamoe kernel with backend="triton" (CPU under the interpreter)
    and the torch op with "torch" and "fla" (no fla kernel)."""
    calls = []
    kernels = kernel_dispatch.kdamoe_kernels()
    real = kernels.block_attnres
    monkeypatch.setattr(kernels, "block_attnres", lambda *a: calls.append(len(a[0])) or real(*a))
    sources, query, gamma, _ = make_inputs(3, (2, 5), 16, torch.float32, torch.float32, seed=4)
    for backend in ("torch", "fla", "triton"):
        out = kernel_dispatch.block_attnres(sources, query, gamma, EPS, backend=backend)
        torch.testing.assert_close(out, block_attnres_torch(sources, query, gamma, EPS))
    assert calls == [3]  # only the "triton" round reached the kernel
