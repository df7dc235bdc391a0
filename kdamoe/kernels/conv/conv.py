"""Causal depthwise convolution + SiLU in Triton: public functions and autograd wrapper.

The short convolution of the KDA layer (Kimi Linear report §3: q, k, v each pass a depthwise causal conv of
width 4 and SiLU; the op of Mamba, Gu & Dao 2023 §3.4). Semantics are those of
``kdamoe.model.kda_torch.causal_conv1d_torch``, its reference: ``x [B, T, C]``, ``weight [C, W]`` (tap ``W − 1`` is
the current token), an optional cached ``conv_state [B, C, W]`` holding the W inputs before x (oldest
first), an optional ``seq_idx [B, T]`` that keeps packed sequences apart.

Stages (one file each): ``forward`` (conv + SiLU), ``backward`` (dx, dweight, dstate), ``update`` (one decode
step), ``update_slots`` / ``varlen_slots`` (a decode step / packed sequences on windows kept in a slot pool, updated
in place: :func:`causal_conv1d_update_slots`, :func:`causal_conv1d_varlen_slots`). The returned state (the last W
inputs) is gathered in PyTorch, so autograd differentiates it.

:func:`causal_conv1d_parts` is the same op over channels made of 1 to 3 equal parts (the KDA layer's q|k|v, one
column slice ``[B, T, 3·width]`` of its fused projection): one launch forward writes each part's output to its own
contiguous tensor, the backward takes the parts' gradients as they come and writes one ``dx [B, T, C]`` (two
launches and one sum of the dweight partials). :func:`causal_conv1d` is its one-part case.
"""

from itertools import pairwise

import torch

from ..utils import check_slot_ids, is_interpreter
from .backward import conv_bwd
from .forward import MAX_PARTS, conv_fwd
from .update import conv_update
from .update_slots import conv_update_slots
from .varlen_slots import conv_varlen_slots

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_WIDTH = 8  # the kernels unroll their W shifted tile loads (and the state gradient W²/2 vector loads)


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd over the inputs :func:`causal_conv1d_parts` prepared (x row-strided, the others contiguous): returns
    the ``parts`` outputs as a tuple; differentiable in x, weight and conv_state."""

    @staticmethod
    def forward(ctx, x, weight, conv_state, seq_idx, parts):
        ctx.save_for_backward(x, weight, conv_state, seq_idx)
        return tuple(conv_fwd(x, weight, conv_state, seq_idx, parts))

    @staticmethod
    def backward(ctx, *dys):
        x, weight, conv_state, seq_idx = ctx.saved_tensors
        state_grad = conv_state is not None and ctx.needs_input_grad[2]
        dx, dw, dstate = conv_bwd(x, weight, conv_state, seq_idx, [dy.contiguous() for dy in dys], state_grad)
        if dstate is not None:
            dstate = dstate.to(conv_state.dtype)
        return dx, dw.to(weight.dtype), dstate, None, None


def _check_device(name, t, device):
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like x")


def _validate(x, weight, conv_state, seq_idx):
    """Raise ValueError for a bad shape, dtype or device; returns ``(B, T, C, W)``."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C, W] with C = {C}, got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"the kernel width W must be in [1, {MAX_WIDTH}], got W = {W}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {t.dtype}")
    device = x.device
    if device.type != "cuda" and not (device.type == "cpu" and is_interpreter()):
        raise ValueError(f"x is on {device}: the Triton kernels need a CUDA tensor (or CPU with TRITON_INTERPRET=1)")
    _check_device("weight", weight, device)
    if conv_state is not None:
        if not isinstance(conv_state, torch.Tensor) or conv_state.shape != (B, C, W):
            shape = tuple(conv_state.shape) if isinstance(conv_state, torch.Tensor) else type(conv_state).__name__
            raise ValueError(f"conv_state must be [B, C, W] = ({B}, {C}, {W}), got {shape}")
        if conv_state.dtype not in _FLOATS:
            raise ValueError(f"conv_state dtype must be float16, bfloat16 or float32, got {conv_state.dtype}")
        _check_device("conv_state", conv_state, device)
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.shape != (B, T):
            shape = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
            raise ValueError(f"seq_idx must be [B, T] = ({B}, {T}), got {shape}")
        if seq_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seq_idx dtype must be int32 or int64, got {seq_idx.dtype}")
        _check_device("seq_idx", seq_idx, device)
    return B, T, C, W


