"""latent_attention_shared_prefix (one MLA decode query per sequence over its group's shared prefix rows, read once
for the group's members, and its own rows) against a float64 softmax over each sequence's rows concatenated
(``naive_latent_attention_shared_prefix``) and against ``latent_attention`` on them; argument errors.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU.
"""

import os

import pytest
import torch

from kdamoe.kernels import latent_attention, latent_attention_shared_prefix
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
