"""Post-training under FSDP2 on CPU processes: ``torchrun --nproc_per_node 2 scripts/posttrain.py --config sft --set
trainer.fsdp=true`` (transformers' ``TrainingArguments.fsdp``, FSDP2 by default in transformers 5.24, one
``fully_shard`` unit per ``KDAMoEDecoderLayer`` from the model's ``_no_split_modules``) reproduces the one-process
run with the same global batch, and its ``final/`` holds the whole model.

On CPU accelerate 1.15 drops the Trainer's FSDP plugin and would wrap the model in DDP;
:func:`kdamoe.common.parallel.enable_fsdp2_on_cpu` makes the switch accelerate makes on GPUs. The runs are the
recorder of ``tests/test_posttrain_data_parallel.py`` (the documented command with this recorder standing in for
``scripts/posttrain.py``), each with a deadline, in the ``distributed`` xdist group.

Why not bitwise: as under DDP the two processes sum their tokens' losses and gradients separately (FSDP2
reduce-scatters the gradient shards: a mean over the ranks, and the Trainer's global token count makes each token
weigh the same); float32 sums in another order. The optimizer is SGD so that the weights differ by rounding only:
AdamW's first step moves every parameter by about ``lr * sign(gradient)``, so a gradient entry that is zero up to
rounding (cancelling terms) comes out as ±lr in either run. Tolerances: ``LOSS_RTOL = 1e-5`` and ``WEIGHT_ATOL =
1e-5`` (measured: see docs/distributed.md, "Post-training"), biases across ranks bitwise.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from kdamoe.common.parallel import enable_fsdp2_on_cpu
from kdamoe.posttraining import load_posttrain_config
from tests.helpers import launch_processes
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)

STEPS, GLOBAL_BATCH, DEADLINE_S = 5, 4, 180
LOSS_RTOL, WEIGHT_ATOL, BIAS_ATOL = 1e-5, 1e-5, 1e-6
RECORDER = Path(__file__).with_name("test_posttrain_data_parallel.py")


def _launch(base_dir: str, root: Path, processes: int, *extra: str) -> dict:
    out, dump = root / "out", root / "ranks"
    dump.mkdir(parents=True)
    overrides = [f"model={base_dir}", f"trainer.max_steps={STEPS}", "trainer.warmup_steps=0",
                 f"trainer.per_device_train_batch_size={GLOBAL_BATCH // processes}", "trainer.optim=sgd",
                 "trainer.learning_rate=0.5", "trainer.save_strategy='no'", "trainer.logging_steps=1",
                 f"data.num_tasks={STEPS * GLOBAL_BATCH}", "data.environment=arithmetic", "data.min_calls=1",
                 "data.max_calls=2", "data.max_operand=5", *extra]
    args = [str(RECORDER), str(dump), "--config", "sft", "--output-dir", str(out), "--no-resume"]
    launch_processes(args + [a for o in overrides for a in ("--set", o)], processes, DEADLINE_S)
    history = json.loads((out / "summary.json").read_text())["log_history"]
    return {"losses": [row["loss"] for row in history if "loss" in row],
            "ranks": [torch.load(dump / f"rank{rank}.pt") for rank in range(processes)],
            "weights": load_file(out / "final" / "model.safetensors")}


@pytest.mark.xdist_group("distributed")
def test_sft_under_fsdp2_on_two_processes_reproduces_one_process(base, tmp_path):  # noqa: F811 (the imported base fixture, which pytest passes by name)

    one = _launch(base, tmp_path / "one", 1)
    two = _launch(base, tmp_path / "two", 2, "trainer.fsdp=true")

    assert two["ranks"][0]["sharded"] == two["ranks"][1]["sharded"] == [True] * STEPS  # FSDP2, not DDP
    assert one["ranks"][0]["sharded"] == [False] * STEPS
    halves = [a + b for a, b in zip(two["ranks"][0]["episodes"], two["ranks"][1]["episodes"], strict=True)]
    assert halves == one["ranks"][0]["episodes"]  # the same episodes in the same order
    assert len(one["losses"]) == len(two["losses"]) == STEPS
    assert two["losses"] == pytest.approx(one["losses"], rel=LOSS_RTOL)

    biases = [rank["biases"] for rank in two["ranks"]]
    assert biases[0].shape[0] == STEPS and torch.equal(biases[0], biases[1])
    assert torch.count_nonzero(one["ranks"][0]["biases"][-1]) > 0
    torch.testing.assert_close(biases[0], one["ranks"][0]["biases"], rtol=0, atol=BIAS_ATOL)

    # final/ is the whole model (gathered from the shards), equal to the one-process model.
    start = load_file(Path(base) / "model.safetensors")
    assert two["weights"].keys() == one["weights"].keys() == start.keys()
    assert max((w - start[n]).abs().max().item() for n, w in one["weights"].items()) > 100 * WEIGHT_ATOL
    for name, expected in one["weights"].items():
        assert two["weights"][name].shape == expected.shape, name
        torch.testing.assert_close(two["weights"][name], expected, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_enable_fsdp2_is_a_no_op_without_fsdp():
    """Without ``trainer.fsdp`` the Trainer's accelerator is left as it is (the refusals of FSDP on one process,
    version 1 and under PEFT happen when the config loads: tests/test_posttrain.py)."""
    accelerator = SimpleNamespace(distributed_type="untouched")
    trainer = SimpleNamespace(args=SimpleNamespace(fsdp_plugin_args=None), accelerator=accelerator)
    enable_fsdp2_on_cpu(trainer)
    assert accelerator.distributed_type == "untouched" and not hasattr(trainer, "is_fsdp_enabled")


@pytest.mark.parametrize("recipe, overrides", [
    ("grpo", []),                                 # mode environment (key hunt), TRL's tool loop
    ("grpo", ["grpo.rollout=cached"]),            # mode environment, kdamoe's cached rollout
    ("grpo_tools", []),                           # mode tools, TRL's tool loop
    ("grpo_tools", ["grpo.rollout=cached"]),
    ("grpo_long", []),                            # cached rollout + the memory-bounded update
])
def test_multi_turn_grpo_under_fsdp2_is_refused_when_the_config_loads(monkeypatch, recipe, overrides):
    """Under FSDP2 every forward is a collective (an all-gather per layer). transformers keeps the ranks in step
    within one ``generate`` (``synced_gpus``: torch's ``fully_shard`` marks the modules it manages), but TRL's tool
    loop calls ``generate`` again only on the ranks whose completions hold a tool call, and the cached rollout
    plays each rank's episodes turn by turn: ranks whose episodes make different numbers of tool calls run
    different numbers of sharded forwards. Run on 2 gloo processes with one rank's first turn forced to a tool
    call and the other's to an answer, every such recipe aborted in the second ``generate`` ("Received data size
    doesn't match expected size. Is there a distributed collective mismatch"; NCCL would hang); under DDP the
    same runs finished (docs/post-training.md, "Several processes"). With ``grpo.rollout: batched`` the engines
    step in lockstep (tests/test_engine_lockstep.py), so the same recipe loads."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"config field grpo\.mode: .* with trainer\.fsdp and grpo\.rollout: "
                                         r"(trl|cached): .*grpo\.rollout: batched.*DDP"):
        load_posttrain_config(recipe, ["trainer.fsdp=true", *overrides])
    load_posttrain_config(recipe, overrides)  # the same recipe under DDP loads
    batched = load_posttrain_config(recipe, ["trainer.fsdp=true", *overrides, "grpo.rollout=batched"])
    assert batched.trainer["fsdp"] is True and batched.grpo.mode != "single_turn"


@pytest.mark.parametrize("overrides", [[], ["grpo.rollout=cached"], ["grpo.rollout=batched"]])
def test_single_turn_grpo_under_fsdp2_loads(monkeypatch, overrides):
    """Single-turn GRPO makes one ``generate`` call per batch (TRL's rollout) or per rollout (the cached one, the
    same number of rows on every rank), each kept in step by ``synced_gpus``, or steps lockstep engines
    (``batched``): it stays allowed."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_posttrain_config("grpo_single_turn", ["trainer.fsdp=true", *overrides])
    assert cfg.trainer["fsdp"] is True and cfg.grpo.mode == "single_turn"
