"""The pure-PyTorch KDA path against the float64 naive recurrence (kdamoe/kernels/kda/naive.py)."""


import pytest
import torch

from kdamoe.kernels.kda.naive import naive_kda_lowerbound_gate, naive_recurrent_kda
from kdamoe.model.kda_torch import causal_conv1d_torch, chunk_kda_torch, kda_gate, l2norm, recurrent_kda_torch


def _inputs(seed, B, T, H=2, K=8, V=6, dtype=torch.float64, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = l2norm(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = lower_bound * torch.rand(B, T, H, K, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("T", [1, 15, 16, 17, 100])
def test_chunked_matches_naive_values_and_gradients(T):
    inputs = [x.requires_grad_() for x in _inputs(seed=T, B=2, T=T)]
    q, k, v, g, beta, h0 = inputs
    o, ht = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)

    gen = torch.Generator().manual_seed(1000 + T)
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), inputs)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), inputs)
    for name, got, want in zip("q k v g beta h0".split(), grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"d{name}")


def test_float32_chunked_close_to_float64_reference():
    q, k, v, g, beta, h0 = _inputs(seed=7, B=1, T=100)
    o, ht = chunk_kda_torch(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(), output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-4, atol=1e-4)


def test_variable_length_batch_matches_each_sequence_alone():
    cu_seqlens = torch.tensor([0, 17, 17, 50, 64])  # includes an empty sequence
    q, k, v, g, beta, _ = _inputs(seed=3, B=1, T=64)
    h0 = torch.randn(4, 2, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    o, ht = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        cu_seqlens=cu_seqlens)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht[1], h0[1])  # the empty sequence keeps its state


def test_recurrent_step_matches_naive_with_l2norm_in_kernel():
    q, k, v, g, beta, h0 = _inputs(seed=11, B=3, T=5)
    o, ht = recurrent_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = naive_recurrent_kda(l2norm(q), l2norm(k), v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_strict_causality(dtype):
    """Changing gates, keys and values after position t leaves outputs up to t bitwise unchanged."""
    q, k, v, g, beta, _ = (x.to(dtype) for x in _inputs(seed=5, B=1, T=80))
    o, _ = chunk_kda_torch(q, k, v, g, beta, chunk_size=32)
    t = 40
    g2, k2, v2, beta2 = g.clone(), k.clone(), v.clone(), beta.clone()
    g2[:, t + 1 :] = -5.0 * torch.rand_like(g2[:, t + 1 :])
    k2[:, t + 1 :] = l2norm(torch.randn_like(k2[:, t + 1 :]))
    v2[:, t + 1 :] = 1e3 * torch.randn_like(v2[:, t + 1 :])
    beta2[:, t + 1 :] = 1.0
    o2, _ = chunk_kda_torch(q, k2, v2, g2, beta2, chunk_size=32)
    assert torch.equal(o[:, : t + 1], o2[:, : t + 1])
    assert not torch.allclose(o[:, t + 1 :], o2[:, t + 1 :])


def test_gate_is_lower_bounded_and_matches_formula():
    gen = torch.Generator().manual_seed(0)
    f = 50 * torch.randn(2, 3, 4, 8, generator=gen)
    dt_bias = torch.randn(32, generator=gen)
    A_log = torch.randn(4, generator=gen)
    g = kda_gate(f, dt_bias, -5.0, A_log)
    assert g.dtype == torch.float32
    assert float(g.min()) >= -5.0 and float(g.max()) <= 0.0
    expected = -5.0 * torch.sigmoid(A_log.exp().view(4, 1) * (f + dt_bias.view(4, 8)))
    torch.testing.assert_close(g, expected)
    torch.testing.assert_close(kda_gate(f, dt_bias, -2.0), -2.0 * torch.sigmoid(f + dt_bias.view(4, 8)))


def test_short_conv_matches_conv1d_and_restarts_at_boundaries():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    out, state = causal_conv1d_torch(x, w)
    ref = torch.nn.functional.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=3, groups=5)[..., :9]
    torch.testing.assert_close(out, torch.nn.functional.silu(ref.transpose(1, 2)))
    torch.testing.assert_close(state, x[:, -4:].transpose(1, 2))
    # Two documents in one row: the second sees only itself.
    seq_idx = torch.tensor([[0] * 4 + [1] * 5, [2] * 9])
    packed, _ = causal_conv1d_torch(x, w, seq_idx=seq_idx)
    alone, _ = causal_conv1d_torch(x[:1, 4:], w)
    torch.testing.assert_close(packed[:1, 4:], alone)
    torch.testing.assert_close(packed[:1, :4], out[:1, :4])


