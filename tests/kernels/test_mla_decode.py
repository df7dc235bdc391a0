"""latent_attention (Triton flash-decoding over the MLA latent cache) against the float64 brute force of
tests/test_mla_torch.py (explicit masking + softmax per query): causal T > 1 with several row blocks, key
splits (round robin, one entirely past seq_len), garbage (NaN / huge) cache rows past seq_len and under the
padding, left padding per row, fully masked rows, a reused seq_len tensor, argument errors.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16: there one split program per "SM"
pair (see ``decode.num_splits``) and ``BLOCK_N = 128`` for R <= 64, so S_cap > 128 gives two splits. With
KDAMOE_TEST_ON_GPU=1 on a CUDA machine the same tests run on the GPU, plus bfloat16 at R = 256 up to
100K keys and a CUDA-graph replay.
"""

import os

import pytest
import torch

from kdamoe.kernels import latent_attention
from kdamoe.kernels.mla import decode
from kdamoe.model.mla_torch import latent_attention_torch
from tests.test_mla_torch import brute_force_attention, left_padding, make_inputs

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# Relative L2 against float64 on the same (rounded) inputs. float32: IEEE dots, ~1e-7 per term.
# float16: the probabilities enter the second dot in float16 and the output is rounded once (2^-11 each).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel(actual, reference):
    actual = actual.detach().double().cpu()
    assert torch.isfinite(actual).all()
    return ((actual - reference).norm() / reference.norm()).item()


def run_case(dtype, B, T, H, R, S_cap, seq_len, pads, seed, garbage=float("nan"), mask_dtype=torch.bool):
    q, latent = make_inputs(B, T, H, R, S_cap, seq_len, seed, dtype, garbage)
    key_mask = None
    if pads is not None:
        key_mask = left_padding(B, S_cap, pads, mask_dtype)
        latent[~key_mask.bool()] = garbage  # padded cache rows must not leak either
    scale = R ** -0.5
    o = latent_attention(q.to(DEVICE), latent.to(DEVICE), torch.tensor(seq_len, device=DEVICE), scale,
                         key_mask.to(DEVICE) if key_mask is not None else None)
    assert o.dtype == dtype and o.shape == (B, T, H, R)
    return o, brute_force_attention(q, latent, seq_len, scale, key_mask), key_mask


F32, F16 = torch.float32, torch.float16
CASES = [  # dtype, B, T, H, R, S_cap, seq_len, pads (None = no mask), seed
    (F32, 1, 1, 8, 64, 400, 300, None, 1),  # 3 key blocks round robin over 2 splits, 300 % 128 != 0
    (F16, 1, 1, 8, 64, 400, 300, None, 2),
    (F32, 1, 3, 4, 32, 300, 100, None, 3),  # seq_len < BLOCK_N: split 1 lies entirely past seq_len
    (F16, 3, 3, 4, 16, 200, 150, (0, 7, 140), 4),  # different left padding per row
    (F32, 1, 17, 4, 32, 300, 270, (5,), 5),  # T·H = 68: two row blocks of 64 with their own causal end
    (F16, 1, 20, 1, 16, 150, 140, None, 6),
    (F32, 2, 1, 8, 32, 130, 129, (0, 128), 7),  # one key past a block edge; row 1 sees key 128 only
]


@pytest.mark.parametrize("dtype,B,T,H,R,S_cap,seq_len,pads,seed", CASES)
def test_matches_brute_force(dtype, B, T, H, R, S_cap, seq_len, pads, seed):
    o, ref, _ = run_case(dtype, B, T, H, R, S_cap, seq_len, pads, seed)
    assert rel(o, ref) <= TOL[dtype]


def test_huge_garbage_int_mask_and_fully_masked_row():
    """Huge (not NaN) garbage, an int32 mask, a row with every key masked (exactly 0) and queries of another
    row that see no key yet (exactly 0)."""
    o, ref, _ = run_case(F32, 3, 4, 1, 16, 64, 50, (0, 50, 48), 8, garbage=1e30, mask_dtype=torch.int32)
    assert rel(o, ref) <= TOL[F32]
    assert torch.equal(o[1].cpu(), torch.zeros_like(o[1].cpu()))
    assert torch.equal(o[2, :2].cpu(), torch.zeros_like(o[2, :2].cpu()))  # positions 46, 47 < pad 48
    assert o[2, 2:].abs().sum() > 0


def test_reused_seq_len_tensor_gives_the_new_answer():
    """The value is read on the device at every call: writing a new one into the same tensor changes the
    result (nothing about the value is captured on the host)."""
    q, latent = make_inputs(1, 2, 4, 32, 300, 280, 9, F32)
    q, latent = q.to(DEVICE), latent.to(DEVICE)
    seq_len = torch.tensor(90, dtype=torch.int32, device=DEVICE)
    first = latent_attention(q, latent, seq_len, 0.2)
    seq_len.fill_(280)
    second = latent_attention(q, latent, seq_len, 0.2)
    assert rel(first, brute_force_attention(q, latent, 90, 0.2)) <= TOL[F32]
    assert rel(second, brute_force_attention(q, latent, 280, 0.2)) <= TOL[F32]


