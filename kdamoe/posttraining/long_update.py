"""The memory-bounded GRPO update of long trajectories (issue #16; docs/post-training.md, "Long-horizon agentic RL").

TRL 1.16's ``GRPOTrainer`` already bounds the LM head: it installs ``trl.trainer.utils.add_fused_lm_head`` on the
policy and the reference model, whose ``trl.kernels.ChunkedLogProbFunction`` computes log-probs and entropies tile
by tile (4,096 tokens x 32,768 vocabulary columns) and recomputes each tile in its backward, so no ``[T, vocab]``
logits exist. Activation checkpointing per decoder layer bounds the training forward to each layer's input, and our
backbone runs the no-grad reference / old-policy passes in chunks of ``config.prefill_chunk_size`` tokens
(docs/long-context.md).

What TRL's path leaves quadratic is the padding. GRPO pads every row of a generation batch to the longest prompt
(on the left) and the longest completion (on the right); a forward with any padding builds the MLA layers' 4-D
mask through transformers' mask utilities, ``[B, 1, T, T]`` booleans for the training forward (1 TiB at
T = 2^20) and ``[B, 1, chunk, past + chunk]`` per prefill chunk. :class:`LongContextGRPOTrainer` scores each row on
its own with the padding cut off, so the model sees no mask and runs the causal kernels; the per-token results are
put back in TRL's padded layout, with zeros at padded positions as TRL's own pass gives them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from trl import GRPOTrainer


def real_token_span(attention_mask: torch.Tensor) -> tuple[int, int]:
    """``(start, end)`` of the one run of real tokens in a row's ``attention_mask`` (``[T]``, 1 = token, 0 = padding).

    Raises:
        ValueError: the row has no real token, or padding between real tokens (GRPO's rows are left-padded
            prompts followed by right-padded completions, so their real tokens form one run).
    """
    real = attention_mask.nonzero().flatten()
    if real.numel() == 0:
        raise ValueError("attention_mask: a row without any real token")
    start, end = int(real[0]), int(real[-1]) + 1
    if real.numel() != end - start:
        raise ValueError(f"attention_mask: padding between real tokens (positions {start}..{end - 1} hold "
                         f"{real.numel()} tokens); the long-context pass cuts padding off the ends of a row only")
    return start, end


class LongContextGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token pass scores each row without its padding (module docstring).

    Only ``_get_per_token_logps_and_entropies`` changes; the rollouts, rewards, loss and TRL's fused head are
    TRL's own. Used by the GRPO recipe with ``grpo.long_context: true``
    (:mod:`kdamoe.posttraining.recipes.grpo`).
    """

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's per-token pass, one unpadded row at a time.

        Args:
            input_ids, attention_mask: ``[B, T]`` (int64), prompts left-padded, completions right-padded.
            logits_to_keep: ``C``, the completion length (the last ``C`` positions are scored).
            batch_size: ignored (one row per forward).
            compute_entropy, compute_aux_loss: as in TRL.
        Returns:
            ``(log-probs [B, C] float32, entropies [B, C] float32 or None, aux loss or None)``; 0 at padded positions.
        Raises:
            ValueError: a multimodal input (the model is text-only), or a row whose real tokens are not one run
                (:func:`real_token_span`).
        """
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(f"{given[0]}: the long-context GRPO pass takes text rows only")
        prompt_len = input_ids.shape[1] - logits_to_keep
        all_logps, all_entropies, all_aux = [], [], []
        for row in range(input_ids.shape[0]):
            start, end = real_token_span(attention_mask[row])
            # completion positions [prompt_len, end) are real; keep one even for an empty completion (scored, then
            # zeroed by the mask) so the row stays part of the graph, as TRL's masked_scatter keeps it
            end = max(end, prompt_len + 1)
            keep = end - prompt_len
            ids = input_ids[row: row + 1, start:end]
            logps, entropy, aux = super()._get_per_token_logps_and_entropies(
                model, ids, torch.ones_like(ids), keep, compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss)
            real = attention_mask[row: row + 1, prompt_len:end].to(logps.dtype)
            all_logps.append(F.pad(logps * real, (0, logits_to_keep - keep)))
            if compute_entropy:
                all_entropies.append(F.pad(entropy * real, (0, logits_to_keep - keep)))
            if compute_aux_loss:
                all_aux.append(aux)
        logps = torch.cat(all_logps)
        entropies = torch.cat(all_entropies) if compute_entropy else None
        aux_loss = torch.stack(all_aux).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss
