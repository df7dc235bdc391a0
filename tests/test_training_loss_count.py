"""The pretraining loss under FSDP2's bf16 mixed precision is the token mean over the global micro-batch, to float32
rounding: the target count given to the model (``num_items_in_batch``) must not pass through bf16.

FSDP2's root pre-forward casts every floating-point forward argument to ``param_dtype``
(``MixedPrecisionPolicy.cast_forward_inputs``). The trainer once passed the count as the float ``G / N`` (global
targets / processes): 507 became 508 in bf16, and the loss and every gradient were off by 2e-3 (up to 0.2 % at 16K
targets, differently every step). :func:`kdamoe.training.trainer.micro_batch_loss` now passes the integer ``G`` and
multiplies by ``N`` itself. The CPU multi-process tests could not see it: they train in float32 with counts under
256 (exact in bf16).

Here: one process in a gloo group of one, in the test process (a file store: no port; no subprocess; one thread, so
not in the ``distributed`` xdist group), the tiny model sharded with ``fully_shard`` as accelerate's FSDP2 plugin does
(every decoder layer, then the root) under ``MixedPrecisionPolicy(param_dtype=bfloat16)``, and a batch of 507
targets; ``N = 2`` is a stand-in accelerator whose other process holds the same rows (its ``reduce`` doubles the
count), which checks the factor ``N`` and that the aux loss is not scaled by it.
"""

import datetime
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kdamoe import KDAMoEForCausalLM
from kdamoe.model.modeling_kdamoe import KDAMoEDecoderLayer
from kdamoe.training.trainer import micro_batch_loss
from tests.helpers import tiny_config

TARGETS, AUX_COEF, RTOL = 507, 0.01, 1e-5  # 507 is not a bf16 number (-> 508: 2e-3 relative)


class _SameRowsOnEveryProcess:
    """The ``Accelerator`` surface :func:`micro_batch_loss` uses, for ``n`` processes that all hold this one's rows."""

    def __init__(self, n: int):
        self.num_processes = n

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        return tensor * self.num_processes

    def autocast(self):
        return nullcontext()


def test_fsdp2_bf16_loss_is_the_token_mean_of_a_count_bf16_cannot_hold(tmp_path):

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = KDAMoEForCausalLM(tiny_config()).train()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for module in model.modules():
            if isinstance(module, KDAMoEDecoderLayer):
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        outputs = []
        model.register_forward_hook(lambda module, args, output: outputs.append(output))

        input_ids = torch.randint(3, 97, (4, 128), generator=torch.Generator().manual_seed(0))
        labels = input_ids.clone()
        labels[0, 5] = -100  # 4 · 127 shifted targets, one masked
        assert (labels[:, 1:] != -100).sum() == TARGETS
        batch = {"input_ids": input_ids, "labels": labels}

        for processes, aux in [(1, False), (2, False), (2, True)]:
            model.config.output_router_logits, model.config.router_aux_loss_coef = aux, AUX_COEF if aux else 0.0
            outputs.clear()
            loss = micro_batch_loss(_SameRowsOnEveryProcess(processes), model, batch, model.config.router_aux_loss_coef)
            (output,) = outputs
            assert output.logits.dtype == torch.bfloat16  # the forward did run in bf16
            logits = output.logits.double()[:, :-1].reshape(-1, model.config.vocab_size)
            expected = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum") / TARGETS
            if aux:
                assert output.aux_loss is not None
                expected = expected + AUX_COEF * output.aux_loss.double()
            assert loss.dtype == torch.float32
            rel = abs(loss.item() - expected.item()) / expected.item()
            assert rel < RTOL, f"{processes} processes, aux {aux}: loss {loss.item()} vs {expected.item()} ({rel:.1e})"
            loss.backward()  # the backward runs through FSDP2 as in training
    finally:
        dist.destroy_process_group()
