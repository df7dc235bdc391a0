"""MXFP4 codec for Kimi K3's routed-expert weights: decode ``weight_packed`` / ``weight_scale`` to floats, encode
floats back.

Format (OCP Microscaling Formats (MX) Specification v1.0, §5.2 element type FP4 E2M1 and §5.4 scale type E8M0; the
layout is the one of K3's released checkpoint, read by NeMo AutoModel 0.7.0's
``nemo_automodel/components/models/kimi_k3/state_dict_adapter.py`` and laid out like transformers'
``integrations/mxfp4.py`` gpt-oss blocks): a weight ``W [out, in]`` is cut along ``in`` into blocks of 32 elements;
each block has one scale byte and 32 four-bit elements.

* ``weight_packed``: uint8 ``[out, in / 2]``; byte ``j`` of a row holds element ``2j`` in its low nibble and element
  ``2j + 1`` in its high nibble.
* ``weight_scale``: uint8 ``[out, in / 32]``, E8M0: the byte ``s`` stands for ``2^(s − 127)``; ``s = 255`` is NaN.
* a nibble is E2M1: bit 3 the sign, bits 2–1 the exponent ``e`` (bias 1), bit 0 the mantissa ``m``; its value is
  ``(−1)^sign · 2^(e − 1) · (1 + m/2)`` for ``e > 0`` and ``(−1)^sign · m/2`` for ``e = 0`` (subnormal), i.e. the
  magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` for the nibbles ``0 … 7``, negated for ``8 … 15``.
* ``W[r, 32b + i] = E2M1(element i of block b) · 2^(weight_scale[r, b] − 127)``.

Encoding (:func:`mxfp4_encode`) follows the quantiser of the compressed-tensors library (the library whose
``weight_packed`` / ``weight_scale`` names K3's checkpoint uses; ``compressed_tensors/quantization/utils/
mxfp4_utils.py``, ``generate_mxfp4_scales`` / ``round_to_power_2``): with ``amax`` the block's largest magnitude
written ``amax = f · 2^E``, ``f ∈ [1, 2)``, the block's power of two is ``P = 2^(E + 1)`` if ``f ≥ 1.75`` else
``2^E``, and the scale is ``P / 4`` (scale byte ``log2(P) − 2 + 127``, clamped to ``[0, 254]``; an all-zero block
gets byte 0). So ``amax / scale ∈ [3.5, 7)``: the largest element is never clipped by more than the rounding
itself. Each element is then rounded to the nearest E2M1 value of ``x / scale`` (ties to the even mantissa: 0.25 →
0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4), magnitudes above 6 saturating to 6. The error of one
element is at most half the E2M1 spacing around it times the scale (0.25, 0.5 or 1 times the scale for
``|x| / scale`` below 2, below 4, or above); on Gaussian weights the relative RMS error is about 0.11
(``docs/checkpoints.md``, section Kimi K3, gives the measurement and its command).

Remote-code rule (docs/architecture.md §7): this file may be copied next to saved weights; it imports only torch.
"""

import torch

MXFP4_BLOCK = 32
"""Elements per MXFP4 block (one E8M0 scale byte each)."""

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The E2M1 magnitudes of the nibbles 0 … 7 (the nibbles 8 … 15 are their negatives)."""

_E8M0_NAN = 255
_DECODE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_ENCODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_mxfp4_pair(weight_packed: torch.Tensor, weight_scale: torch.Tensor, name: str = "weight") -> None:
    """Check that ``weight_packed`` / ``weight_scale`` form one MXFP4 tensor (no value is read).

    Args:
        weight_packed: expected uint8 ``[..., out, in / 2]``.
        weight_scale: expected uint8 ``[..., out, in / 32]`` with the same leading dims.
        name: the tensor's name, used in the error messages (e.g. the checkpoint key without its suffix).

    Raises:
        ValueError: naming ``name`` and the bad shape / dtype: a non-tensor, a dtype other than uint8, fewer than
            2 dims, leading dims that differ, or ``weight_packed``'s last dim not 16 times ``weight_scale``'s.
    """
    for suffix, t in (("_packed", weight_packed), ("_scale", weight_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}{suffix} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name}{suffix} must be uint8, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name}{suffix} must have at least 2 dims [..., out, n], got shape {tuple(t.shape)}")
    if weight_packed.shape[:-1] != weight_scale.shape[:-1]:
        raise ValueError(f"{name}_packed {tuple(weight_packed.shape)} and {name}_scale {tuple(weight_scale.shape)} "
                         "must agree on every dim but the last")
    if weight_packed.shape[-1] != (MXFP4_BLOCK // 2) * weight_scale.shape[-1]:
        raise ValueError(f"{name}_packed last dim must be {MXFP4_BLOCK // 2} x {name}_scale's last dim "
                         f"({MXFP4_BLOCK} four-bit elements per scale byte): got {tuple(weight_packed.shape)} and "
                         f"{tuple(weight_scale.shape)}")
    if weight_packed.device != weight_scale.device:
        raise ValueError(f"{name}_packed is on {weight_packed.device}, {name}_scale on {weight_scale.device}")


def mxfp4_decode(weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 name: str = "weight") -> torch.Tensor:
    """Decode MXFP4 to floats: ``W[..., r, 32b + i] = E2M1(nibble i of block b) · 2^(weight_scale[..., r, b] − 127)``.

    Every decoded value is exact in float64, and in float32 / bfloat16 too (an E2M1 value has two significant bits,
    subnormals included) except above their largest finite value, about 2^128: magnitudes 4 and 6 at scale byte 254
    and 6 at 253 become ``inf`` there. A scale byte of 255 (E8M0 NaN) gives NaN for its whole block.

    Args:
        weight_packed: uint8 ``[..., out, in / 2]`` (low nibble = element ``2j``, high nibble = ``2j + 1``).
        weight_scale: uint8 ``[..., out, in / 32]`` E8M0 exponents (bias 127).
        dtype: float32 (default), bfloat16 or float64.
        name: used in error messages.

    Returns:
        ``[..., out, in]`` tensor of ``dtype`` on the inputs' device.

    Raises:
        ValueError: from :func:`check_mxfp4_pair`, or ``dtype`` not float32 / bfloat16 / float64.
    """
    check_mxfp4_pair(weight_packed, weight_scale, name)
    if dtype not in _DECODE_DTYPES:
        raise ValueError(f"dtype must be one of {_DECODE_DTYPES}, got {dtype}")
    *lead, n_blocks = weight_scale.shape
    work = torch.float64 if dtype == torch.float64 else torch.float32  # bfloat16 shares float32's exponent range
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=work, device=weight_packed.device)
    packed = weight_packed.reshape(*lead, n_blocks, MXFP4_BLOCK // 2)
    values = torch.stack((table[(packed & 0x0F).long()], table[(packed >> 4).long()]), dim=-1)
    values = values.reshape(*lead, n_blocks, MXFP4_BLOCK)  # [..., blocks, 32]: low nibble first within a byte
    exponent = weight_scale.to(torch.int32) - 127
    out = torch.ldexp(values, exponent.unsqueeze(-1).to(work))
    out = torch.where((weight_scale == _E8M0_NAN).unsqueeze(-1), torch.full_like(out, float("nan")), out)
    return out.reshape(*lead, n_blocks * MXFP4_BLOCK).to(dtype)


def mxfp4_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes for blocks of largest magnitude ``amax`` (the rule in the module docstring).

    Args:
        amax: float ``[...]``, each block's ``max |x|`` (finite, ≥ 0).

    Returns:
        uint8 ``[...]``: ``E − 2 + 127`` with ``E = floor(log2 amax)``, plus one when the mantissa of ``amax`` is
        ``≥ 1.75``; clamped to ``[0, 254]``; 0 where ``amax == 0``.
    """
    mantissa, exponent = torch.frexp(amax.to(torch.float64))  # amax = mantissa · 2^exponent, mantissa ∈ [0.5, 1)
    power = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype)  # f = 2·mantissa ∈ [1, 2); f ≥ 1.75 rounds up
    byte = (power.to(torch.int64) - 2 + 127).clamp(0, 254)
    return torch.where(amax > 0, byte, torch.zeros_like(byte)).to(torch.uint8)


