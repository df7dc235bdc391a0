"""transformers' own distributed engine on 2 and 4 CPU processes (gloo): ``KDAMoEForCausalLM.from_pretrained(folder,
distributed_config=DistributedConfig(fsdp_size=N))`` (FSDP2) and ``DistributedConfig(fsdp_size=N, ep_size=N)`` (FSDP2
with expert parallelism: each rank holds 8/N of the tiny model's 8 experts whole, 4 at N=2 and 2 at N=4, and the
routed tokens travel by ``all_to_all_single``) reproduce one process that runs the N ranks' batches as one batch
(docs/distributed.md). Every combination runs on CPU/gloo with transformers 5.24; at ``ep_size == fsdp_size`` the
experts' own FSDP mesh ``efsdp`` has size 1 at both N, so N=4 exercises the same EP layout over a wider all-to-all.

Per world size N, both modes run in one ``torchrun --nproc_per_node N`` run of this file (``__main__`` below:
``python tests/test_distributed_engine.py FOLDER OUT``, with a timeout on ``init_process_group`` and a deadline on
the run, so a dead rank fails the test instead of hanging the suite; the ``distributed`` xdist group keeps the
multi-process tests from oversubscribing the two cores), and one fresh process reloads both modes' saved folders.
Every rank loads the same saved tiny model, runs forward, loss and backward on its own ``[2, 16]`` batch, one SGD
step, one router-bias update and an eval forward, then saves the sharded model with ``save_pretrained``. The
reference is the same folder loaded plainly in the test process, on the N batches concatenated (``[2N, 16]``).

Loss averaging: every row has the same number of targets (no padding), so the one-process token mean equals the
mean of the ranks' token means, and FSDP2's gradient reduction (a mean over the ranks; for the experts under EP,
a sum of all ranks' token contributions divided by the data-parallel size N) gives the gradient of that mean.

Why not bitwise: the reference multiplies 2N-row activations where each rank multiplies 2 rows, and the gradients
are summed in another order (FSDP2 adds the ranks' partial gradients); float32 rounding differs. Measured
(largest difference, both modes): at N=2, 6e-8 on the training logits and the gradients (largest gradient 0.27),
5e-7 on the loss (~1e-7 relative), 8e-7 on the logits after the SGD step (the stepped weights differ by rounding);
at N=4, 9e-8 on the training logits, 4e-8 on the gradients (largest 0.21), 0 on the loss, 6.5e-7 on the logits
after the step. EP against FSDP2 alone: bitwise equal training logits at N=2 (6e-8 after the step); at N=4, 9e-8
on the training logits and 5e-7 after the step (under EP an expert multiplies the rows gathered from all ranks in
one product, under FSDP2 each rank's own rows: products of other shapes, which may round otherwise). The reloaded
folders give the ranks' eval logits within 8e-8. ``RTOL = ATOL = 1e-5`` leaves a margin of more than 10x at both
sizes, while a wrong reduction (a sum instead of a mean multiplies a gradient by N; a rank's tokens missing from an
expert) is off by O(1).
The Quantile Balancing statistics are float64 counts summed by one all-reduce, so the ranks' biases agree bitwise;
they equal the reference's (bitwise at both sizes here) unless a margin lies within rounding of a bin edge (bins
~2e-3 wide), hence ``BIAS_ATOL = 1e-6``. Under EP each rank routes its own tokens over all experts (the router is
replicated), so the sum over ranks counts every token once, as with FSDP2 alone.
"""

import datetime
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers.distributed import DistributedConfig

from kdamoe import KDAMoEForCausalLM
from tests.helpers import launch_processes, tiny_config

WORLDS, DEADLINE_S, LR = (2, 4), 120, 0.5
RTOL = ATOL = 1e-5
BIAS_ATOL = 1e-6
MODES = ("fsdp", "fsdp_ep")
CODE_FILES = ("configuration_kdamoe.py", "modeling_kdamoe.py", "moe_torch.py", "quantile_balancing.py")


def _sizes(mode: str, world: int) -> dict:
    """``DistributedConfig`` arguments of ``mode`` on ``world`` ranks: FSDP2 over all of them, with EP over all."""
    return {"fsdp_size": world} if mode == "fsdp" else {"fsdp_size": world, "ep_size": world}