def test_bad_arguments_raise_value_error():
    q, latent = make_inputs(2, 1, 2, 16, 10, 7, 10, F32)
    q, latent = q.to(DEVICE), latent.to(DEVICE)
    n = torch.tensor(7, device=DEVICE)
    with pytest.raises(ValueError, match="q must be"):
        latent_attention(q[0], latent, n, 1.0)
    with pytest.raises(ValueError, match="latent must be"):
        latent_attention(q, latent[:1], n, 1.0)
    with pytest.raises(ValueError, match="latent dtype"):
        latent_attention(q, latent.half(), n, 1.0)
    with pytest.raises(ValueError, match="q dtype"):
        latent_attention(q.double(), latent.double(), n, 1.0)
    with pytest.raises(ValueError, match="seq_len must be"):
        latent_attention(q, latent, n.float(), 1.0)
    with pytest.raises(ValueError, match="key_mask must be"):
        latent_attention(q, latent, n, 1.0, torch.ones(2, 10, 1, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="key_mask dtype"):
        latent_attention(q, latent, n, 1.0, torch.ones(2, 10, device=DEVICE))
    for R in (8, 24, 1024):
        with pytest.raises(ValueError, match="R .*power of two"):
            latent_attention(torch.zeros(1, 1, 1, R, device=DEVICE), torch.zeros(1, 4, R, device=DEVICE), n, 1.0)
    if ON_GPU:
        with pytest.raises(ValueError, match="seq_len is on"):
            latent_attention(q, latent, n.cpu(), 1.0)
    with pytest.raises(ValueError, match="no backward"):  # forward only: a result without a gradient path
        latent_attention(q.requires_grad_(), latent, n, 1.0)
    with torch.no_grad():
        latent_attention(q, latent, n, 1.0)  # the same tensors without grad mode run


def test_split_heuristic_depends_on_shapes_only():
    """Splits fill the machine at B = 1 and shrink as B grows, never beyond the buffer's key blocks."""
    assert decode.num_splits(1, 1, 16384, 132) == 2 * 132
    assert decode.num_splits(8, 1, 16384, 132) == 33
    assert decode.num_splits(1, 1, 3, 132) == 3
    assert decode.num_splits(256, 4, 16384, 132) == 1


# ---------------------------------------------------------------------------------------------------
# GPU only: the production shape and CUDA-graph replay
# ---------------------------------------------------------------------------------------------------
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs KDAMOE_TEST_ON_GPU=1 and a CUDA device")


@gpu_only
@pytest.mark.parametrize("B,T,seq_len,S_cap,pads", [(1, 1, 100_000, 131_072, None),
                                                    (2, 1, 4097, 65_536, (0, 1000)),
                                                    (1, 64, 30_000, 32_768, None),
                                                    (2, 3, 77_777, 100_000, (3, 50_000))])
def test_bf16_production_shape_matches_float32_torch_op(B, T, seq_len, S_cap, pads):
    H, R = 8, 256
    q, latent = make_inputs(B, T, H, R, S_cap, seq_len, 20 + T, torch.bfloat16)
    q, latent = q.cuda() * 3, latent.cuda()  # larger scores: a peaked softmax, not a near-uniform average
    key_mask = left_padding(B, S_cap, pads).cuda() if pads is not None else None
    seq = torch.tensor(seq_len, device="cuda")
    o = latent_attention(q, latent, seq, R ** -0.5, key_mask)
    ref = latent_attention_torch(q.float(), latent.float(), seq, R ** -0.5, key_mask)
    assert rel(o, ref.double().cpu()) <= TOL[torch.bfloat16]


@gpu_only
def test_cuda_graph_replay_with_new_seq_len_values_equals_eager():
    B, T, H, R, S_cap = 2, 1, 8, 256, 50_000
    q, latent = make_inputs(B, T, H, R, S_cap, S_cap, 31, torch.bfloat16)
    q, latent = q.cuda(), latent.cuda()
    key_mask = left_padding(B, S_cap, (0, 17)).cuda()
    seq_len = torch.tensor(1000, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation) outside the capture
        latent_attention(q, latent, seq_len, 0.06, key_mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = latent_attention(q, latent, seq_len, 0.06, key_mask)
    for value in (20, 4096, 49_999):
        seq_len.fill_(value)
        graph.replay()
        eager = latent_attention(q, latent, seq_len, 0.06, key_mask)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
        ref = latent_attention_torch(q.float(), latent.float(), seq_len, 0.06, key_mask)
        assert rel(out, ref.double().cpu()) <= TOL[torch.bfloat16]