def _round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Nibbles (uint8, sign in bit 3) of the E2M1 values nearest to ``y`` (float64), ties to the even mantissa,
    magnitudes above 6 saturating to 6."""
    a = y.abs()
    # Thresholds between consecutive magnitudes; at a tie the even-mantissa neighbour wins: the threshold is
    # inclusive (<=) when the lower neighbour has mantissa 0 (0, 1, 2, 4) and exclusive (<) otherwise (0.5, 1.5, 3).
    code = torch.zeros_like(a, dtype=torch.uint8)
    for lower_code, threshold, lower_even in ((0, 0.25, True), (1, 0.75, False), (2, 1.25, True),
                                               (3, 1.75, False), (4, 2.5, True), (5, 3.5, False), (6, 5.0, True)):
        above = a > threshold if lower_even else a >= threshold
        code = torch.where(above, torch.full_like(code, lower_code + 1), code)
    sign = torch.signbit(y).to(torch.uint8) << 3
    return code | sign


def mxfp4_encode(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight`` to MXFP4 (the compressed-tensors rule: see the module docstring).

    Args:
        weight: float16 / bfloat16 / float32 / float64 ``[..., out, in]``, finite, ``in`` a multiple of 32.
        name: used in error messages.

    Returns:
        ``(weight_packed, weight_scale)``: uint8 ``[..., out, in / 2]`` and uint8 ``[..., out, in / 32]`` on
        ``weight``'s device. ``mxfp4_decode`` of them is ``weight`` rounded as described; it is ``weight`` itself
        when every block of ``weight`` is already an MXFP4 block (E2M1 values times one power of two ≥ 2^−127 whose
        ``amax`` puts it at the scale chosen above, true whenever the block holds a magnitude 4 or 6 times its scale).

    Raises:
        ValueError: naming ``name``: not a float tensor of the dtypes above, fewer than 2 dims, ``in`` not a multiple
            of 32, or a non-finite value (this check reads the values: one host sync on an accelerator).
    """
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in _ENCODE_DTYPES:
        raise ValueError(f"{name} dtype must be one of {_ENCODE_DTYPES}, got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"{name} must be [..., out, in], got shape {tuple(weight.shape)}")
    if weight.shape[-1] % MXFP4_BLOCK != 0:
        raise ValueError(f"{name} last dim must be a multiple of {MXFP4_BLOCK} (the MXFP4 block), got "
                         f"shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{name} holds a non-finite value (MXFP4 encodes finite weights only)")
    *lead, n = weight.shape
    blocks = weight.to(torch.float64).reshape(*lead, n // MXFP4_BLOCK, MXFP4_BLOCK)
    scale_byte = mxfp4_scale_bytes(blocks.abs().amax(dim=-1))
    # x / 2^(s − 127) in float64 is exact (a power-of-two division of a float16/bfloat16/float32 value).
    y = torch.ldexp(blocks, (127 - scale_byte.to(torch.int64)).unsqueeze(-1).to(torch.float64))
    nibbles = _round_e2m1(y).reshape(*lead, n // 2, 2)
    packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return packed, scale_byte
