"""fused_recurrent_kda (decode) against the float64 naive recurrence, and prefill → decode hand-off."""

import pytest
import torch

from kdamoe.kernels import chunk_kda, fused_recurrent_kda
from kdamoe.kernels.kda.naive import naive_kda_lowerbound_gate, naive_l2norm, naive_recurrent_kda
from kdamoe.kernels.utils import relative_error
from tests.kernels.test_kda_chunk import DEVICE, TOL, H, K, V, make_inputs


@pytest.mark.parametrize("B,T,seed", [(1, 1, 101), (4, 1, 102), (3, 5, 103)])
def test_decode_matches_reference(B, T, seed):
    x = make_inputs(B, T, seed)
    o, ht = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                output_final_state=True)
    ro, rht = naive_recurrent_kda(*(x[n].cpu() for n in ("q", "k", "v", "g", "beta")), initial_state=x["h0"].cpu(),
                                  output_final_state=True)
    assert o.shape == (B, T, H, V) and ht.shape == (B, H, K, V)
    assert relative_error(o, ro) <= TOL and relative_error(ht, rht) <= TOL


def test_decode_varlen_gate_in_kernel_l2norm():
    cu = torch.tensor([0, 1, 4, 4, 6], dtype=torch.int32, device=DEVICE)
    x = make_inputs(1, 6, 111, N=4, gate_in=True, normalize_k=False)
    o, ht = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    d = {n: x[n].cpu().double() for n in ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")}
    g = naive_kda_lowerbound_gate(d["g"], d["A_log"], d["dt_bias"], -5.0)
    ro, rht = naive_recurrent_kda(naive_l2norm(d["q"]), naive_l2norm(d["k"]), d["v"], g, d["beta"],
                                  initial_state=d["h0"], output_final_state=True, cu_seqlens=cu.cpu())
    assert relative_error(o, ro) <= TOL and relative_error(ht, rht) <= TOL


def test_prefill_then_decode_matches_one_pass():
    """chunk_kda over a prompt, then fused_recurrent_kda token by token, equals the reference over all."""
    B, T, steps = 2, 37, 3
    x = make_inputs(B, T + steps, 121)

    def sl(n, a, b):
        return x[n][:, a:b]

    o1, s = chunk_kda(*(sl(n, 0, T) for n in ("q", "k", "v", "g", "beta")), initial_state=x["h0"],
                      output_final_state=True)
    outs = [o1]
    for t in range(T, T + steps):
        o_t, s = fused_recurrent_kda(*(sl(n, t, t + 1) for n in ("q", "k", "v", "g", "beta")), initial_state=s,
                                     output_final_state=True)
        outs.append(o_t)
    ro, rht = naive_recurrent_kda(*(x[n].cpu() for n in ("q", "k", "v", "g", "beta")), initial_state=x["h0"].cpu(),
                                  output_final_state=True)
    assert relative_error(torch.cat(outs, 1), ro) <= TOL and relative_error(s, rht) <= TOL


def test_decode_argument_errors():
    x = make_inputs(2, 1, 131)
    with pytest.raises(ValueError, match="initial_state must be"):
        fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"][:1])
    with pytest.raises(ValueError, match="B == 1"):
        fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                            cu_seqlens=torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="beta must be"):
        fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"][0])
