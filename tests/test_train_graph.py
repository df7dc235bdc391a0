"""``kdamoe.training.train_graph.TrainStepGraph``: the captured training step gives the eager step's loss, gradients and
router counts, replays new data, captures again for a new shape, and refuses what it cannot run.

The argument checks run on the CPU; the graph itself needs CUDA (``KDAMOE_TEST_ON_GPU=1``), where it is compared with
the eager step of the same model (the unfused, uncaptured path: same kernels, launched one by one).
"""

import os

import pytest
import torch

from kdamoe import KDAMoEForCausalLM
from kdamoe.kernels.utils import relative_error
from kdamoe.model.modeling_kdamoe import KDAMoETopkRouter
from kdamoe.training.train_graph import TrainStepGraph
from tests.helpers import tiny_config

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()


def test_refuses_a_cpu_model_and_bad_warmup():
    model = KDAMoEForCausalLM(tiny_config())
    with pytest.raises(ValueError, match="CUDA device"):
        TrainStepGraph(model)
    for bad in (0, True, 1.0):  # True was taken for 1
        with pytest.raises(ValueError, match="warmup_steps"):
            TrainStepGraph(model, warmup_steps=bad)
    with pytest.raises(ValueError, match="no parameters"):  # was StopIteration
        TrainStepGraph(torch.nn.Module())


def _eager(model, ids):
    model.zero_grad(set_to_none=True)
    for r in model.modules():
        if isinstance(r, KDAMoETopkRouter):
            r.reset_statistics()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, model.expert_load().clone()


@pytest.mark.skipif(not ON_GPU, reason="needs KDAMOE_TEST_ON_GPU=1 and CUDA")
@pytest.mark.parametrize("attnres", [2, 0])
def test_graph_step_equals_eager_step(attnres):
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, kernel_backend="triton", attnres_num_blocks=attnres,
                                          moe_latent_size=16 if attnres else None)).cuda().train()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 97, (2, 64), generator=gen).cuda() for _ in range(2)]
    step = TrainStepGraph(model)
    for ids in batches:  # the second batch replays the graph on new data
        loss_e, grads_e, load_e = _eager(model, ids)
        for r in model.modules():
            if isinstance(r, KDAMoETopkRouter):
                r.reset_statistics()
        model.zero_grad(set_to_none=True)
        loss_g = step(ids)
        assert relative_error(loss_g, loss_e) < 1e-6
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == grads_e.keys()
        for name, g in grads_e.items():
            if g.abs().sum() > 0:
                assert relative_error(got[name], g) < 1e-5, name
        assert torch.equal(model.expert_load(), load_e)  # one step's counts: the warm-up's were taken out
    assert step.captures == 1
    step(batches[0][:, :32])  # a new shape captures again
    assert step.captures == 2
    with pytest.raises(ValueError, match="outside"):
        step(torch.full((2, 32), 500, device="cuda"))
    with pytest.raises(ValueError, match="labels"):
        step(batches[0], labels=batches[0][:, :10])
    model.eval()
    with pytest.raises(ValueError, match="train"):
        step(batches[0])


@pytest.mark.skipif(not ON_GPU, reason="needs KDAMOE_TEST_ON_GPU=1 and CUDA")
def test_graph_step_follows_model_changes():
    """A replaced module (new parameters in a new slot) and a parameter frozen after the capture make the next call
    capture again (before: the old graph kept training the old head and the frozen weight); gradient checkpointing is
    refused. Router statistics counted on the CPU follow the model to the GPU."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(kda_head_dim=16, kernel_backend="triton")).train()
    ids = torch.randint(3, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    model.config.kernel_backend = "torch"
    model(input_ids=ids, labels=ids).loss.backward()  # counts on the CPU
    model.config.kernel_backend = "triton"
    model.cuda()
    ids = ids.cuda()
    step = TrainStepGraph(model)
    step(ids)  # the router statistics move with the counts (before: a device-mismatch RuntimeError)
    assert step.captures == 1
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False).cuda()
    step(ids)
    assert step.captures == 2 and model.lm_head.weight.grad is not None
    model.model.embed_tokens.weight.requires_grad_(False)
    step(ids)
    assert step.captures == 3 and model.model.embed_tokens.weight.grad is None
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        step(ids)
