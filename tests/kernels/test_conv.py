"""causal_conv1d / causal_conv1d_parts / causal_conv1d_update (Triton) against the float64 PyTorch reference
``causal_conv1d_torch`` (itself checked by brute force in tests/test_kda_torch.py): outputs, returned state,
gradients of x, weight and conv_state, packed rows, the q|k|v parts of one fused projection, the decode chain,
argument errors.

Runs on the CPU interpreter (tests/conftest.py) in float32 and float16; with KDAMOE_TEST_ON_GPU=1 on a CUDA
machine the same tests run on the GPU.
"""

import os

import pytest
import torch
import triton.runtime.interpreter as interpreter

import kdamoe.kernels.conv.conv as conv
from kdamoe.kernels import causal_conv1d, causal_conv1d_parts, causal_conv1d_update
from kdamoe.model.kda_torch import causal_conv1d_torch

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative L2 against float64


def rel(a, b):
    """Relative L2 error of a against the float64 reference b; an all-zero b must be matched exactly."""
    b = b.detach().double().cpu()
    a = a.detach().double().cpu()
    assert torch.isfinite(a).all()
    if b.norm() == 0:  # e.g. d(conv_state) with W = 1: the state only reaches the returned state
        return float(a.norm() > 0)
    return ((a - b).norm() / b.norm()).item()


def packed_ids(B, T, gen):
    """Random packed layout: each row split into 1-4 documents at random cuts, ids increasing over the batch."""
    ids, next_id = torch.empty(B, T, dtype=torch.long), 0
    for b in range(B):
        cuts = sorted(torch.randperm(T - 1, generator=gen)[: int(torch.randint(0, 4, (1,), generator=gen))] + 1)
        starts = torch.zeros(T, dtype=torch.long)
        starts[0] = 1
        starts[torch.tensor(cuts, dtype=torch.long)] = 1
        ids[b] = starts.cumsum(0) - 1 + next_id
        next_id = int(ids[b, -1]) + 1
    return ids


