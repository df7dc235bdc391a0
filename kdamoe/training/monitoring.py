"""Training monitoring: progress bar, TensorBoard scalars and histograms, expert-load warnings and heat map."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def load_imbalance(load: torch.Tensor) -> torch.Tensor:
    """Max over mean tokens per expert, per layer: ``load [L, E]`` → ``[L]`` (1.0 = perfectly even; 0 if no tokens)."""
    load = load.float()
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.max(dim=-1).values / mean.clamp_min(1e-12), torch.zeros_like(mean))


def plot_expert_load(load: torch.Tensor, path: str | Path, title: str = "Expert load") -> Path:
    """Save a heat map of ``load [L, E]`` (tokens per expert per MoE layer), each layer divided by its mean.

    Draws on a bare ``matplotlib.figure.Figure`` (Agg canvas, no display; pyplot's global backend is left
    alone). Returns the written path.
    """
    load = load.float()
    rel = (load / load.mean(dim=-1, keepdim=True).clamp_min(1e-12)).numpy()
    fig = Figure(figsize=(max(4.0, 0.35 * rel.shape[1] + 2), max(2.0, 0.45 * rel.shape[0] + 1.2)))
    ax = fig.subplots()
    im = ax.imshow(rel, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(rel.shape[0]))
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="tokens / layer mean")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


class TrainingMonitor:
    """Everything the loop reports goes through here; only the main process writes.

    Args:
        log_dir: TensorBoard folder.
        threshold: warn when a layer's max/mean expert load passes it.
        histogram_every: optimizer steps between expert-load histograms.
        enabled: False on non-main processes (then every call is a no-op).
    """

    def __init__(self, log_dir: str | Path, threshold: float = 4.0, histogram_every: int = 25, enabled: bool = True):
        self.enabled, self.threshold, self.histogram_every = enabled, threshold, histogram_every
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (tensorboard is absent from the PPO venv, requirements-ppo.txt, whose recipe imports kdamoe.training)

            self.writer = SummaryWriter(str(log_dir))
        self.total_load: torch.Tensor | None = None
        self.bar = None
        self.warned: set[tuple[str, int]] = set()

    def start_stage(self, name: str, total_steps: int, done_steps: int) -> None:
        """Open a progress bar for a stage of ``total_steps`` optimizer steps, ``done_steps`` already done."""
        if self.enabled:
            self.close_bar()
            self.bar = tqdm(total=total_steps, initial=done_steps, desc=f"stage {name}", dynamic_ncols=True)
        self.stage = name

    def log_step(self, step: int, scalars: dict[str, float], write: bool) -> None:
        """Advance the bar by one step; write ``scalars`` under ``train/`` at global ``step`` when ``write``."""
        if not self.enabled:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{scalars['loss']:.3f}", lr=f"{scalars['lr']:.2e}", refresh=False)
        if write:
            for k, v in scalars.items():
                self.writer.add_scalar(f"train/{k}", v, step)

    def log_expert_load(self, step: int, load: torch.Tensor, write: bool) -> None:
        """Record ``load [L, E]`` (tokens routed in one optimizer step): accumulate for the heat map,
        write max/mean scalars when ``write``, histograms every ``histogram_every`` steps, and warn
        once per stage and layer when max/mean passes the threshold."""
        if load is None or load.numel() == 0:
            return
        load = load.detach().float().cpu()
        self.total_load = load.clone() if self.total_load is None else self.total_load + load
        if not self.enabled:
            return
        imbalance = load_imbalance(load)
        for layer, ratio in enumerate(imbalance.tolist()):
            if write:
                self.writer.add_scalar(f"expert_load/max_over_mean/layer{layer}", ratio, step)
            if step % self.histogram_every == 0:
                self.writer.add_histogram(f"expert_load/tokens_per_expert/layer{layer}", load[layer], step)
            if ratio > self.threshold and (self.stage, layer) not in self.warned:
                self.warned.add((self.stage, layer))
                msg = (f"step {step}: MoE layer {layer} expert load max/mean = {ratio:.2f} > "
                       f"{self.threshold} (tokens per expert: {load[layer].int().tolist()})")
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                logger.warning(msg)

    def state_dict(self) -> dict:
        """Checkpointed state: the expert load summed so far (for the heat map of a resumed run)."""
        return {"total_load": self.total_load}

    def load_state_dict(self, state: dict) -> None:
        self.total_load = state["total_load"]

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self, heatmap_path: str | Path | None = None) -> Path | None:
        """Close the bar and writer; draw the heat map of all recorded load if a path is given. Returns it."""
        if not self.enabled:
            return None
        self.close_bar()
        self.writer.close()
        if heatmap_path is not None and self.total_load is not None:
            return plot_expert_load(self.total_load, heatmap_path, "Expert load over training (tokens / layer mean)")
        return None
