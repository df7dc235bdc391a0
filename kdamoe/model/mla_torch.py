"""Pure-PyTorch MLA attention in the latent space (absorbed up-projections): the CPU path and the reference
of the Triton kernel ``kdamoe.kernels.latent_attention``.

With no positional encoding (docs/architecture.md §2) the key and value up-projections of multi-head latent
attention (DeepSeek-V2, arXiv:2405.04434, §2.1.2 "absorb W_UK into W_Q, W_UV into W_O") fold into the query and
the output: per head ``h``, with the cached latent ``c_s = RMSNorm(W_dkv x_s)`` of width ``R``::

    q_lat[h] = W_uk[h]ᵀ q[h]                       (done by the layer)
    s_hs     = scale · q_lat[h] · c_s
    o_lat[h] = Σ_s softmax_s(s_h·)_s · c_s          (this op)
    o[h]     = W_uv[h] o_lat[h]                     (done by the layer)

Keys and values are the same latent tensor, shared by all heads: multi-query attention of width ``R``.

With a shared key part of width ``Dr`` (``qk_rope_head_dim``; Kimi Linear) each cached row is ``[c_s | k_shared,s]``
and the absorbed query ``[W_uk[h]ᵀ q_nope[h] | q_shared[h]]``: the scores are one dot product of width ``R + Dr`` and
the values the first ``R`` columns of each row (``value_dim=R``), so the op returns ``o_lat[h]`` of width ``R``.

Remote-code rule (docs/architecture.md §7): this file is copied next to saved weights; it imports only torch.
"""

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MASK_DTYPES = (torch.bool, torch.int8, torch.int32, torch.int64)