def final_conv_state(x, conv_state, seq_idx, width):
    """The last ``width`` inputs of each row as ``[B, C, W]`` in x's dtype (differentiable PyTorch).

    Slots before the row's start come from ``conv_state`` (zeros when None); slots holding an input of another
    sequence than the row's last token are zero, so the state continues only that sequence.
    """
    B, T, C = x.shape
    history = x.new_zeros(B, width, C) if conv_state is None else conv_state.transpose(1, 2).to(x.dtype)
    tail = torch.cat([history, x[:, max(T - width, 0):]], dim=1)[:, -width:]
    if seq_idx is not None and T > 0:
        ids = torch.cat([seq_idx[:, :1].expand(B, width), seq_idx[:, max(T - width, 0):]], dim=1)[:, -width:]
        tail = tail * (ids == seq_idx[:, -1:]).unsqueeze(-1).to(tail.dtype)
    return tail.transpose(1, 2).contiguous()


def _rows_strided(x):
    """``x`` itself when the kernels can read it in place — unit channel stride, rows ``T·stride(1)`` apart: a column
    slice of a contiguous ``[B, T, C']`` tensor such as the KDA layer's q / k / v parts of its fused projection —
    else a contiguous copy."""
    B, T, _ = x.shape
    if x.stride(-1) == 1 and (B == 1 or x.stride(0) == T * x.stride(1)):
        return x
    return x.contiguous()


def causal_conv1d(x, weight, conv_state=None, seq_idx=None, *, output_final_state=True):
    r"""Depthwise causal convolution followed by SiLU, restarting at sequence boundaries; differentiable.

    For channel c, token t of row b (tap j looks j steps back; the op of causal-conv1d / fla's
    ``causal_conv1d`` with ``activation="silu"``)::

        y[b, t, c] = SiLU( Σ_{j<W} weight[c, W−1−j] · x[b, t−j, c] · [seq_idx[b, t−j] = seq_idx[b, t]] )

    where ``x[b, t−j]`` for ``t−j < 0`` is ``conv_state[b, :, W + t − j]`` and counts as the row's first
    sequence id. Accumulated in float32.

    Args:
        x: ``[B, T, C]`` float16 / bfloat16 / float32, read in place when its channels are contiguous and its
            rows evenly spaced (e.g. a column slice of a wider projection output), else copied first.
        weight: ``[C, W]`` depthwise kernel (``nn.Conv1d(C, C, W, groups=C).weight.squeeze(1)``), 1 ≤ W ≤ 8.
        conv_state: optional ``[B, C, W]`` the W inputs before x, oldest first (from the cache); None = zeros.
            Differentiable when it requires grad.
        seq_idx: optional ``[B, T]`` int32/int64 sequence id per token (packed documents); a token never sees
            inputs of another id.
        output_final_state: return the new state (False: None, and its few PyTorch launches are skipped).

    Returns:
        ``(y [B, T, C] in x's dtype, new_state [B, C, W] in x's dtype)``: the state holds the last W inputs of
        each row, zero where an input belongs to another sequence than the row's last token.

    Raises:
        ValueError: wrong shapes, dtypes or devices, or W outside [1, 8].
    """
    (y,), new_state = causal_conv1d_parts(x, weight, conv_state, seq_idx, parts=1,
                                          output_final_state=output_final_state)
    return y, new_state


