"""Write N rows, each to an address of its own read from a device table: the MLA rows a decode step appends to the
episodes' buffers.

The rollout engine keeps each episode's MLA rows in a buffer of its own; a decode step appends one row to each.
Copying them one tensor at a time (``torch._foreach_copy_``) names every destination in the launch, so a CUDA graph of
the step would write to the buffers of the step it was captured in. Here the destinations travel in a device table
``row_ptrs [N]`` (``data_ptr`` of each destination row, refilled by the host before each replay) and one program per
row (and column block) copies ``rows[n]`` there; an entry 0 (a padding row of a batch-size bucket) writes nothing.

Reference: ``dst[n].copy_(rows[n])`` for every n with ``row_ptrs[n] != 0`` (tests/kernels/test_mla_shared_prefix.py).
"""

import torch
import triton
import triton.language as tl

from ..utils import cdiv, is_interpreter, next_power_of_2

_BLOCK_D = 256


@triton.jit
def _write_rows_kernel(rows, row_ptrs, stride, D, BLOCK_D: tl.constexpr):
    n, i_d = tl.program_id(0), tl.program_id(1)
    address = tl.load(row_ptrs + n)
    if address == 0:
        return  # a padding row: no destination
    dst = address.to(tl.pointer_type(rows.dtype.element_ty))
    cols = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    tl.store(dst + cols, tl.load(rows + n.to(tl.int64) * stride + cols, mask=ok), mask=ok)


def write_rows_at(rows, row_ptrs):
    """``rows [N, D]`` (unit column stride, any row stride; float16 / bfloat16 / float32) written to the addresses in
    ``row_ptrs [N]`` (int64 on rows' device: ``data_ptr`` of a contiguous destination row of ``D`` elements of rows'
    dtype each, 0 for none). Launch arguments are fixed addresses and shapes: a CUDA graph can capture it and the host
    refills ``row_ptrs`` before each replay. The destinations must not overlap ``rows`` or each other (nothing checks
    the addresses: a device read).

    Raises:
        ValueError: ``rows`` not 2-D with unit column stride or not float16 / bfloat16 / float32, ``row_ptrs``
            not an int64 ``[N]`` tensor on rows' device, a device the kernels cannot run on.
    """
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or (rows.shape[1] > 1 and rows.stride(1) != 1):
        raise ValueError(f"rows must be [N, D] with unit column stride, got {getattr(rows, 'shape', type(rows))}")
    if rows.device.type != "cuda" and not (rows.device.type == "cpu" and is_interpreter()):
        raise ValueError(f"rows is on {rows.device}: the Triton kernels need a CUDA tensor (or CPU with "
                         "TRITON_INTERPRET=1)")
    if rows.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rows dtype must be float16, bfloat16 or float32, got {rows.dtype}")
    N, D = rows.shape
    if not isinstance(row_ptrs, torch.Tensor) or row_ptrs.dtype != torch.int64 or row_ptrs.shape != (N,) or \
            row_ptrs.device != rows.device:
        got = row_ptrs
        if isinstance(row_ptrs, torch.Tensor):
            got = (row_ptrs.dtype, tuple(row_ptrs.shape), row_ptrs.device)
        raise ValueError(f"row_ptrs must be an int64 tensor [{N}] on {rows.device}, got {got}")
    if N * D:
        block_d = min(_BLOCK_D, next_power_of_2(D))
        _write_rows_kernel[(N, cdiv(D, block_d))](rows, row_ptrs, rows.stride(0), D, BLOCK_D=block_d, num_warps=1)
