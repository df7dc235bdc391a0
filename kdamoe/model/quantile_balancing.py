"""Router-bias balancing without an auxiliary loss: Quantile Balancing and the sign rule.

Quantile Balancing (Kimi K3 report §2.3; docs/architecture.md §4). With sigmoid scores ``s``, bias ``b``
and Top-(k+1) of ``s + b``, expert j is picked for token i when ``b_j > r_ij := τ_ij − s_ij``, where the
threshold ``τ_ij`` is what j has to beat with the other biases held fixed. Setting ``b_j`` to the
``k/E`` quantile of ``r_{:,j}`` therefore gives every expert a ``k/E`` share of the tokens:

    b̂_j = quantile_{k/E}(r_{:,j}),     b ← b̂ − mean(b̂)

Taking ``τ_ij = α_i``, the (k+1)-th biased score, for every expert is exact for the
k selected experts (they stay while they beat the (k+1)-th) but not for the others: an unselected
expert enters only by beating the k-th biased score, which is ≥ α_i. With ``α_i`` everywhere the
(k+1)-th expert sits exactly at ``r = b_j``, so an under-loaded expert's quantile falls inside its own
point mass and its bias creeps up by about one histogram bin per update: on the skewed 16-expert router
of tests/test_moe.py max/mean load stalled near 1.2 after 20 updates. We use the k-th biased score as
``τ`` for unselected experts (both scores come from the same Top-(k+1)); the fixed point is the same
(``b_j > r_ij`` ⇔ j is selected) and the load reaches the sampling-noise floor in a few updates.

The quantile is read off a per-expert histogram (fixed size, summable across ranks with one
all-reduce): ``num_bins`` uniform bins over ``[min(b) − 1, max(b) + 1]`` — the whole range ``r`` can
take, since ``α ∈ (min b, max b + 1)`` and ``s ∈ (0, 1)`` — with linear interpolation inside the bin.

The sign rule is DeepSeek-V3's loss-free balancing (arXiv:2412.19437 §2.1.2):
``b_j += u · sign(mean_load − load_j)``.
"""

import torch
import torch.distributed as dist


def selection_margins(scores: torch.Tensor, top_values: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """``r_ij = τ_ij − s_ij``: how large ``b_j`` must be for expert j to be picked for token i.

    Args:
        scores: ``[N, E]`` unbiased sigmoid scores ``s``.
        top_values: ``[N, k+1]`` Top-(k+1) biased scores ``s + b`` in descending order.
        top_k_index: ``[N, k]`` the selected experts.

    Returns:
        ``[N, E]`` margins; ``τ`` is the (k+1)-th biased score for selected experts and the k-th for the
        rest (module docstring). Every value lies in ``(min(b) − 1, max(b) + 1)``.
    """
    k = top_k_index.shape[1]
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top_k_index, True)
    threshold = torch.where(selected, top_values[:, k : k + 1], top_values[:, k - 1 : k])
    return threshold - scores


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