def causal_conv1d_parts(x, weight, conv_state=None, seq_idx=None, *, parts, output_final_state=True):
    r""":func:`causal_conv1d` over channels that are ``parts`` equal parts, each part's output its own contiguous
    tensor: the KDA layer's short conv of q, k and v in one launch.

    The values are those of ``causal_conv1d(x, weight, conv_state, seq_idx)`` with its output split into ``parts``
    column blocks (the conv is depthwise, so every channel only sees its own taps; Mamba, Gu & Dao 2023 §3.4, the
    causal-conv1d convention). One forward launch reads x in place (e.g. the q|k|v columns of a fused projection,
    through its row stride) and stores each part to a fresh contiguous ``[B, T, C / parts]`` tensor, so neither a
    copy of x nor of the outputs is made. The backward takes the parts' gradients as they are (separate tensors,
    no concatenation) and writes one ``dx [B, T, C]``, the gradient of x as autograd hands it back; two launches
    and one PyTorch sum of the dweight partials whatever ``parts`` is.

    Args:
        x, weight, conv_state, seq_idx, output_final_state: as in :func:`causal_conv1d` (``x [B, T, C]``,
            ``weight [C, W]``, ``conv_state [B, C, W]`` over all C channels, ``seq_idx [B, T]``).
        parts: 1, 2 or 3 (an int dividing C); part i holds channels ``[i·C/parts, (i+1)·C/parts)``.

    Returns:
        ``(ys, new_state)``: ``ys`` a tuple of ``parts`` contiguous ``[B, T, C / parts]`` tensors in x's dtype;
        ``new_state [B, C, W]`` as :func:`causal_conv1d` returns it (over all C channels), or None.

    Raises:
        ValueError: as :func:`causal_conv1d`, or ``parts`` not an int in [1, 3] dividing C.
    """
    _, _, C, W = _validate(x, weight, conv_state, seq_idx)
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= MAX_PARTS or C % parts:
        raise ValueError(f"parts must be an int in [1, {MAX_PARTS}] dividing the C = {C} channels, got {parts!r}")
    state = conv_state.contiguous() if conv_state is not None else None
    ids = seq_idx.contiguous() if seq_idx is not None else None
    ys = CausalConv1dFunction.apply(_rows_strided(x), weight.contiguous(), state, ids, parts)
    return ys, final_conv_state(x, conv_state, seq_idx, W) if output_final_state else None


def causal_conv1d_update(x, conv_state, weight):
    r"""One decoding step: ``new_state = [conv_state[..., 1:], x]``, ``y = SiLU(Σ_m new_state[..., m] · weight[:, m])``.

    Equals :func:`causal_conv1d` on ``x[:, None]`` with that ``conv_state`` (one launch instead of a few);
    ``conv_state`` is not modified (unlike causal-conv1d's in-place update). Forward only.

    Args:
        x: ``[B, C]`` or ``[B, 1, C]`` float16 / bfloat16 / float32 (the new token's inputs).
        conv_state: ``[B, C, W]`` the W previous inputs, oldest first.
        weight: ``[C, W]``, 1 ≤ W ≤ 8.

    Returns:
        ``(y like x, new_state [B, C, W] in x's dtype)``.

    Raises:
        ValueError: wrong shapes, dtypes or devices, or an input that requires grad while grad mode is on.
    """
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[1] != 1):
        raise ValueError(f"x must be [B, C] or [B, 1, C], got {getattr(x, 'shape', type(x).__name__)}")
    if conv_state is None:
        raise ValueError("conv_state is required for a decoding step")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    _validate(x3, weight, conv_state, None)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, conv_state, weight)):
        raise ValueError("causal_conv1d_update has no backward; use causal_conv1d for a differentiable step")
    y, new_state = conv_update(x3[:, 0].contiguous(), conv_state.contiguous(), weight.contiguous())
    return y.view(x.shape), new_state


