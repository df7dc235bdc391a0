"""Backend selection of kernel_dispatch (kdamoe.kernels -> fla -> PyTorch) and the adapters to fla's ops.

No GPU here: the decision is a pure function of the requested backend, the device type and what imports,
so it is tested directly, and ``resolve`` is driven with ``torch.device("cuda")`` objects (no tensor is
made on them) and a fake ``fla`` package put into ``sys.modules``.
"""

import sys
import types
from itertools import pairwise

import pytest
import torch

import kdamoe.model.kernel_dispatch as dispatch
from kdamoe import KDAMoEForCausalLM
from kdamoe.model.kda_torch import causal_conv1d_torch
from kdamoe.model.moe_torch import moe_experts_torch
from tests.helpers import tiny_config

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    "requested,device,have_kdamoe,have_fla,expected",
    [
        ("auto", "cuda", True, True, "kdamoe"),
        ("auto", "cuda", False, True, "fla"),
        ("auto", "cuda", False, False, "torch"),
        ("auto", "cpu", True, True, "torch"),
        ("torch", "cuda", True, True, "torch"),
        ("triton", "cuda", True, False, "kdamoe"),
        ("fla", "cuda", True, True, "fla"),
    ],
)
def test_select_backend_decision_table(requested, device, have_kdamoe, have_fla, expected):
    assert dispatch.select_backend(requested, device, have_kdamoe, have_fla) == expected


def test_select_backend_errors_name_the_problem():
    with pytest.raises(ValueError, match="'cudnn'"):
        dispatch.select_backend("cudnn", "cuda", True, True)
    with pytest.raises(RuntimeError, match="kernel_backend='fla'.*cannot be imported"):
        dispatch.select_backend("fla", "cuda", True, False)
    with pytest.raises(RuntimeError, match="kernel_backend='fla' needs CUDA"):
        dispatch.select_backend("fla", "cpu", True, True)
    with pytest.raises(RuntimeError, match="kernel_backend='triton'.*cannot be imported"):
        dispatch.select_backend("triton", "cuda", False, True)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        dispatch.select_backend("triton", "cpu", True, True, interpreter=False)
    assert dispatch.select_backend("triton", "cpu", True, True, interpreter=True) == "kdamoe"


class FakeFla:
    """fla 0.6's four ops with fla's contracts, implemented on kdamoe's PyTorch reference; records calls."""

    def __init__(self):
        self.calls = []

    def causal_conv1d(self, x, weight=None, initial_state=None, activation=None, cu_seqlens=None, **kwargs):
        # fla: [B, T, C] rows, or [1, ΣT, C] with cu_seqlens; initial_state [N, C, W], one per sequence
        self.calls.append(("causal_conv1d", activation, cu_seqlens))
        assert activation == "silu"
        if cu_seqlens is None:
            return causal_conv1d_torch(x, weight, initial_state)[0], None
        bounds = cu_seqlens.tolist()
        pieces = [causal_conv1d_torch(x[:, a:b], weight, None if initial_state is None else initial_state[n : n + 1])[0]
                  for n, (a, b) in enumerate(pairwise(bounds))]
        return torch.cat(pieces, 1), None

    def causal_conv1d_update(self, x, cache, weight=None, activation=None, **kwargs):
        self.calls.append(("causal_conv1d_update", activation, None))
        y, new = causal_conv1d_torch(x, weight, cache)
        cache.copy_(new)  # fla updates the cache in place
        return y, cache

    def chunk_kda(self, q, k, v, g, beta, **kwargs):
        self.calls.append(("chunk_kda", kwargs))
        return torch.zeros_like(v), None

    def fused_recurrent_kda(self, q, k, v, g, beta, **kwargs):
        self.calls.append(("fused_recurrent_kda", kwargs))
        return torch.zeros_like(v), None


@pytest.fixture
def fake_fla(monkeypatch):
    """Install a fake ``fla`` package (fla.ops.kda, fla.modules.causal_conv1d) and clear the import caches."""
    fake = FakeFla()
    modules = {name: types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.kda", "fla.modules",
                                                          "fla.modules.causal_conv1d")}
    modules["fla.ops.kda"].chunk_kda = fake.chunk_kda
    modules["fla.ops.kda"].fused_recurrent_kda = fake.fused_recurrent_kda
    modules["fla.modules.causal_conv1d"].causal_conv1d = fake.causal_conv1d
    modules["fla.modules.causal_conv1d"].causal_conv1d_update = fake.causal_conv1d_update
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    dispatch.fla_kernels.cache_clear()
    yield fake
    dispatch.fla_kernels.cache_clear()