def test_bad_shapes_raise_clear_errors():
    q, k, v, g, beta, h0 = _inputs(seed=0, B=2, T=4)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_torch(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda_torch(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="B = 1"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda_torch(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 3]))


def _brute_force_conv(x, w, state, seq_idx):
    """float64 triple loop of y[b,t,c] = SiLU(Σ_j w[c,W-1-j] x[b,t-j,c] [same id]) and the W-input state."""
    B, T, C = x.shape
    W = w.shape[1]

    def ids(b, p):
        if seq_idx is None:
            return 0
        return seq_idx[b, max(p, 0)].item() if p >= 0 else seq_idx[b, 0].item()

    def value(b, p):
        if p >= 0:
            return x[b, p]
        return state[b, :, W + p] if state is not None else torch.zeros(C, dtype=x.dtype)

    y = torch.zeros(B, T, C, dtype=torch.float64)
    new_state = torch.zeros(B, C, W, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for j in range(W):
                if ids(b, t - j) == ids(b, t):
                    y[b, t] += w[:, W - 1 - j] * value(b, t - j)
        for m in range(W):
            p = T - W + m
            if ids(b, p) == ids(b, T - 1):
                new_state[b, :, m] = value(b, p)
    return torch.nn.functional.silu(y), new_state


@pytest.mark.parametrize("T,with_state", [(9, True), (2, True), (7, False)])
def test_short_conv_matches_brute_force_with_state_and_packed_rows(T, with_state):
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    state = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64) if with_state else None
    # row 0: the last document is shorter than W, so the returned state must not carry the earlier one
    seq_idx = torch.tensor([[0] * (T - 1) + [1], [2] * T])
    out, new_state = causal_conv1d_torch(x, w, state, seq_idx)
    ref, ref_state = _brute_force_conv(x, w, state, seq_idx)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_state, ref_state, rtol=0, atol=0)


def test_short_conv_half_inputs_computed_in_float32_returned_in_input_dtype():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 6, 4, generator=gen).half()
    w = torch.randn(4, 4, generator=gen)  # float32 weight (autocast-style mix): the output stays float16
    out, state = causal_conv1d_torch(x, w)
    ref, _ = _brute_force_conv(x.double(), w.double(), None, None)
    assert out.dtype == torch.float16 and state.dtype == torch.float16
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("op", [chunk_kda_torch, recurrent_kda_torch])
def test_gate_inside_the_op_equals_the_precomputed_gate(op):
    """use_gate_in_kernel: the op computes lb·σ(exp(A_log)(f + dt_bias)) itself (tests/kda_reference.py gate)."""
    q, k, v, _, beta, h0 = _inputs(seed=21, B=2, T=19)
    gen = torch.Generator().manual_seed(22)
    f, dt_bias, A_log = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((2, 19, 2, 8), (16,), (2,)))
    o, ht = op(q, k, v, f, beta, initial_state=h0, output_final_state=True, use_gate_in_kernel=True,
               A_log=A_log, dt_bias=dt_bias, lower_bound=-3.0)
    g = naive_kda_lowerbound_gate(f, A_log, dt_bias, -3.0)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="lower_bound"):
        op(q, k, v, f, beta, use_gate_in_kernel=True, dt_bias=dt_bias, lower_bound=-6.0)