def causal_conv1d_update_slots(x, conv_pool, slot_ids, weight, *, check_slot_ids_values=True):
    r"""One decoding step for N sequences whose conv windows live in a slot pool, updated in place: for sequence n
    on slot ``s = slot_ids[n]``, ``conv_pool[s] ← [conv_pool[s][:, 1:], x[n]]`` and
    ``y[n] = SiLU(Σ_m conv_pool[s][:, m] · weight[:, m])`` (the new window), accumulated in float32.

    Equals :func:`causal_conv1d_update` on ``conv_pool[slot_ids]`` followed by ``conv_pool[slot_ids] = new_state``,
    without the gather and the scatter. Forward only.

    Args:
        x: ``[N, C]`` float16 / bfloat16 / float32, unit channel stride (any row stride: a column slice of a wider
            projection output is read in place).
        conv_pool: ``[num_slots, C, W]`` float16 / bfloat16 / float32, contiguous; rows ``slot_ids`` are read and
            overwritten (stored in the pool's dtype), the others are not touched.
        slot_ids: ``[N]`` int32 / int64, distinct, in ``[0, num_slots)``, on x's device.
        weight: ``[C, W]``, 1 ≤ W ≤ 8.
        check_slot_ids_values: check the ids' range and distinctness (a device synchronisation; see
            ``kdamoe.kernels.utils.check_slot_ids``); False for ids valid by construction.

    Returns:
        ``y [N, C]`` in x's dtype, contiguous.

    Raises:
        ValueError: wrong shapes, dtypes or devices (naming the argument), a pool that is not contiguous, bad
            ``slot_ids``, or an input that requires grad while grad mode is on.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be [N, C], got {getattr(x, 'shape', type(x).__name__)}")
    # the shape / dtype / device checks of causal_conv1d, on x as one token of N rows
    N, C = x.shape
    _, _, _, W = _validate(x[:, None], weight, None, None)
    _check_pool("conv_pool", conv_pool, C, W, x.device, rows="num_slots")
    check_slot_ids(slot_ids, N, conv_pool.shape[0], x.device, check_slot_ids_values, "causal_conv1d_update_slots")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight)):
        raise ValueError("causal_conv1d_update_slots has no backward; use causal_conv1d for a differentiable step")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return conv_update_slots(x, conv_pool, slot_ids, weight.contiguous())


def _check_pool(name: str, pool, C: int, W: int, device, rows: str) -> None:
    """A slot pool of conv windows ``[rows, C, W]``, float16 / bfloat16 / float32, contiguous (updated in place), on
    ``device``, or a ValueError naming ``name``."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 3 or pool.shape[1:] != (C, W):
        shape = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(f"{name} must be [{rows}, C, W] = ({rows}, {C}, {W}), got {shape}")
    if pool.dtype not in _FLOATS:
        raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {pool.dtype}")
    _check_device(name, pool, device)
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous (updated in place), got strides {pool.stride()}")


