"""Post-training with FSDP2 + expert parallelism on CPU processes: ``torchrun --nproc_per_node 2 scripts/posttrain.py
--config sft --set "distributed_config={fsdp_size: 2, ep_size: 2}"``. The base is sharded while it loads, by
transformers' engine (``from_pretrained(distributed_config=DistributedConfig(...))``: each rank holds 4 of the tiny
model's 8 experts, tokens travel to them by all-to-all), and transformers' Trainer trains it unwrapped.

One launch of two processes (the ``distributed`` xdist group, with a deadline) runs four recipes one after the other
(``--then``: one start for all; the imports cost more than these runs): SFT under DDP, SFT under FSDP2 + EP, GRPO
(``single_turn``, ``beta=0.1``) under DDP, the same GRPO under FSDP2 + EP. DDP on two processes is the reference:
it reproduces one process (tests/test_posttrain_data_parallel.py) and gives every rank the same rows and, for
GRPO, the same seed. The runs are the recorder of ``tests/test_posttrain_data_parallel.py`` (episodes, rollouts,
router biases after every update, whether the parameters are DTensor shards); this file's ``__main__`` adds, at the
end of each run, every rank's eval logits of its (sharded) model on fixed ids and a greedy ``generate`` of ``2 + 2 *
rank`` new tokens: the ranks stop at different steps, so it only finishes if ``generate`` keeps them in step
(transformers sets ``synced_gpus`` for an FSDP-managed model).

What is compared, EP against DDP:

* SFT: the rows of every rank, losses (``summary.json``), router biases, the weights of ``final/``. The gradient
  reductions differ (DDP all-reduces whole gradients; FSDP2 reduce-scatters shards, and an expert's gradient is the
  sum of every rank's token contributions all-to-all'd to its one owner, divided by the data-parallel size 2), so
  float32 sums may be taken in another order. The optimizer is SGD, whose steps keep a rounding difference a
  rounding difference (AdamW's sign-like first step does not; tests/test_posttrain_data_parallel.py says why).
  Gradient clipping (``max_grad_norm=1``) is active: the gradient norms are about 2, and under EP the Trainer takes
  one norm per device mesh (dense and expert parameters live on different meshes).
* GRPO: TRL seeds each process differently, so a one-process run samples other completions, but rank r of both
  runs has the same seed and the same prompts, and samples from probabilities that agree to rounding: the same
  completions (``generate`` on the sharded model inside TRL's rollout), then rewards, advantages, losses, weights.
* ``final/`` (gathered from the shards, written by rank 0) is a Hub folder with our code that reloads with
  ``AutoModelForCausalLM(..., trust_remote_code=True)`` and gives the ranks' logits and greedy tokens.

Measured here (2 cores, gloo): SFT losses 5.7195015 5.5166941 5.3991671 5.2360396 5.0841541 under EP and under DDP
(bitwise equal; one process: 5.7195020 5.5166931 5.3991666 5.2360396 5.0841546, 1.7e-7 relative), final weights
within 1.2e-7 (they moved by 0.08); GRPO losses within 6e-9 (sizes 1e-3), weights within 2.7e-7; ``final/``'s logits
within 7.5e-8 of the ranks'; router biases bitwise equal across ranks and to DDP's. ``LOSS_RTOL = 1e-5`` (GRPO:
``GRPO_LOSS_ATOL = 1e-6``, its losses being differences of terms that cancel), ``WEIGHT_ATOL = LOGIT_ATOL = 1e-5``
leave a margin of more than 30x; a wrong reduction (a sum instead of a mean, a rank's tokens missing from an
expert) changes a step by as much as the step itself (the weights moved by 0.08).
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationMixin

from kdamoe.posttraining import load_posttrain_config, run_recipe
from tests.helpers import launch_processes
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)

STEPS, GLOBAL_BATCH, DEADLINE_S = 5, 4, 240
LOSS_RTOL, GRPO_LOSS_ATOL, WEIGHT_ATOL, LOGIT_ATOL, BIAS_ATOL = 1e-5, 1e-6, 1e-5, 1e-5, 1e-6
EP = "distributed_config={fsdp_size: 2, ep_size: 2}"
RECORDER = Path(__file__).with_name("test_posttrain_data_parallel.py")
COMMON = [f"trainer.max_steps={STEPS}", "trainer.warmup_steps=0", "trainer.optim=sgd", "trainer.learning_rate=0.5",
          "trainer.save_strategy='no'", "trainer.logging_steps=1", f"data.num_tasks={STEPS * GLOBAL_BATCH}",
          "data.environment=arithmetic", "data.min_calls=1", "data.max_operand=5"]
RECIPES = {"sft": ["--config", "sft", "--set", "data.max_calls=2"],
           "grpo": ["--config", "grpo_single_turn", "--set", "data.max_calls=1", "--set", "trainer.num_generations=2",
                    "--set", "trainer.max_completion_length=8", "--set", "trainer.beta=0.1"]}
IDS = torch.randint(10, 290, (2, 12), generator=torch.Generator().manual_seed(7))  # the base's vocabulary is 300


def _argv(base_dir: str, root: Path, name: str, recipe: str, processes: int, *extra: str) -> list[str]:
    dump = root / f"{name}_ranks"
    dump.mkdir(parents=True)
    overrides = [f"model={base_dir}", f"trainer.per_device_train_batch_size={GLOBAL_BATCH // processes}", *COMMON,
                 *extra]
    return [str(dump), "--output-dir", str(root / name), "--no-resume",
            *[a for o in overrides for a in ("--set", o)], *RECIPES[recipe]]


def _launch(base_dir: str, root: Path, processes: int, runs: dict[str, tuple]) -> dict:
    """``runs``: ``{name: (recipe, *overrides)}``, run one after the other in one launch of ``processes`` ranks."""
    argvs = [_argv(base_dir, root, name, recipe, processes, *extra) for name, (recipe, *extra) in runs.items()]
    launch_processes([str(Path(__file__))] + [a for argv in argvs for a in ("--then", *argv)][1:], processes,
                     DEADLINE_S)
    out = {}
    for name in runs:
        history = json.loads((root / name / "summary.json").read_text())["log_history"]
        out[name] = {"losses": [row["loss"] for row in history if "loss" in row],
                     "ranks": [torch.load(root / f"{name}_ranks" / f"rank{r}.pt") for r in range(processes)],
                     "model": [torch.load(root / f"{name}_ranks" / f"model{r}.pt") for r in range(processes)],
                     "rollouts": [torch.load(root / f"{name}_ranks" / f"rollouts{r}.pt") for r in range(processes)],
                     "weights": load_file(root / name / "final" / "model.safetensors"), "final": root / name / "final"}
    return out


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    root = tmp_path_factory.mktemp("ep")
    runs = {"sft_ddp": ("sft",), "sft_ep": ("sft", EP), "grpo_ddp": ("grpo",), "grpo_ep": ("grpo", EP)}
    return {**_launch(base, root, 2, runs), "base": base}


def _reloaded(final: Path, ranks: list[dict]) -> None:
    """``final/`` is a Hub folder with our code (not torch's FSDP files, FSDP2's generated class's home) and loads
    as a plain model that gives the ranks' eval logits and greedy tokens."""
    files = os.listdir(final)
    assert "model.safetensors" in files and "modeling_kdamoe.py" in files, files
    assert not any(name.startswith("_fsdp") for name in files), files
    auto_map = json.loads((final / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_kdamoe.KDAMoEForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(IDS, use_cache=False).logits
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["logits"], ranks[0]["logits"], rtol=0, atol=LOGIT_ATOL)
        torch.testing.assert_close(logits, got["logits"], rtol=0, atol=LOGIT_ATOL)
        new = 2 + 2 * rank
        expected = model.generate(IDS[rank:rank + 1], max_new_tokens=new, do_sample=False)
        assert expected.shape[1] == IDS.shape[1] + new and torch.equal(got["generated"], expected)


def _same_weights(got: dict, expected: dict, start: dict) -> None:
    assert got.keys() == expected.keys() == start.keys()
    weights = [n for n in start if not n.endswith("e_score_correction_bias")]  # the biases are compared on their own
    assert max((expected[n] - start[n]).abs().max().item() for n in weights) > 100 * WEIGHT_ATOL
    for name in weights:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def _sharded_with_equal_biases(ranks: list[dict]) -> torch.Tensor:
    assert ranks[0]["sharded"] == ranks[1]["sharded"] == [True] * STEPS  # DTensor shards, not DDP replicas
    biases = [rank["biases"] for rank in ranks]  # [STEPS, routers, experts] after every update
    assert biases[0].shape[0] == STEPS and torch.equal(biases[0], biases[1])
    return biases[0]


@pytest.mark.xdist_group("distributed")
def test_sft_under_fsdp2_with_expert_parallelism_reproduces_ddp(runs):
    ddp, ep = runs["sft_ddp"], runs["sft_ep"]
    assert ddp["ranks"][0]["sharded"] == [False] * STEPS
    for got, expected in zip(ep["ranks"], ddp["ranks"], strict=True):
        assert len(got["episodes"]) == STEPS and got["episodes"] == expected["episodes"]  # the same rows per rank
    assert len(ddp["losses"]) == len(ep["losses"]) == STEPS
    assert ep["losses"] == pytest.approx(ddp["losses"], rel=LOSS_RTOL)
    biases = _sharded_with_equal_biases(ep["ranks"])
    assert torch.count_nonzero(ddp["ranks"][0]["biases"][-1]) > 0
    torch.testing.assert_close(biases, ddp["ranks"][0]["biases"], rtol=0, atol=BIAS_ATOL)
    _same_weights(ep["weights"], ddp["weights"], load_file(Path(runs["base"]) / "model.safetensors"))
    _reloaded(ep["final"], ep["model"])


@pytest.mark.xdist_group("distributed")
def test_grpo_under_fsdp2_with_expert_parallelism_reproduces_ddp(runs):
    ddp, ep = runs["grpo_ddp"], runs["grpo_ep"]
    for got, expected in zip(ep["rollouts"], ddp["rollouts"], strict=True):  # per rank, per generate call
        # generate on the sharded model sampled what the replicas sampled
        assert len(got) == STEPS
        assert all(torch.equal(a["completions"], b["completions"]) for a, b in zip(got, expected, strict=True))
    assert len(ddp["losses"]) == len(ep["losses"]) == STEPS and len(set(ddp["losses"])) > 1
    assert ep["losses"] == pytest.approx(ddp["losses"], rel=LOSS_RTOL, abs=GRPO_LOSS_ATOL)
    biases = _sharded_with_equal_biases(ep["ranks"])
    torch.testing.assert_close(biases, ddp["ranks"][0]["biases"], rtol=0, atol=BIAS_ATOL)
    _same_weights(ep["weights"], ddp["weights"], load_file(Path(runs["base"]) / "model.safetensors"))
    _reloaded(ep["final"], ep["model"])


@pytest.mark.parametrize("world, overrides, needle", [
    (1, [EP], "distributed_config: needs at least 2 processes"),
    (2, [EP, "trainer.fsdp=true"], "trainer.fsdp: set together with distributed_config"),
    (2, [EP, 'peft={"r": 4}'], "peft: with distributed_config"),
    (2, [EP, "trainer.save_strategy=steps"], "trainer.save_strategy"),
    (4, [EP], "fsdp_size: 2 must be the number of processes, WORLD_SIZE=4"),
    (3, ["distributed_config={fsdp_size: 3, ep_size: 3}"], "ep_size: 3 does not divide the model's num_experts=8"),
    (2, ["distributed_config={fsdp_size: 2, ep_size: 4}"], "distributed_config.ep_size: 4 must divide fsdp_size"),
    (2, ["distributed_config={fsdp_size: 2.0, ep_size: 2}"], "fsdp_size: expected a positive integer, got 2.0"),
    (2, ["distributed_config={fsdp_size: 2, ep_size: true}"], "ep_size: expected a positive integer, got True"),
    (2, ["distributed_config={fsdp_size: two}"], "fsdp_size: expected a positive integer, got 'two'"),
    (2, ["distributed_config={fsdp_size: 2, fsdp_cpu_offload: 1}"], "fsdp_cpu_offload: expected true or false"),
    (2, ["distributed_config={fsdp_sise: 2}"], "distributed_config.fsdp_sise: .*did you mean fsdp_size"),
    (2, ["distributed_config={fsdp_size: 1, tp_size: 2}"], "no tensor- or pipeline-parallel plan"),
    (2, ["distributed_config={fsdp_size: 1, dp_replicate_size: 2}"], "dp_replicate_size: 2: HSDP"),
    (2, [EP, "recipe=dpo"], "'dpo' with distributed_config"),
    (2, [EP, "recipe=grpo", "grpo.mode=environment"], "grpo.mode: 'environment' with distributed_config"),
    (2, [EP, "recipe=grpo", "grpo.mode=single_turn", "grpo.rollout=cached", "data.environment=arithmetic"],
     "grpo.rollout: cached with distributed_config"),
])
def test_distributed_config_is_refused_when_it_cannot_run(base, monkeypatch, world, overrides, needle):  # noqa: F811 (the imported base fixture, which pytest passes by name)

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ValueError, match=needle):
        load_posttrain_config("sft", [f"model={base}", *overrides])


def test_a_checkpoint_to_resume_is_refused_before_the_base_loads(base, monkeypatch, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)

    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    cfg = load_posttrain_config("sft", [f"model={base}", f"output_dir={tmp_path}", EP])
    with pytest.raises(ValueError, match=r"holds checkpoint-\* folders.*cannot resume"):
        run_recipe(cfg)  # a sharded load would wait for a second process: this must fail before it


def _record_model(run_recipe_model):
    """Wrap ``kdamoe.posttraining.run.trained_model``: first, on every rank, save the (sharded) trained model's eval
    logits on :data:`IDS` and its greedy continuation of row ``rank`` by ``2 + 2 * rank`` tokens (module docstring)
    to ``<output_dir>_ranks/model<RANK>.pt``."""
    def recording(cfg, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        rank = int(os.environ.get("RANK", "0"))
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(IDS, use_cache=False).logits
            # transformers' own generate: the recorder's stand-in records TRL's rollouts only
            generated = GenerationMixin.generate(model, IDS[rank:rank + 1], max_new_tokens=2 + 2 * rank,
                                                 do_sample=False)
        model.train(was_training)
        out = Path(cfg.output_dir)
        torch.save({"logits": logits, "generated": generated}, out.with_name(out.name + "_ranks") / f"model{rank}.pt")
        return run_recipe_model(cfg, trainer)

    return recording


if __name__ == "__main__":
    sys.path.insert(0, str(RECORDER.parent.parent))
    from kdamoe.posttraining import run
    from tests.test_posttrain_data_parallel import _posttrain_recording, _split_runs

    run.trained_model = _record_model(run.trained_model)
    sys.exit(_posttrain_recording(_split_runs(sys.argv[1:])))