def make(B, T, C, W, seed, dtype, with_state, packed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(dtype)
    w = (torch.randn(C, W, generator=gen) / W ** 0.5).to(dtype)
    state = torch.randn(B, C, W, generator=gen).to(dtype) if with_state else None
    seq_idx = packed_ids(B, T, gen) if packed else None
    dy = torch.randn(B, T, C, generator=gen)
    dstate = torch.randn(B, C, W, generator=gen)
    return x, w, state, seq_idx, dy, dstate


F32, F16 = torch.float32, torch.float16
# dtype, B, T, C, W, seed, with_state, packed; T = 70 / 100 cross the 64-row blocks, C = 70 the channel blocks
CASES = [
    (F32, 2, 70, 12, 4, 1, True, True),
    (F16, 1, 70, 12, 4, 7, True, True),
    (F32, 1, 100, 70, 4, 2, False, True),
    (F32, 3, 5, 8, 4, 3, True, False),
    (F16, 3, 5, 8, 4, 8, True, False),
    (F32, 2, 64, 16, 3, 4, False, False),
    (F32, 1, 2, 6, 4, 5, True, True),
    (F16, 2, 33, 10, 1, 6, True, False),
]


@pytest.mark.parametrize("dtype,B,T,C,W,seed,with_state,packed", CASES)
def test_matches_reference_values_and_gradients(dtype, B, T, C, W, seed, with_state, packed):
    x, w, state, seq_idx, dy, dstate = make(B, T, C, W, seed, dtype, with_state, packed)
    dev = [t.to(DEVICE).requires_grad_() if t is not None and t.is_floating_point() else t for t in (x, w, state)]
    ids = seq_idx.to(DEVICE) if seq_idx is not None else None
    y, new_state = causal_conv1d(dev[0], dev[1], dev[2], ids)
    assert y.dtype == dtype and y.shape == (B, T, C) and new_state.shape == (B, C, W) and new_state.dtype == dtype

    ref_in = [t.double().requires_grad_() if t is not None else None for t in (x, w, state)]
    y_ref, state_ref = causal_conv1d_torch(ref_in[0], ref_in[1], ref_in[2], seq_idx)
    assert rel(y, y_ref) <= TOL[dtype]
    torch.testing.assert_close(new_state.double().cpu(), state_ref.detach(), rtol=0, atol=0)

    loss = (y.float() * dy.to(DEVICE)).sum() + (new_state.float() * dstate.to(DEVICE)).sum()
    wanted = [t for t in dev if t is not None]
    grads = torch.autograd.grad(loss, wanted)
    loss_ref = (y_ref * dy.double()).sum() + (state_ref * dstate.double()).sum()
    grads_ref = torch.autograd.grad(loss_ref, [t for t in ref_in if t is not None])
    grad_names = ("x", "weight", "conv_state") if with_state else ("x", "weight")
    for name, got, want in zip(grad_names, grads, grads_ref, strict=True):
        assert got.dtype == dtype, name
        assert rel(got, want) <= TOL[dtype] * 5, f"d{name}"


def ids_from_starts(T, starts):
    """``seq_idx [1, T]`` whose documents begin at the rows ``starts`` (0 first), ids 3, 4, …"""
    marks = torch.zeros(T, dtype=torch.long)
    marks[torch.tensor(starts)] = 1
    return (marks.cumsum(0) + 2)[None]


BOUNDARY_CASES = [  # dtype, T, C, W, seed, document starts (None: no seq_idx); the first configs' row tiles are 64
    (F32, 2, 9, 4, 51, None),  # T < W: every row reads the state
    (F32, 3, 9, 4, 52, [0, 1]),  # T < W, a first document of one row: dstate sees only row 0
    (F32, 130, 12, 4, 53, [0, 2, 64, 128]),  # first document shorter than W; documents start at tile starts
    (F32, 131, 70, 4, 54, [0, 63, 65]),  # documents start one row before / after a tile start; 70 channels
    (F16, 67, 10, 3, 55, [0, 1, 64, 66]),
    (F32, 100, 8, 4, 56, None),
]


@pytest.mark.parametrize("dtype,T,C,W,seed,starts", BOUNDARY_CASES)
def test_gradients_at_tile_and_document_boundaries(dtype, T, C, W, seed, starts):
    """Gradients of x, weight and conv_state through the output alone (the returned state's own gradient is
    PyTorch's) where tiles, documents and the state meet: T not a multiple of the row tile or below W, documents
    starting at, just before and just after a tile start, a first document shorter than W (it alone reaches the
    state). Against the float64 reference."""
    x, w, state, _, dy, _ = make(1, T, C, W, seed, dtype, True, False)
    seq_idx = ids_from_starts(T, starts) if starts is not None else None
    dev = [t.to(DEVICE).requires_grad_() for t in (x, w, state)]
    y, _ = causal_conv1d(*dev, seq_idx.to(DEVICE) if seq_idx is not None else None, output_final_state=False)
    ref_in = [t.double().requires_grad_() for t in (x, w, state)]
    y_ref, _ = causal_conv1d_torch(*ref_in, seq_idx)
    assert rel(y, y_ref) <= TOL[dtype]
    grads = torch.autograd.grad((y.float() * dy.to(DEVICE)).sum(), dev)
    grads_ref = torch.autograd.grad((y_ref * dy.double()).sum(), ref_in)
    for name, got, want in zip(("x", "weight", "conv_state"), grads, grads_ref, strict=True):
        assert rel(got, want) <= TOL[dtype] * 5, f"d{name}"
    if starts is not None and len(starts) > 1 and starts[1] < W:  # a short first document still reaches the state
        assert grads_ref[2][..., : W - starts[1]].abs().max() > 0


def test_float16_backward_keeps_gradients_past_float16_range_in_the_scratch():
    """float16 x whose SiLU input gradient dpre = dy · SiLU'(pre) exceeds float16's largest value (pre ≈ 2.4, where
    SiLU' ≈ 1.1, and dy = 62000) while dx = Σ dpre · w (w = 0.1) does not: the backward's scratch must not be
    float16 (it held inf there), and dx matches the float64 reference. (dweight = Σ dpre · x is past float16's range
    itself here, inf on both.)"""
    T, C, W = 8, 4, 4
    x = torch.full((1, T, C), 6.0, dtype=F16)
    w = torch.full((C, W), 0.1, dtype=F16)
    dy = torch.zeros(1, T, C, dtype=F16)
    dy[0, T - 1] = 62000.0
    x_dev = x.to(DEVICE).requires_grad_()
    y, _ = causal_conv1d(x_dev, w.to(DEVICE), None, None, output_final_state=False)
    (dx,) = torch.autograd.grad(y, x_dev, dy.to(DEVICE))
    x_ref = x.double().requires_grad_()
    y_ref, _ = causal_conv1d_torch(x_ref, w.double(), None, None)
    (dx_ref,) = torch.autograd.grad(y_ref, x_ref, dy.double())
    assert 6000 < dx_ref.abs().max() < 65504  # dx in float16's range, dpre (about 68000) not
    assert torch.isfinite(dx).all()
    assert rel(dx, dx_ref) <= TOL[F16] * 5


@pytest.mark.parametrize("dtype,B,packed", [(F32, 2, True), (F16, 3, False), (F32, 1, False)])
def test_a_column_slice_is_read_in_place_and_matches_the_reference(dtype, B, packed):
    """x as the middle columns of a wider [B, T, 3C] tensor (the KDA layer's k part of its fused projection): read
    in place (the kernels take its row stride; a copy would allocate), values and gradients as the float64
    reference on the same values, and the gradient lands only in those columns of the wide tensor."""
    T, C, W = 70, 12, 4
    _, w, state, seq_idx, dy, _ = make(B, T, C, W, 21 + B, dtype, True, packed)
    wide = torch.randn(B, T, 3 * C, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE).requires_grad_()
    x = wide[..., C:2 * C]
    assert conv._rows_strided(x.detach()) is not None and conv._rows_strided(x.detach()).data_ptr() == x.data_ptr()
    ids = seq_idx.to(DEVICE) if seq_idx is not None else None
    y, new_state = causal_conv1d(x, w.to(DEVICE), state.to(DEVICE), ids)
    x_ref = x.detach().double().cpu().requires_grad_()
    y_ref, state_ref = causal_conv1d_torch(x_ref, w.double(), state.double(), seq_idx)
    assert rel(y, y_ref) <= TOL[dtype]
    torch.testing.assert_close(new_state.double().cpu(), state_ref.detach(), rtol=0, atol=0)
    (grad_wide,) = torch.autograd.grad((y.float() * dy.to(DEVICE)).sum(), [wide])
    (grad_ref,) = torch.autograd.grad((y_ref * dy.double()).sum(), [x_ref])
    assert rel(grad_wide[..., C:2 * C], grad_ref) <= TOL[dtype] * 5
    assert grad_wide[..., :C].abs().max() == 0 and grad_wide[..., 2 * C:].abs().max() == 0


PARTS_CASES = [  # dtype, B, T, CP (channels per part), parts, W, seed, with_state, packed
    (F32, 2, 70, 12, 3, 4, 61, True, True),  # CP < the 64-channel block: one masked block per part
    (F32, 1, 100, 70, 3, 4, 62, False, True),  # CP = 70: two blocks per part, the second masked; rows cross tiles
    (F16, 3, 5, 8, 3, 4, 63, True, False),
    (F32, 2, 33, 10, 2, 3, 64, True, False),
    (F32, 1, 40, 6, 3, 1, 65, True, True),
]


def launches(monkeypatch):
    """The names of the Triton kernels the interpreter runs from now on, in order; None on the GPU (where the
    autotuner's timing runs would count too)."""
    if ON_GPU:
        return None

    names = []

    def counted(self, *args, _real=interpreter.GridExecutor.__call__, **kwargs):
        names.append(self.fn.__name__)
        return _real(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    return names


@pytest.mark.parametrize("dtype,B,T,CP,parts,W,seed,with_state,packed", PARTS_CASES)
def test_parts_read_a_fused_projection_in_place_and_match_the_reference(dtype, B, T, CP, parts, W, seed, with_state,
                                                                        packed, monkeypatch):
    """causal_conv1d_parts on the q|k|v columns of a wider [B, T, 3 + parts·CP + 5] tensor (the KDA layer's fused
    projection): each part a contiguous [B, T, CP] output equal to its channels of the float64 reference over all
    parts; the returned state exactly the reference's; the gradients of the wide tensor (only in those columns),
    the weight and the state from separate per-part output gradients and the state's; one kernel launch forward and
    two backward (the dx kernel writes the wide tensor's gradient as one [B, T, parts·CP] piece)."""
    C = parts * CP
    _, w, state, seq_idx, _, dstate = make(B, T, C, W, seed, dtype, with_state, packed)
    gen = torch.Generator().manual_seed(seed + 100)
    wide = torch.randn(B, T, 3 + C + 5, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    dys = [torch.randn(B, T, CP, generator=gen) for _ in range(parts)]
    x = wide[..., 3:3 + C]
    dev = [t.to(DEVICE).requires_grad_() if t is not None else None for t in (w, state)]
    ids = seq_idx.to(DEVICE) if seq_idx is not None else None
    names = launches(monkeypatch)
    ys, new_state = causal_conv1d_parts(x, dev[0], dev[1], ids, parts=parts)
    assert names is None or names == ["_conv_fwd_kernel"]
    assert len(ys) == parts and new_state.shape == (B, C, W) and new_state.dtype == dtype
    assert all(y.shape == (B, T, CP) and y.is_contiguous() and y.dtype == dtype for y in ys)

    ref_in = [t.double().requires_grad_() if t is not None else None for t in (x.detach().cpu(), w, state)]
    y_ref, state_ref = causal_conv1d_torch(ref_in[0], ref_in[1], ref_in[2], seq_idx)
    for i, y in enumerate(ys):
        assert rel(y, y_ref[..., i * CP:(i + 1) * CP]) <= TOL[dtype], f"part {i}"
    torch.testing.assert_close(new_state.double().cpu(), state_ref.detach(), rtol=0, atol=0)

    loss = sum((y.float() * dy.to(DEVICE)).sum() for y, dy in zip(ys, dys, strict=True))
    loss = loss + (new_state.float() * dstate.to(DEVICE)).sum()
    wanted = [wide] + [t for t in dev if t is not None]
    names = launches(monkeypatch)
    grads = torch.autograd.grad(loss, wanted)
    assert names is None or names == ["_conv_bwd_dpre_kernel", "_conv_bwd_dx_kernel"]
    loss_ref = (y_ref * torch.cat(dys, -1).double()).sum() + (state_ref * dstate.double()).sum()
    grads_ref = torch.autograd.grad(loss_ref, [t for t in ref_in if t is not None])
    assert rel(grads[0][..., 3:3 + C], grads_ref[0]) <= TOL[dtype] * 5, "dx"
    assert grads[0][..., :3].abs().max() == 0 and grads[0][..., 3 + C:].abs().max() == 0
    grad_names = ("weight", "conv_state") if with_state else ("weight",)
    for name, got, want in zip(grad_names, grads[1:], grads_ref[1:], strict=True):
        assert got.dtype == dtype, name
        assert rel(got, want) <= TOL[dtype] * 5, f"d{name}"


def test_parts_with_an_unused_part_and_no_final_state():
    """A part whose output takes no gradient (autograd hands the op zeros for it) and output_final_state=False
    (None): the gradients are those of the used parts alone, against the float64 reference."""
    B, T, CP, W = 2, 20, 9, 4
    x, w, state, seq_idx, dy, _ = make(B, T, 3 * CP, W, 71, torch.float32, True, True)
    dev = [t.clone().requires_grad_() for t in (x, w, state)]
    ys, new_state = causal_conv1d_parts(*dev, seq_idx, parts=3, output_final_state=False)
    assert new_state is None
    used = [0, 2]
    grads = torch.autograd.grad(sum((ys[i] * dy[..., i * CP:(i + 1) * CP]).sum() for i in used), dev)
    ref_in = [t.double().requires_grad_() for t in (x, w, state)]
    y_ref, _ = causal_conv1d_torch(*ref_in, seq_idx)
    mask = torch.zeros(3 * CP, dtype=torch.float64)
    for i in used:
        mask[i * CP:(i + 1) * CP] = 1
    grads_ref = torch.autograd.grad((y_ref * dy.double() * mask).sum(), ref_in)
    for name, got, want in zip(("x", "weight", "conv_state"), grads, grads_ref, strict=True):
        assert rel(got, want) <= TOL[torch.float32] * 5, f"d{name}"
    assert grads[0][..., CP:2 * CP].abs().max() == 0  # depthwise: the unused part's channels feed only its output


def test_rows_that_are_not_evenly_spaced_are_copied_first():
    """A slice of tokens of a batch of several rows (rows T' apart in a tensor of T > T' tokens) cannot be read with
    one row stride: it is copied, and the result equals the contiguous input's."""
    x, w, _, _, _, _ = make(2, 30, 8, 4, 12, torch.float32, False, False)
    sliced = x[:, 3:20]
    assert conv._rows_strided(sliced).data_ptr() != sliced.data_ptr()
    torch.testing.assert_close(causal_conv1d(sliced, w)[0], causal_conv1d(sliced.contiguous(), w)[0], rtol=0, atol=0)


def test_packed_row_equals_each_document_alone():
    """Independent of the reference: a packed row's outputs equal each document convolved on its own."""
    x, w, state, _, _, _ = make(1, 40, 8, 4, 11, torch.float32, True, False)
    seq_idx = torch.tensor([[5] * 3 + [6] * 25 + [7] * 12])
    y, new_state = causal_conv1d(x, w, state, seq_idx)
    first, _ = causal_conv1d(x[:, :3], w, state)  # the cache feeds the first document only
    middle, _ = causal_conv1d(x[:, 3:28], w)
    last, last_state = causal_conv1d(x[:, 28:], w)
    torch.testing.assert_close(y, torch.cat([first, middle, last], 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_state, last_state, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_chain_equals_full_forward(dtype):
    B, T0, steps, C, W = 3, 9, 4, 20, 4
    x, w, state, _, _, _ = make(B, T0 + steps, C, W, 21, dtype, True, False)
    x, w, state = x.to(DEVICE), w.to(DEVICE), state.to(DEVICE)
    with torch.no_grad():
        full, full_state = causal_conv1d(x, w, state)
        y, s = causal_conv1d(x[:, :T0], w, state)
        pieces = [y]
        for t in range(T0, T0 + steps):
            y_t, s = causal_conv1d_update(x[:, t], s, w)
            pieces.append(y_t[:, None])
    assert rel(torch.cat(pieces, 1), full.double()) <= TOL[dtype]
    torch.testing.assert_close(s, full_state, rtol=0, atol=0)


def test_update_accepts_b1c_and_leaves_state_alone():
    x, w, state, _, _, _ = make(2, 1, 6, 3, 31, torch.float32, True, False)
    kept = state.clone()
    y, s = causal_conv1d_update(x, state, w)
    y_ref, s_ref = causal_conv1d_torch(x.double(), w.double(), state.double())
    assert y.shape == (2, 1, 6) and rel(y, y_ref) <= TOL[torch.float32]
    torch.testing.assert_close(s.double(), s_ref, rtol=0, atol=0)
    assert torch.equal(state, kept)


def test_bad_arguments_raise_value_error():
    x, w, state, _, _, _ = make(2, 5, 6, 4, 41, torch.float32, True, False)
    with pytest.raises(ValueError, match="x must be"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d(x, w[:5])
    with pytest.raises(ValueError, match="W must be in"):
        causal_conv1d(x, torch.randn(6, 9))
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d(x, w, state[:1])
    with pytest.raises(ValueError, match="seq_idx must be"):
        causal_conv1d(x, w, seq_idx=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_idx dtype"):
        causal_conv1d(x, w, seq_idx=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="x dtype"):
        causal_conv1d(x.double(), w)
    with pytest.raises(ValueError, match="conv_state is required"):
        causal_conv1d_update(x[:, 0], None, w)
    with pytest.raises(ValueError, match="no backward"):
        causal_conv1d_update(x[:, 0].requires_grad_(), state, w)
    for parts in (0, 4, 4.0, True, 5):  # 6 channels: 5 does not divide them
        with pytest.raises(ValueError, match=f"parts must be .* got {parts!r}"):
            causal_conv1d_parts(x, w, parts=parts)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d_parts(x, w[:5], parts=3)
