"""Expert-load monitoring: imbalance ratio, warning, TensorBoard records and the heat map."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kdamoe.training.monitoring import TrainingMonitor, load_imbalance, plot_expert_load


def test_load_imbalance():
    load = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert load_imbalance(load).tolist() == [1.0, 4.0, 0.0]


def test_monitor_warns_records_and_draws(tmp_path):
    mon = TrainingMonitor(tmp_path / "tb", threshold=2.0, histogram_every=1)
    mon.start_stage("s", total_steps=2, done_steps=0)
    even, skewed = torch.ones(2, 4), torch.tensor([[1.0, 1.0, 1.0, 1.0], [10.0, 0.0, 0.0, 0.0]])
    mon.log_step(1, {"loss": 3.0, "lr": 1e-3}, write=True)
    mon.log_expert_load(1, even, write=True)
    mon.log_step(2, {"loss": 2.5, "lr": 1e-3}, write=True)
    with pytest.warns(RuntimeWarning, match="layer 1 expert load max/mean = 4.00"):
        mon.log_expert_load(2, skewed, write=True)
    assert torch.equal(mon.state_dict()["total_load"], even + skewed)
    png = mon.close(tmp_path / "load.png")
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"

    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    scalars, hists = acc.Tags()["scalars"], acc.Tags()["histograms"]
    assert {"train/loss", "train/lr", "expert_load/max_over_mean/layer1"} <= set(scalars)
    assert "expert_load/tokens_per_expert/layer0" in hists
    assert [e.value for e in acc.Scalars("expert_load/max_over_mean/layer1")] == [1.0, 4.0]


def test_disabled_monitor_writes_nothing(tmp_path):
    mon = TrainingMonitor(tmp_path / "tb", enabled=False)
    mon.start_stage("s", 1, 0)
    mon.log_step(1, {"loss": 1.0, "lr": 1.0}, write=True)
    mon.log_expert_load(1, torch.ones(1, 2), write=True)
    assert mon.close(tmp_path / "x.png") is None and not (tmp_path / "tb").exists()


def test_plot_expert_load(tmp_path):
    path = plot_expert_load(torch.rand(3, 8), tmp_path / "sub" / "heat.png")
    assert path.stat().st_size > 1000