@pytest.fixture
def no_fla(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # "import fla" raises ImportError
    dispatch.fla_kernels.cache_clear()
    yield
    dispatch.fla_kernels.cache_clear()


def test_resolve_follows_the_chain_with_what_imports(fake_fla, monkeypatch):
    assert dispatch.resolve("auto", CUDA, "chunk_kda") == "kdamoe"
    assert dispatch.resolve("auto", CPU, "chunk_kda") == "torch"  # fla imports, CPU still uses PyTorch
    assert dispatch.resolve("fla", CUDA, "causal_conv1d") == "fla"
    assert dispatch.resolve("fla", CUDA, "moe_experts") == "torch"  # fla has no MoE kernel
    monkeypatch.setattr(dispatch, "kdamoe_kernels", lambda: None)  # a saved folder without the kdamoe package
    assert dispatch.resolve("auto", CUDA, "fused_recurrent_kda") == "fla"
    assert dispatch.resolve("auto", CUDA, "moe_experts") == "torch"
    assert dispatch.moe_experts_op("auto", CUDA) is moe_experts_torch
    with pytest.raises(RuntimeError, match="kernel_backend='triton'"):
        dispatch.resolve("triton", CUDA, "chunk_kda")


def test_resolve_without_fla(no_fla, monkeypatch):
    monkeypatch.setattr(dispatch, "kdamoe_kernels", lambda: None)
    assert dispatch.resolve("auto", CUDA, "chunk_kda") == "torch"
    with pytest.raises(RuntimeError, match="kernel_backend='fla'"):
        dispatch.resolve("fla", CUDA, "chunk_kda")


def test_model_on_cpu_never_calls_fla_even_when_it_imports(fake_fla):
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(kernel_backend="auto", kda_head_dim=16)).eval()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        model(ids[:, :1], cache=out.cache, use_cache=True)
    assert fake_fla.calls == []