def check_latent_attention_args(q, latent, seq_len, key_mask, floats=_FLOATS, value_dim=None) -> None:
    """Shape / dtype / device checks shared by the latent-attention ops (never a value check: no host sync).

    Raises:
        ValueError: naming the bad argument (see :func:`latent_attention_torch`).
    """
    for name, t in (("q", q), ("latent", latent), ("seq_len", seq_len)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, R], got shape {tuple(q.shape)}")
    B, T, H, R = q.shape
    if T < 1 or H < 1 or R < 1:
        raise ValueError(f"q must have T, H, R >= 1, got shape {tuple(q.shape)}")
    if latent.dim() != 3 or latent.shape[0] != B or latent.shape[2] != R:
        raise ValueError(f"latent must be [B, S_cap, R] = ({B}, S_cap, {R}) like q, got shape {tuple(latent.shape)}")
    if value_dim is not None and (not isinstance(value_dim, int) or isinstance(value_dim, bool)
                                  or not 1 <= value_dim <= R):
        raise ValueError(f"value_dim must be None or an integer in [1, {R}] (q's last dim), got {value_dim!r}")
    if q.dtype not in floats:
        raise ValueError(f"q dtype must be one of {floats}, got {q.dtype}")
    if latent.dtype != q.dtype:
        raise ValueError(f"latent dtype {latent.dtype} differs from q dtype {q.dtype}")
    if latent.stride(2) != 1:
        raise ValueError(f"latent must have a contiguous last dim, got strides {latent.stride()}")
    if seq_len.dtype not in (torch.int32, torch.int64) or seq_len.numel() != 1 or seq_len.dim() > 1:
        raise ValueError(f"seq_len must be an int32/int64 tensor of shape [] or [1], got {seq_len.dtype} "
                         f"of shape {tuple(seq_len.shape)}")
    for name, t in (("latent", latent), ("seq_len", seq_len)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, expected {q.device} like q")
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dim() != 2 or key_mask.shape[0] != B:
            shape = tuple(key_mask.shape) if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
            raise ValueError(f"key_mask must be [B, S_mask] with B = {B}, got {shape}")
        if key_mask.dtype not in _MASK_DTYPES:
            raise ValueError(f"key_mask dtype must be bool, int8, int32 or int64, got {key_mask.dtype}")
        if key_mask.device != q.device:
            raise ValueError(f"key_mask is on {key_mask.device}, expected {q.device} like q")


def latent_attention_torch(q, latent, seq_len, scale, key_mask=None, value_dim=None):
    r"""Causal multi-query softmax attention over the latent cache: keys = ``latent``, values = its first
    ``V = value_dim`` columns (all of them by default).

    Query ``t`` of row ``b`` sits at absolute position ``p_t = seq_len − T + t`` and sees key ``s`` iff
    ``s ≤ p_t`` and (with a mask) ``key_mask[b, s] ≠ 0``; then, for head ``h``::

        o[b, t, h] = Σ_{s visible} exp(scale · q[b,t,h]·latent[b,s]) latent[b,s,:V] / Σ_{s visible} exp(...)

    and ``o = 0`` where no key is visible. Rows of ``latent`` at or after ``seq_len`` or under the mask are never
    read into the result (a preallocated buffer may hold NaN there): they are zeroed before any product. Math in float32
    (float64 for float64 inputs). No host synchronisation: ``seq_len`` stays on its device, so the op can be
    captured in a CUDA graph. ``seq_len`` is not range-checked (that would sync); it is clamped to the buffer
    length ``min(S_cap, S_mask)``.

    Args:
        q: ``[B, T, H, R]`` float16 / bfloat16 / float32 / float64, the absorbed queries ``W_ukᵀ q`` (with a shared
            key part, ``[W_ukᵀ q_nope | q_shared]``: ``R`` here is the whole row width ``kv_lora_rank + Dr``).
        latent: ``[B, S_cap, R]`` q's dtype, last dim contiguous: the latent cache, the T new tokens already
            written at rows ``seq_len − T … seq_len − 1``.
        seq_len: int32 / int64 tensor of shape ``[]`` or ``[1]`` on q's device: valid rows, the T new ones
            included (expected in ``[T, min(S_cap, S_mask)]``).
        scale: softmax scale (Python float), e.g. ``1 / sqrt(qk_head_dim)``.
        key_mask: optional ``[B, S_mask]`` bool / int8 / int32 / int64, nonzero = key may be attended
            (padding mask); entries at or after ``seq_len`` are ignored.
        value_dim: the leading columns of ``latent`` that are values (``kv_lora_rank`` when the rows end with a
            shared key part); None → all ``R``.

    Returns:
        ``o_lat [B, T, H, value_dim]`` in q's dtype.

    Raises:
        ValueError: a wrong rank, shape, dtype or device, or a ``value_dim`` outside ``[1, R]``, naming the argument.
    """
    check_latent_attention_args(q, latent, seq_len, key_mask, value_dim=value_dim)
    B, T, H, R = q.shape
    V = R if value_dim is None else value_dim
    S = latent.shape[1] if key_mask is None else min(latent.shape[1], key_mask.shape[1])
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = torch.arange(S, device=q.device)
    n = seq_len.reshape(()).long().clamp(max=S)
    key_ok = (keys < n).expand(B, S)  # [B, S]
    if key_mask is not None:
        key_ok = key_ok & (key_mask[:, :S] != 0)
    lat = torch.where(key_ok[..., None], latent[:, :S].to(dtype), 0.0)  # garbage / padded rows never multiply
    positions = n - T + torch.arange(T, device=q.device)  # [T]
    visible = (keys[None, :] <= positions[:, None])[None] & key_ok[:, None, :]  # [B, T, S]
    scores = torch.einsum("bthr,bsr->bths", q.to(dtype), lat) * scale
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # a row with no key: exp(-inf) = 0 everywhere
    p = torch.exp(scores - row_max)
    denom = p.sum(-1, keepdim=True)
    o = torch.einsum("bths,bsr->bthr", p, lat[..., :V]) / torch.where(denom > 0, denom, 1.0)
    return o.to(q.dtype)