def _batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[2, 16]`` token ids (the reference runs ``cat([_batch(0), ..., _batch(world - 1)])``)."""
    return torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(100 + rank))


def _step(model, ids: torch.Tensor, full_tensor) -> dict:
    """Forward + loss + backward on ``ids``, gradients, one SGD step, one bias update, eval logits."""
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {name: full_tensor(p.grad) for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.update_router_biases()
    model.eval()
    with torch.no_grad():
        eval_logits = model(ids, use_cache=False).logits
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads, "eval_logits": eval_logits,
            "biases": torch.stack([router.e_score_correction_bias.clone() for router in model._routers()])}


def _rank_main(folder: str, out: str) -> None:
    """One rank of the torchrun run: each mode in turn, its results and saved folder under ``out/MODE``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in MODES:
        config = DistributedConfig(**_sizes(mode, world))
        model = KDAMoEForCausalLM.from_pretrained(folder, distributed_config=config).train()
        experts = model.get_submodule("model.layers.1.mlp.experts")
        result = _step(model, _batch(rank), lambda tensor: tensor.full_tensor())
        # EP sets the experts' count to the local one and lays their weights out on the expert mesh ("efsdp", "ep")
        result["experts"] = (experts.num_experts, experts.gate_up_proj.device_mesh.mesh_dim_names)
        model.save_pretrained(os.path.join(out, mode, "saved"))
        torch.save(result, os.path.join(out, mode, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda world: f"world{world}")
def runs(request, tmp_path_factory):
    """Both modes' per-rank results on ``world`` ranks and the one-process reference on the ``world`` batches."""
    world = request.param
    root = tmp_path_factory.mktemp(f"engine{world}")
    torch.manual_seed(0)
    KDAMoEForCausalLM(tiny_config(num_experts=8, num_experts_per_tok=2)).save_pretrained(root / "model")
    for mode in MODES:
        (root / mode).mkdir()
    launch_processes([str(Path(__file__)), str(root / "model"), str(root)], world, DEADLINE_S)
    results = {mode: [torch.load(root / mode / f"rank{rank}.pt") for rank in range(world)] for mode in MODES}
    ids = torch.cat([_batch(rank) for rank in range(world)])
    reference_model = KDAMoEForCausalLM.from_pretrained(root / "model").train()
    reference = _step(reference_model, ids, lambda tensor: tensor)
    return {"world": world, "root": root, "ids": ids, "reference": reference, **results}


RELOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path = [p for p in sys.path if p not in ("", ".", {repo!r})]
    sys.modules["kdamoe"] = None  # block the package even where it is pip-installed (editable or not)
    from transformers import AutoModelForCausalLM
    for mode in {modes!r}:
        model = AutoModelForCausalLM.from_pretrained(f"{root}/{{mode}}/saved", trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            logits = model(torch.load("{root}/ids.pt"), use_cache=False).logits
        biases = torch.stack([m.e_score_correction_bias for n, m in model.named_modules() if n.endswith("mlp.gate")])
        torch.save({{"logits": logits, "biases": biases}}, f"{root}/{{mode}}/reloaded.pt")
    """
)


@pytest.fixture(scope="module")
def reloaded(runs):
    """Each mode's saved folder loaded by ``AutoModelForCausalLM(trust_remote_code=True)`` in one fresh process where
    kdamoe cannot be imported: ``(subprocess result, {mode: {"logits": [2 * world, 16, V] on ids, "biases":
    [routers, E]}})`` (the dict is empty when the process failed)."""
    root = runs["root"]
    torch.save(runs["ids"], root / "ids.pt")
    script = RELOAD_SCRIPT.format(repo=str(Path(__file__).resolve().parent.parent), modes=tuple(MODES), root=root)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(root / "modules")
    result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                            timeout=DEADLINE_S)
    if result.returncode != 0:
        return result, {}
    return result, {mode: torch.load(root / mode / "reloaded.pt") for mode in MODES}


def _per_rank(tensor: torch.Tensor, world: int) -> list[torch.Tensor]:
    """The reference's rows of each rank: ``world`` equal chunks of the batch dimension."""
    return list(tensor.chunk(world))


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradients_equal_one_process_on_the_concatenated_batch(runs, mode):
    ranks, reference = runs[mode], runs["reference"]
    mean_loss = torch.stack([rank["loss"] for rank in ranks]).mean()
    torch.testing.assert_close(mean_loss, reference["loss"], rtol=RTOL, atol=ATOL)
    for rank, expected in zip(ranks, _per_rank(reference["logits"], runs["world"]), strict=True):
        torch.testing.assert_close(rank["logits"], expected, rtol=RTOL, atol=ATOL)
    assert ranks[0]["grads"].keys() == reference["grads"].keys()
    for name, expected in reference["grads"].items():
        assert torch.count_nonzero(expected) > 0 or name.endswith(("attn_res.query", "key_norm.weight")), name
        for rank in ranks:  # the reduced gradient, gathered whole on every rank
            torch.testing.assert_close(rank["grads"][name], expected, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.xdist_group("distributed")
def test_expert_parallel_shards_the_experts_and_matches_the_unsharded_experts(runs):
    world = runs["world"]
    assert [rank["experts"] for rank in runs["fsdp_ep"]] == [(8 // world, ("efsdp", "ep"))] * world  # 8 / world each
    assert [rank["experts"] for rank in runs["fsdp"]] == [(8, ("fsdp",))] * world  # all 8, gathered for compute
    for ep, fsdp in zip(runs["fsdp_ep"], runs["fsdp"], strict=True):
        torch.testing.assert_close(ep["logits"], fsdp["logits"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ep["eval_logits"], fsdp["eval_logits"], rtol=RTOL, atol=ATOL)


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("mode", MODES)
def test_router_biases_agree_across_ranks_and_with_one_process(runs, mode):
    ranks, reference = runs[mode], runs["reference"]["biases"]
    assert torch.count_nonzero(reference) > 0  # the biases did move
    assert all(torch.equal(rank["biases"], ranks[0]["biases"]) for rank in ranks[1:])
    torch.testing.assert_close(ranks[0]["biases"], reference, rtol=0, atol=BIAS_ATOL)


@pytest.mark.xdist_group("distributed")
@pytest.mark.parametrize("mode", MODES)
def test_sharded_save_reloads_without_the_package_with_the_same_logits(runs, reloaded, mode):
    files = os.listdir(runs["root"] / mode / "saved")
    assert "model.safetensors" in files and all(code in files for code in CODE_FILES), files
    assert not any(name.startswith("_fsdp") for name in files), files  # torch's FSDP2 files are not our code
    result, outputs = reloaded
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded, ranks = outputs[mode], runs[mode]
    # The folder holds the stepped weights and the updated biases: the ranks' eval logits after the step.
    for rank, got in zip(ranks, _per_rank(reloaded["logits"], runs["world"]), strict=True):
        torch.testing.assert_close(got, rank["eval_logits"], rtol=RTOL, atol=ATOL)
    assert torch.equal(reloaded["biases"], ranks[0]["biases"])


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
