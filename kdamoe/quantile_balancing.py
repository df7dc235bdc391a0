"""Router-bias balancing without an auxiliary loss: Quantile Balancing and the sign rule.

Quantile Balancing (Kimi K3 report §2.3; DESIGN.md §1.3 and §6). With sigmoid scores ``s``, bias ``b``
and Top-(k+1) of ``s + b``, let ``α_i`` be token i's (k+1)-th biased score. Expert j is picked for
token i roughly when ``s_ij + b_j > α_i``, i.e. when ``b_j > r_ij := α_i − s_ij``. Setting ``b_j`` to
the ``k/E`` quantile of ``r_{:,j}`` therefore gives every expert a ``k/E`` share of the tokens:

    b̂_j = quantile_{k/E}(r_{:,j}),     b ← b̂ − mean(b̂)

The quantile is read off a per-expert histogram (fixed size, summable across ranks with one
all-reduce): ``num_bins`` uniform bins over ``[min(b) − 1, max(b) + 1]`` — the whole range ``r`` can
take, since ``α ∈ (min b, max b + 1)`` and ``s ∈ (0, 1)`` — with linear interpolation inside the bin.

The sign rule is DeepSeek-V3's loss-free balancing (arXiv:2412.19437 §2.1.2):
``b_j += u · sign(mean_load − load_j)``.
"""

import torch
import torch.distributed as dist


def histogram_range(bias: torch.Tensor) -> tuple[float, float]:
    """``(lo, hi) = (min(b) − 1, max(b) + 1)``: the interval every ``r_ij`` lies in (float64 scalars)."""
    return float(bias.min()) - 1.0, float(bias.max()) + 1.0


def qb_histogram(r: torch.Tensor, lo: float, hi: float, num_bins: int) -> torch.Tensor:
    """Per-expert histogram of ``r``.

    Args:
        r: ``[N, E]`` values ``α_i − s_ij`` of the N counted tokens (float32).
        lo, hi: histogram range; values outside are clamped into the edge bins.
        num_bins: bins per expert.

    Returns:
        ``[E, num_bins]`` float64 counts (exact integers; float64 so any backend can all-reduce them).
    """
    num_experts = r.shape[-1]
    width = (hi - lo) / num_bins
    idx = ((r.double() - lo) / width).floor().long().clamp_(0, num_bins - 1)  # [N, E]
    flat = idx + torch.arange(num_experts, device=r.device) * num_bins
    counts = torch.bincount(flat.flatten(), minlength=num_experts * num_bins)
    return counts.view(num_experts, num_bins).double()


def quantile_from_histogram(counts: torch.Tensor, lo: float, hi: float, q: float) -> torch.Tensor:
    """The ``q`` quantile of each row's histogram, linearly interpolated inside the crossing bin.

    Args:
        counts: ``[E, num_bins]`` non-negative counts.
        lo, hi: the histogram range.
        q: quantile level in (0, 1).

    Returns:
        ``[E]`` float64 quantiles; accurate to one bin width ``(hi − lo) / num_bins``. A row with no
        counts returns the midpoint of the range.
    """
    num_bins = counts.shape[-1]
    width = (hi - lo) / num_bins
    total = counts.sum(-1, keepdim=True)
    target = q * total
    cum = counts.cumsum(-1)
    # First bin whose cumulative count reaches the target.
    bin_idx = (cum < target).sum(-1, keepdim=True).clamp_(max=num_bins - 1)
    before = torch.where(bin_idx > 0, cum.gather(-1, (bin_idx - 1).clamp(min=0)), torch.zeros_like(target))
    in_bin = counts.gather(-1, bin_idx)
    frac = torch.where(in_bin > 0, (target - before) / in_bin.clamp(min=1e-12), torch.full_like(target, 0.5))
    value = lo + (bin_idx.double() + frac.clamp(0, 1)) * width
    return torch.where(total > 0, value, torch.full_like(value, (lo + hi) / 2)).squeeze(-1)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` in place across the default process group when one is initialised (else no-op)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def quantile_balancing_update(counts: torch.Tensor, lo: float, hi: float, top_k: int) -> torch.Tensor:
    """New centred bias ``b̂ − mean(b̂)`` with ``b̂_j = quantile_{k/E}(r_{:,j})`` (``[E]`` float64)."""
    num_experts = counts.shape[0]
    b_hat = quantile_from_histogram(counts, lo, hi, top_k / num_experts)
    return b_hat - b_hat.mean()


def sign_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3 loss-free rule: ``b + rate · sign(mean(load) − load)`` (``[E]``, bias dtype)."""
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)
