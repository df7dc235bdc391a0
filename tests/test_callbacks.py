"""The Trainer callback updates router biases once per optimizer step (gradient accumulation included)."""

import logging

import pytest
import torch
from datasets import Dataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from kdamoe import KDAMoEForCausalLM
from kdamoe.callbacks import RouterBiasUpdateCallback, add_router_bias_callback, find_kdamoe_model, find_kdamoe_models
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
    assert all(not torch.equal(a, r.e_score_correction_bias)
               for a, r in zip(biases_before, model._routers(), strict=True))
    assert float(model.expert_load().sum()) == 0  # reset after the last update


def _loads_and_biases(model):
    return model.expert_load().clone(), [r.e_score_correction_bias.clone() for r in model._routers()]


class _TwoPlusReference(torch.nn.Module):
    """A trainer's ``model`` holding several KDAMoE models, like TRL's policy + value wrapper plus a reference."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.policy = KDAMoEForCausalLM(tiny_config())
        self.value_model = KDAMoEForCausalLM(tiny_config())
        self.ref = KDAMoEForCausalLM(tiny_config())
        self.ref.requires_grad_(False)
        self.alias = self.policy  # the same module reached twice is one model


def test_callback_balances_every_trainable_model_and_never_a_frozen_one():
    wrapper = _TwoPlusReference()
    assert [p for p, _ in find_kdamoe_models(wrapper)] == ["policy", "value_model", "ref"]
    assert [p for p, _ in find_kdamoe_models(wrapper.policy)] == [""]  # the inner KDAMoEModel is not listed
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    wrapper.train()
    for m in (wrapper.policy, wrapper.value_model, wrapper.ref):  # grad enabled: every router counts tokens
        m(ids, use_cache=False)
    before = {name: _loads_and_biases(getattr(wrapper, name)) for name in ("policy", "value_model", "ref")}
    assert all(float(load.sum()) > 0 for load, _ in before.values())

    callback = RouterBiasUpdateCallback(warn_threshold=100.0)
    logs = {"loss": 1.0}
    state = TrainerState()
    state.log_history.append({**logs, "step": 0})
    callback.on_step_end(None, state, TrainerControl(), model=wrapper)
    callback.on_log(None, state, TrainerControl(), logs=logs, model=wrapper)
    for name in ("policy", "value_model"):
        model = getattr(wrapper, name)
        assert all(not torch.equal(b, r.e_score_correction_bias)
                   for b, r in zip(before[name][1], model._routers(), strict=True)), name
    assert all(torch.equal(b, r.e_score_correction_bias)
               for b, r in zip(before["ref"][1], wrapper.ref._routers(), strict=True))
    for name in ("policy", "value_model", "ref"):  # statistics reset everywhere
        assert float(getattr(wrapper, name).expert_load().sum()) == 0, name
    # one reading per model, the first one unprefixed
    for prefix, name in (("expert_load", "policy"), ("expert_load/value_model", "value_model"),
                         ("expert_load/ref", "ref")):
        load = before[name][0]
        assert logs[f"{prefix}/max_over_mean"] == pytest.approx(float((load.max(-1).values / load.mean(-1)).max()))
    assert state.log_history[-1] == {**logs, "step": 0}


@pytest.mark.parametrize("attach", ["add_router_bias_callback", "callbacks_argument"])
def test_expert_load_metrics_reach_log_history_and_report_to(tmp_path, monkeypatch, attach):
    tb_dir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tb_dir))
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config())
    ids = torch.randint(3, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
        report_to=["tensorboard"], logging_steps=1, save_strategy="no", use_cpu=True, seed=0,
    )
    if attach == "add_router_bias_callback":
        trainer = Trainer(model=model, args=args, train_dataset=data)
        callback = add_router_bias_callback(trainer, RouterBiasUpdateCallback(warn_threshold=100.0))
        assert trainer.callback_handler.callbacks[0] is callback
    else:
        callback = RouterBiasUpdateCallback(warn_threshold=100.0)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()

    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row, imbalance in zip(rows, callback.history, strict=True):
        assert row["expert_load/max_over_mean"] == max(imbalance)
        assert [row[f"expert_load/max_over_mean/layer_{1 + i}"] for i in range(3)] == imbalance  # first_k_dense=1
    if attach == "add_router_bias_callback":  # the reporter ran after us, so it saw them
        acc = EventAccumulator(str(tb_dir)).Reload()
        assert "train/loss" in acc.Tags()["scalars"]
        values = [e.value for e in acc.Scalars("train/expert_load/max_over_mean")]
        assert values == pytest.approx([max(h) for h in callback.history])


def test_a_backbone_a_wrapper_lists_again_is_not_a_second_model():
    # TRL 1.12's PPO wrapper holds the value model and, as `critic_backbone`, that model's backbone.
    wrapper = torch.nn.Module()
    wrapper.policy = KDAMoEForCausalLM(tiny_config())
    wrapper.value_model = KDAMoEForCausalLM(tiny_config())
    wrapper.critic_backbone = wrapper.value_model.model
    assert [p for p, _ in find_kdamoe_models(wrapper)] == ["policy", "value_model"]


def test_metrics_reach_a_log_history_row_that_holds_a_nan():
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config())
    model.train()
    model(torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(2)), use_cache=False)
    callback = RouterBiasUpdateCallback(warn_threshold=100.0)
    logs = {"loss": 1.0, "val/ratio_var": float("nan")}  # e.g. a variance over one value
    state = TrainerState()
    state.log_history.append({**logs, "step": 0})
    callback.on_step_end(None, state, TrainerControl(), model=model)
    callback.on_log(None, state, TrainerControl(), logs=logs, model=model)
    assert state.log_history[-1]["expert_load/max_over_mean"] == logs["expert_load/max_over_mean"]


@pytest.mark.parametrize("with_callback", [False, True])
def test_a_trainer_without_the_callback_is_warned_once(tmp_path, caplog, with_callback):
    """A plain transformers.Trainer (as a TRL script without add_router_bias_callback) trained with frozen biases and
    no expert-load metrics, silently; now the model warns once, saying how to add the callback."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config())
    ids = torch.randint(3, 97, (8, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    if with_callback:
        add_router_bias_callback(trainer)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "router biases are not being updated" in r.getMessage()]
    if with_callback:
        assert warned == []
    else:
        assert len(warned) == 1 and "kdamoe.callbacks.add_router_bias_callback(trainer)" in warned[0]


def test_callback_says_when_the_models_own_rule_is_none(caplog):
    """``router_biases: update`` on a model whose ``router_bias_update`` is "none" (a converted Kimi Linear release)
    moves nothing; the run says so once instead of staying silent."""
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config(router_bias_update="none")).train()
    ids = torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    callback = RouterBiasUpdateCallback(warn_threshold=100.0)
    with caplog.at_level("WARNING", logger="kdamoe.callbacks"):
        for _ in range(2):
            model(ids, use_cache=False)
            before = [r.e_score_correction_bias.clone() for r in model._routers()]
            callback.on_step_end(None, TrainerState(), TrainerControl(), model=model)
            assert all(torch.equal(b, r.e_score_correction_bias) for b, r in zip(before, model._routers(), strict=True))
    said = [r.getMessage() for r in caplog.records if "router_bias_update='none'" in r.getMessage()]
    assert len(said) == 1