def test_fla_conv_adapter_keeps_packed_documents_and_the_cache_apart(fake_fla):
    """seq_idx -> cu_seqlens over the flattened batch, the row's cached state -> its first document only."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    state = torch.randn(2, 6, 4, generator=gen)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5 + [2] * 2, [3] * 11])
    y, new_state = dispatch._fla_causal_conv1d(dispatch.fla_kernels(), x, w, state, seq_idx)
    y_ref, state_ref = causal_conv1d_torch(x, w, state, seq_idx)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_state, state_ref, rtol=0, atol=0)
    assert fake_fla.calls[-1][2].tolist() == [0, 4, 9, 11, 22]


def test_fla_conv_adapter_decode_step_leaves_the_cache_tensor_alone(fake_fla):
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 1, 5, generator=gen), torch.randn(5, 4, generator=gen)
    state = torch.randn(3, 5, 4, generator=gen)
    kept = state.clone()
    y, new_state = dispatch._fla_causal_conv1d(dispatch.fla_kernels(), x, w, state, None)
    y_ref, state_ref = causal_conv1d_torch(x, w, kept)
    assert fake_fla.calls[-1][0] == "causal_conv1d_update"
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_state, state_ref, rtol=0, atol=0)
    assert torch.equal(state, kept)


def test_fla_kda_adapter_passes_fla_arguments(fake_fla, monkeypatch):
    monkeypatch.setattr(dispatch, "resolve", lambda backend, device, op: "fla")
    q = k = torch.zeros(1, 4, 2, 16)
    v, beta, h0 = torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2), torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16)
    dt_bias = torch.zeros(32)
    common = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  A_log=None, dt_bias=dt_bias, lower_bound=-5.0, backend="fla")
    dispatch.chunk_kda(q, k, v, q, beta, chunk_size=16, **common)
    dispatch.fused_recurrent_kda(q, k, v, q, beta, **common)
    (name_c, chunk_kwargs), (name_r, rec_kwargs) = fake_fla.calls
    assert name_c == "chunk_kda" and name_r == "fused_recurrent_kda"
    assert "chunk_size" not in chunk_kwargs  # fla accepts only 32 / 64; the PyTorch chunk size is ours
    assert chunk_kwargs["safe_gate"] is True and chunk_kwargs["lower_bound"] == -5.0
    for kwargs in (chunk_kwargs, rec_kwargs):
        assert kwargs["initial_state"].dtype == torch.float32  # fla asserts a float32 state
        assert kwargs["use_gate_in_kernel"] is True and kwargs["dt_bias"] is dt_bias and kwargs["A_log"] is None


@pytest.mark.parametrize("backend", ["torch", "triton", "fla"])
def test_conv_parts_on_every_backend_equal_the_reference(backend, fake_fla, monkeypatch):
    """``causal_conv1d_parts`` over the q|k|v columns of a wider tensor, with packed documents, a cached state that
    takes a gradient and the returned state: each part, the state and the gradients of the wide tensor, the weight and
    the state equal the float64 reference over all channels, on every backend (fla through the fake, forced). A
    decode step (one token on the cache, no gradient) gives the same parts and state; on fla it is fla's update op."""
    if backend == "fla":
        monkeypatch.setattr(dispatch, "resolve", lambda backend, device, op: "fla")
    gen = torch.Generator().manual_seed(8)
    B, T, CP, W = 2, 9, 5, 4
    wide = torch.randn(B, T, 3 * CP + 4, generator=gen, requires_grad=True)
    w, state = torch.randn(3 * CP, W, generator=gen), torch.randn(B, 3 * CP, W, generator=gen)
    dys, dstate = torch.randn(B, T, 3 * CP, generator=gen), torch.randn(B, 3 * CP, W, generator=gen)
    seq_idx = torch.tensor([[0] * 3 + [1] * 6, [2] * 9])
    inputs = [w.clone().requires_grad_(), state.clone().requires_grad_()]
    ys, new_state = dispatch.causal_conv1d_parts(wide[..., 1:1 + 3 * CP], *inputs, seq_idx, parts=3, backend=backend)
    ref_in = [wide.detach()[..., 1:1 + 3 * CP].double().requires_grad_(), w.double().requires_grad_(),
              state.double().requires_grad_()]
    y_ref, state_ref = causal_conv1d_torch(*ref_in, seq_idx)
    assert len(ys) == 3
    for i, y in enumerate(ys):
        torch.testing.assert_close(y.double(), y_ref[..., i * CP:(i + 1) * CP], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state.double(), state_ref, rtol=0, atol=0)
    loss = (torch.cat(ys, -1) * dys).sum() + (new_state * dstate).sum()
    grads = torch.autograd.grad(loss, [wide, *inputs])
    grads_ref = torch.autograd.grad((y_ref * dys.double()).sum() + (state_ref * dstate.double()).sum(), ref_in)
    torch.testing.assert_close(grads[0][..., 1:1 + 3 * CP].double(), grads_ref[0], rtol=1e-5, atol=1e-5)
    assert grads[0][..., 0].abs().max() == 0 and grads[0][..., 1 + 3 * CP:].abs().max() == 0
    for got, want in zip(grads[1:], grads_ref[1:], strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        ys, new_state = dispatch.causal_conv1d_parts(wide[:, :1, 1:1 + 3 * CP], w, state, None, parts=3,
                                                     backend=backend)
    y_ref, state_ref = causal_conv1d_torch(wide.detach()[:, :1, 1:1 + 3 * CP].double(), w.double(), state.double())
    for i, y in enumerate(ys):
        torch.testing.assert_close(y.double(), y_ref[..., i * CP:(i + 1) * CP], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_state.double(), state_ref, rtol=0, atol=0)
    if backend == "fla":
        assert [c[0] for c in fake_fla.calls] == ["causal_conv1d", "causal_conv1d_update"]


def test_conv_parts_refuses_bad_parts_before_any_backend(monkeypatch):
    def no_backend(*args):
        raise AssertionError("a backend was chosen")

    monkeypatch.setattr(dispatch, "resolve", no_backend)
    x, w = torch.zeros(1, 3, 6), torch.zeros(6, 4)
    for parts in (0, 4, 2.0, True, 5):  # 6 channels: 5 does not divide them
        with pytest.raises(ValueError, match=f"parts must be .* got {parts!r}"):
            dispatch.causal_conv1d_parts(x, w, parts=parts)
