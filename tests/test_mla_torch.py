"""latent_attention_torch (MLA attention in the latent space) against a float64 brute force written here:
one explicit loop over (row, query), the visible keys picked by position and mask, ``torch.softmax``.

Also the reference of the Triton kernel tests (tests/kernels/test_mla_decode.py imports
:func:`brute_force_attention`).
"""

import pytest
import torch

from kdamoe.model.kernel_dispatch import latent_attention as dispatched_latent_attention
from kdamoe.model.mla_torch import latent_attention_torch


def brute_force_attention(q, latent, seq_len: int, scale: float, key_mask=None) -> torch.Tensor:
    """float64 ``[B, T, H, R]``: query t sees keys ``s ≤ seq_len − T + t`` with ``key_mask[b, s] ≠ 0``;
    a query that sees none gets 0. Only the visible rows of ``latent`` are ever touched."""
    B, T, H, R = q.shape
    out = torch.zeros(B, T, H, R, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(seq_len - T + t + 1) if key_mask is None or bool(key_mask[b, s])]
            if not keys:
                continue
            k = latent[b, keys].double().cpu()  # [n, R], keys = values
            weights = torch.softmax(scale * q[b, t].double().cpu() @ k.T, dim=-1)  # [H, n]
            out[b, t] = weights @ k
    return out


def make_inputs(B, T, H, R, S_cap, seq_len, seed, dtype, garbage=float("nan")):
    """Random q / latent from a fixed seed; the cache rows at or after seq_len hold ``garbage``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, R, generator=gen).to(dtype)
    latent = torch.randn(B, S_cap, R, generator=gen).to(dtype)
    latent[:, seq_len:] = garbage
    return q, latent


def left_padding(B, S, pads, dtype=torch.bool):
    """``[B, S]`` mask with ``pads[b]`` leading zeros per row."""
    mask = torch.arange(S)[None, :] >= torch.tensor(pads)[:, None]
    return mask.to(dtype)


# float32 math inside: the op rounds q and the latent to float32 for float32 inputs only (exact in
# float32), products and sums are float32 (~1e-7 relative per term); 1e-5 leaves room for 300-term sums.
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
CASES = [  # dtype, B, T, H, R, S_cap, seq_len, pads (None = no mask), mask dtype, seed
    (torch.float32, 1, 1, 8, 32, 50, 37, None, None, 1),
    (torch.float64, 2, 4, 3, 16, 40, 40, None, None, 2),  # a full buffer, T > 1 causal
    (torch.float32, 3, 5, 2, 24, 64, 29, (0, 3, 10), torch.bool, 3),  # R need not be a power of two here
    (torch.float64, 2, 6, 1, 8, 30, 20, (0, 17), torch.int64, 4),  # row 1: the first queries see no key
    (torch.float32, 2, 3, 4, 16, 33, 12, (0, 12), torch.int8, 5),  # row 1 entirely masked -> 0
]


@pytest.mark.parametrize("dtype,B,T,H,R,S_cap,seq_len,pads,mask_dtype,seed", CASES)
def test_matches_brute_force(dtype, B, T, H, R, S_cap, seq_len, pads, mask_dtype, seed):
    q, latent = make_inputs(B, T, H, R, S_cap, seq_len, seed, dtype)
    key_mask = left_padding(B, S_cap, pads, mask_dtype) if pads is not None else None
    scale = R ** -0.5
    o = latent_attention_torch(q, latent, torch.tensor(seq_len), scale, key_mask)
    assert o.dtype == dtype and o.shape == (B, T, H, R) and torch.isfinite(o).all()
    ref = brute_force_attention(q, latent, seq_len, scale, key_mask)
    err = (o.double() - ref).norm() / ref.norm()
    assert err <= TOL[dtype]
    if pads is not None:  # queries with no visible key are exactly 0
        for b, pad in enumerate(pads):
            for t in range(T):
                if seq_len - T + t < pad:
                    assert torch.equal(o[b, t], torch.zeros_like(o[b, t]))


def test_garbage_rows_and_mask_beyond_seq_len_are_ignored():
    """Huge values, NaN and an all-ones mask tail after seq_len change nothing; a [1] int32 seq_len works."""
    q, latent = make_inputs(2, 2, 2, 16, 30, 18, 11, torch.float32, garbage=float("nan"))
    huge = latent.clone()
    huge[:, 18:] = 1e30
    mask = left_padding(2, 30, (2, 5))
    mask_tail = mask.clone()
    mask_tail[:, 18:] = False
    seq_len = torch.tensor([18], dtype=torch.int32)
    a = latent_attention_torch(q, latent, seq_len, 0.3, mask)
    b = latent_attention_torch(q, huge, seq_len, 0.3, mask_tail)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = brute_force_attention(q, latent, 18, 0.3, mask)
    assert (a.double() - ref).norm() / ref.norm() <= TOL[torch.float32]


def test_half_inputs_return_their_dtype():
    q, latent = make_inputs(1, 2, 4, 32, 20, 15, 12, torch.bfloat16)
    o = latent_attention_torch(q, latent, torch.tensor(15), 0.2)
    assert o.dtype == torch.bfloat16
    ref = brute_force_attention(q, latent, 15, 0.2)
    assert (o.double() - ref).norm() / ref.norm() <= 1e-2  # one bfloat16 rounding of the output (2^-8)


def test_dispatch_on_cpu_runs_the_torch_op():
    q, latent = make_inputs(1, 1, 2, 16, 10, 7, 13, torch.float32)
    got = dispatched_latent_attention(q, latent, torch.tensor(7), 0.25)
    torch.testing.assert_close(got, latent_attention_torch(q, latent, torch.tensor(7), 0.25), rtol=0, atol=0)


def test_bad_arguments_raise_value_error():
    q, latent = make_inputs(2, 1, 2, 16, 10, 7, 14, torch.float32)
    n = torch.tensor(7)
    with pytest.raises(ValueError, match="q must be"):
        latent_attention_torch(q[0], latent, n, 1.0)
    with pytest.raises(ValueError, match="latent must be"):
        latent_attention_torch(q, latent[:1], n, 1.0)
    with pytest.raises(ValueError, match="latent must be"):
        latent_attention_torch(q, latent[..., :8], n, 1.0)
    with pytest.raises(ValueError, match="latent dtype"):
        latent_attention_torch(q, latent.double(), n, 1.0)
    with pytest.raises(ValueError, match="latent must have a contiguous last dim"):
        latent_attention_torch(q, torch.randn(2, 16, 10).transpose(1, 2), n, 1.0)
    with pytest.raises(ValueError, match="seq_len must be"):
        latent_attention_torch(q, latent, 7, 1.0)
    with pytest.raises(ValueError, match="seq_len must be"):
        latent_attention_torch(q, latent, torch.tensor(7.0), 1.0)
    with pytest.raises(ValueError, match="seq_len must be"):
        latent_attention_torch(q, latent, torch.tensor([7, 7]), 1.0)
    with pytest.raises(ValueError, match="key_mask must be"):
        latent_attention_torch(q, latent, n, 1.0, torch.ones(3, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask dtype"):
        latent_attention_torch(q, latent, n, 1.0, torch.ones(2, 10))
    with pytest.raises(ValueError, match="q dtype"):
        latent_attention_torch(q.int(), latent.int(), n, 1.0)
