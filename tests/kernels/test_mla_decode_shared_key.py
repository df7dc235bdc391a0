"""latent_attention (Triton) with cache rows ``[c | k_shared]`` wider than the values (``value_dim``; Kimi Linear's
shared key part ``qk_rope_head_dim``) against a float64 brute force written here: scores over whole rows, values = the
first ``value_dim`` columns. Shared widths that are and are not powers of two (the kernel pads that tile to one), causal
T > 1, left padding, NaN rows past ``seq_len`` and under the padding, two key splits. float32 on the CPU interpreter
(tests/conftest.py); with KDAMOE_TEST_ON_GPU=1 on a CUDA machine the same cases run on the GPU.
"""

import os

import pytest
import torch

from kdamoe.kernels import latent_attention

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def brute_force(q, rows, seq_len, scale, value_dim, key_mask=None):
    """float64 ``[B, T, H, value_dim]``; query t sees keys ``s ≤ seq_len − T + t`` with ``key_mask[b, s] ≠ 0``."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, value_dim, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(seq_len - T + t + 1) if key_mask is None or bool(key_mask[b, s])]
            if keys:
                k = rows[b, keys].double()
                out[b, t] = torch.softmax(scale * q[b, t].double() @ k.T, dim=-1) @ k[:, :value_dim]
    return out


CASES = [  # B, T, H, R (values), Dr (shared key part), S_cap, seq_len, pads, seed
    (1, 1, 8, 32, 8, 300, 260, None, 1),  # Dr < 16: padded tile; 260 keys over two splits (BLOCK_N = 128)
    (2, 3, 4, 16, 24, 200, 150, (0, 9), 2),  # Dr not a power of two; left padding per row
    (1, 5, 2, 64, 64, 90, 70, (3,), 3),  # Dr = R
]


@pytest.mark.parametrize("B,T,H,R,Dr,S_cap,seq_len,pads,seed", CASES)
def test_wider_keys_match_the_brute_force(B, T, H, R, Dr, S_cap, seq_len, pads, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, R + Dr, generator=gen)
    rows = torch.randn(B, S_cap, R + Dr, generator=gen)
    rows[:, seq_len:] = float("nan")
    key_mask = None
    if pads is not None:
        key_mask = torch.arange(S_cap)[None, :] >= torch.tensor(pads)[:, None]
        rows[~key_mask] = float("nan")
    scale = (R + Dr) ** -0.5
    o = latent_attention(q.to(DEVICE), rows.to(DEVICE), torch.tensor(seq_len, device=DEVICE), scale,
                         None if key_mask is None else key_mask.to(DEVICE), value_dim=R)
    assert o.shape == (B, T, H, R) and o.dtype == torch.float32
    want = brute_force(q, rows, seq_len, scale, R, key_mask)
    got = o.double().cpu()
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_value_widths_and_shared_parts_the_kernel_cannot_take_are_refused():
    q = torch.randn(1, 1, 2, 24, device=DEVICE)
    rows = torch.randn(1, 8, 24, device=DEVICE)
    n = torch.tensor(4, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        latent_attention(q, rows, n, 1.0, value_dim=12)
    with pytest.raises(ValueError, match="value_dim"):
        latent_attention(q, rows, n, 1.0, value_dim=25)
    wide = torch.randn(1, 1, 2, 16 + 257, device=DEVICE)
    with pytest.raises(ValueError, match="shared key part"):
        latent_attention(wide, torch.randn(1, 8, 16 + 257, device=DEVICE), n, 1.0, value_dim=16)
