"""``grpo.rollout_slots`` larger than a generation batch: the batched rollout builds its engine with one slot per
episode of the batch, not the configured count (the engine allocates every slot's KDA state up front, so a
``rollout_slots`` of 100,000 held 100,000 states for a batch of four episodes), and plays the same episodes.
"""

import torch
from transformers import AutoTokenizer

import kdamoe.posttraining.rollout as rollout_module
from kdamoe import KDAMoEForCausalLM
from kdamoe.posttraining import load_posttrain_config
from kdamoe.posttraining.environments.arithmetic import ArithmeticTask
from kdamoe.posttraining.recipes import build_trainer
from tests.test_posttrain import base  # noqa: F401  (the tiny base folder fixture)
from tests.test_rollout import FAST, _play, _rows


def _trainer(base_dir, tmp_path, slots):
    cfg = load_posttrain_config("grpo", [f"model={base_dir}", f"output_dir={tmp_path / str(slots)}", *FAST,
                                         "grpo.rollout=batched", f"grpo.rollout_slots={slots}"])
    torch.manual_seed(0)
    model = KDAMoEForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return build_trainer(cfg, model, AutoTokenizer.from_pretrained(base_dir))


def test_engine_gets_no_more_slots_than_episodes(base, tmp_path, monkeypatch):  # noqa: F811 (the imported base fixture, which pytest passes by name)
    built = []
    engine_class = rollout_module.RolloutEngine

    def recording_engine(*args, **kwargs):
        engine = engine_class(*args, **kwargs)
        built.append(engine)
        return engine

    monkeypatch.setattr(rollout_module, "RolloutEngine", recording_engine)
    completions = {}
    for slots in (1000, 2):
        trainer = _trainer(base, tmp_path, slots)
        tasks = [ArithmeticTask.from_json(t) for t in trainer.train_dataset["task"]][:2]
        (_, completion_ids, *_), _ = _play(trainer, _rows(trainer, [tasks[0], tasks[0], tasks[1], tasks[1]]))
        completions[slots] = completion_ids
    assert [engine.num_slots for engine in built] == [4, 2]  # four episodes; 2 is fewer, so it stays
    # four episodes' slots plus the scratch slot of the static steps' padding rows
    assert built[0].recurrent and all(state.shape[0] == 4 + 1 for state in built[0].recurrent.values())
    assert completions[1000] == completions[2]
