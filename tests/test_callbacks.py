"""The Trainer callback updates router biases once per optimizer step (gradient accumulation included)."""

import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from kdamoe import KDAMoEForCausalLM
from kdamoe.callbacks import RouterBiasUpdateCallback, find_kdamoe_model
from tests.helpers import tiny_config


class _CountingCallback(RouterBiasUpdateCallback):
    def __init__(self):
        super().__init__()
        self.loads = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.loads.append(find_kdamoe_model(model).expert_load().clone())
        return super().on_step_end(args, state, control, model=model, **kwargs)


def test_trainer_updates_biases_once_per_optimizer_step(tmp_path):
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config())
    ids = torch.randint(3, 97, (8, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        learning_rate=1e-3, report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
    )
    callback = _CountingCallback()
    biases_before = [r.e_score_correction_bias.clone() for r in model._routers()]
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert len(callback.loads) == 2
    # Each optimizer step saw 2 micro-batches x 2 rows x 16 tokens, each routed to top-2 experts.
    for load in callback.loads:
        assert torch.all(load.sum(-1) == 2 * 2 * 16 * 2)
    assert all(not torch.equal(a, r.e_score_correction_bias) for a, r in zip(biases_before, model._routers()))
    assert float(model.expert_load().sum()) == 0  # reset after the last update