def causal_conv1d_varlen_slots(x, weight, conv_states, cache_indices, cu_seqlens, *, parts=1, has_initial_state=None,
                               check_cache_indices_values=True):
    r"""The short conv of packed sequences of any length whose conv windows live in a slot pool, read and updated in
    place (forward only): the prompt chunks and tool-result turns of a rollout-engine step.

    For sequence n (tokens ``cu_seqlens[n] … cu_seqlens[n+1] − 1`` of x) on slot ``s = cache_indices[n]``, the values
    of ``causal_conv1d(x_n[None], weight, conv_states[s][None])`` split into ``parts`` column blocks, and afterwards
    ``conv_states[s]`` holds the last W inputs of (old window ++ the sequence's tokens), oldest first: what
    gather → :func:`causal_conv1d_parts` → scatter computes, without the gather, the scatter or a padded copy of the
    ragged rows (Mamba, Gu & Dao 2023 §3.4; the names ``conv_states``, ``cache_indices``, ``has_initial_state`` are
    those of the causal-conv1d / vLLM varlen op, whose ``query_start_loc`` is ``cu_seqlens`` here). Accumulated in
    float32.

    Args:
        x: ``[T, C]`` float16 / bfloat16 / float32, the sequences' tokens packed one after another, unit channel
            stride (any row stride: a column slice of a wider projection output is read in place).
        weight: ``[C, W]`` depthwise kernel, 1 ≤ W ≤ 8.
        conv_states: ``[P, C, W]`` float16 / bfloat16 / float32 pool, contiguous; rows ``cache_indices`` are read
            and overwritten (in the pool's dtype), the others are not touched.
        cache_indices: ``[N]`` int32 / int64, distinct, in ``[0, P)``, on x's device.
        cu_seqlens: ``[N+1]`` int32 / int64 cumulative lengths (FlashAttention convention), from 0 to T,
            non-decreasing, on x's device. A sequence of length 0 keeps its window.
        parts: 1, 2 or 3 (an int dividing C); part i holds channels ``[i·C/parts, (i+1)·C/parts)``.
        has_initial_state: optional ``[N]`` bool on x's device; False: the sequence starts from a zero window
            (its slot's old window is ignored). None: every sequence continues its slot's window.
        check_cache_indices_values: check the values of ``cache_indices`` (range, distinctness) and
            ``cu_seqlens`` (from 0 to T, non-decreasing): a device synchronisation; False for values valid by
            construction (the engine's).

    Returns:
        ``ys``: a tuple of ``parts`` contiguous ``[T, C / parts]`` tensors in x's dtype.

    Raises:
        ValueError: wrong shapes, dtypes or devices (naming the argument), a pool that is not contiguous, bad
            ``cache_indices`` / ``cu_seqlens`` values (when checked, naming them), ``parts`` not an int in [1, 3]
            dividing C, or an input requiring grad while grad mode is on (there is no backward).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be [T, C], got {getattr(x, 'shape', type(x).__name__)}")
    T, C = x.shape
    _, _, _, W = _validate(x[None], weight, None, None)
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= MAX_PARTS or C % parts:
        raise ValueError(f"parts must be an int in [1, {MAX_PARTS}] dividing the C = {C} channels, got {parts!r}")
    _check_pool("conv_states", conv_states, C, W, x.device, rows="P")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32 / int64 tensor [N+1], got "
                         f"{getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)} "
                         f"{getattr(cu_seqlens, 'dtype', '')}")
    _check_device("cu_seqlens", cu_seqlens, x.device)
    N = cu_seqlens.numel() - 1
    check_slot_ids(cache_indices, N, conv_states.shape[0], x.device, check_cache_indices_values,
                   "causal_conv1d_varlen_slots", name="cache_indices")
    if check_cache_indices_values:
        cl = cu_seqlens.tolist()
        if cl[0] != 0 or cl[-1] != T or any(b < a for a, b in pairwise(cl)):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T} without decreasing, got {cl}")
    flags = None
    if has_initial_state is not None:
        if not isinstance(has_initial_state, torch.Tensor) or has_initial_state.shape != (N,) \
                or has_initial_state.dtype != torch.bool:
            raise ValueError(f"has_initial_state must be a bool tensor [N] = [{N}], got "
                             f"{getattr(has_initial_state, 'shape', type(has_initial_state).__name__)} "
                             f"{getattr(has_initial_state, 'dtype', '')}")
        _check_device("has_initial_state", has_initial_state, x.device)
        flags = has_initial_state.to(torch.int32)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, conv_states)):
        raise ValueError("causal_conv1d_varlen_slots has no backward: an input requires grad; run it under "
                         "torch.no_grad() or use causal_conv1d_parts")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return tuple(conv_varlen_slots(x, weight.contiguous(), conv_states, cache_indices, cu_seqlens.contiguous(),
                                   flags, parts))
