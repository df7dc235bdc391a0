"""Small helpers shared by the Triton kernel families, and the error measure their checks use.

Where the CPU interpreter (``TRITON_INTERPRET=1``) runs something other than the GPU, the difference sits
in one named function: :func:`autotune` here (the first config instead of the timed choice, for every
autotuned kernel) and ``kdamoe.kernels.moe.experts._interpreter_launch`` (fewer empty programs). Block
sizes are otherwise the GPU's.
"""

import functools
import os

import torch


def is_interpreter() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_CONSTANTS: dict = {}
_MAX_CONSTANTS = 1024  # past this many keys the cache drops the entries no captured graph reads
_PINNED: set = set()  # keys a CUDA graph was captured with: their memory must outlive the graph, so they stay


def cached_constant(key, build):
    """The device tensor(s) ``build()`` returns, built once per ``key`` and then reused: index tables that depend on
    shapes only (aranges, chunk tables), so that a forward does not launch kernels to rebuild them every call.
    Callers only read them (kernel arguments, saved for backward), never write them.

    Built outside inference mode (an inference tensor could not be saved for a later training backward). Under CUDA
    graph capture: a value built then is not kept (its memory belongs to the graph's pool), and a cached value read
    then is pinned, since the graph replays its address and a later eviction would free memory the graph still reads;
    past ``_MAX_CONSTANTS`` keys the unpinned entries are dropped."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    value = _CONSTANTS.get(key)
    if value is None:
        with torch.inference_mode(False):
            value = build()
        if capturing:
            return value
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            for old in [k for k in _CONSTANTS if k not in _PINNED]:
                del _CONSTANTS[old]
        _CONSTANTS[key] = value
    elif capturing:
        _PINNED.add(key)
    return value


def cached_arange(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.arange(n, dtype=dtype, device=device)``, cached (:func:`cached_constant`); read-only."""
    return cached_constant(("arange", n, dtype, device),
                           lambda: torch.arange(n, dtype=dtype, device=device))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of Python ints, on the host (``triton.cdiv`` is a ``constexpr_function`` in Triton 3.6 whose call
    unwraps its arguments: ~10× the cost, ~750 calls in a training step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ≥ ``n`` (``n`` itself for 0 and 1), on the host: ``triton.next_power_of_2``'s result
    without its ``constexpr_function`` wrapper (see :func:`cdiv`)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side property, no sync); 1 for any other device."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_tile(n_rows: int, D: int, block_elems: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, num_warps)`` of a row-wise kernel that holds whole rows of ``D`` columns: as many rows as
    fit ``block_elems`` elements (float32 registers per program), one warp per 512 elements, at most 16."""
    block_d = next_power_of_2(D)
    block_m = min(next_power_of_2(n_rows), max(1, block_elems // block_d))
    return block_m, block_d, min(16, max(1, block_m * block_d // 512))


def partial_programs(n_blocks: int, device: torch.device, per_sm: int) -> int:
    """Programs of a persistent backward over ``n_blocks`` row blocks that writes one float32 partial row each
    (summed by the caller: deterministic, no atomics): ``per_sm`` per SM, at most ``n_blocks``. Under the interpreter
    2, which runs programs one after the other and still checks the sum of the partials."""
    programs = 2 if is_interpreter() else sm_count(device) * per_sm
    return min(n_blocks, programs)


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative L2 error ``‖actual − reference‖ / ‖reference‖``, computed in float64 on the CPU.

    Used by the kernel tests and the benchmarks alike.

    Args:
        actual: tensor under test (any float dtype and device).
        reference: tensor of the same shape, usually a float64 or float32 reference.

    Returns:
        The error as a Python float.

    Raises:
        ValueError: shapes differ, ``actual`` has a non-finite value, or ``reference`` is all zeros (the
            ratio would say nothing).
    """
    if tuple(actual.shape) != tuple(reference.shape):
        raise ValueError(f"relative_error: shapes differ, {tuple(actual.shape)} vs {tuple(reference.shape)}")
    a = actual.detach().double().cpu()
    b = reference.detach().double().cpu()
    if not torch.isfinite(a).all():
        raise ValueError("relative_error: actual has non-finite values")
    norm = b.norm()
    if not norm > 0:
        raise ValueError("relative_error: reference is all zeros, the relative error is meaningless")
    return float((a - b).norm() / norm)


def check_slot_ids(slot_ids, n: int, num_slots: int, device: torch.device, check_values: bool, op: str,
                   name: str = "slot_ids") -> None:
    """Argument checks of the slot-indexed decode ops: ``slot_ids`` a 1-D int32 / int64 tensor of ``n`` entries on
    ``device``; with ``check_values`` also every id in ``[0, num_slots)`` and no id twice (two programs would
    update the same state at once). That value check copies one flag to the host, a device synchronisation (and is
    skipped during CUDA graph capture, where it cannot run); pass False for ids distinct and in range by
    construction (the engine's slots). ``name``: the argument's name in the messages (e.g. ``cache_indices``).

    Raises:
        ValueError: naming the bad shape, dtype, device or value.
    """
    if not isinstance(slot_ids, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(slot_ids).__name__}")
    if slot_ids.dim() != 1 or slot_ids.shape[0] != n:
        raise ValueError(f"{op}: {name} must be [N] = [{n}], got shape {tuple(slot_ids.shape)}")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} dtype must be int32 or int64, got {slot_ids.dtype}")
    if slot_ids.device != device:
        raise ValueError(f"{op}: {name} is on {slot_ids.device}, expected {device}")
    if check_values and n > 0 and not (slot_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        ids = slot_ids.long()
        if bool(((ids < 0) | (ids >= num_slots)).any()):
            raise ValueError(f"{op}: {name} must lie in [0, num_slots={num_slots}), got min {int(ids.min())} "
                             f"max {int(ids.max())}")
        if torch.unique(ids).numel() != n:
            raise ValueError(f"{op}: {name} must be distinct (two sequences on one slot would race on its "
                             f"state), got {slot_ids.tolist()}")
