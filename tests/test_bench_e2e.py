"""Smoke test of ``benchmarks/bench_e2e.py --tiny`` on the CPU (issue #14's end-to-end training benchmark).

The script's ``main`` runs in the test's process (a subprocess would import torch and transformers again, which
doubles the test's time); the test checks the saved results' form
(every comparison row present with finite positive numbers, no error recorded, no machine path written), not
how fast anything is.
"""

import json
import math
import os
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_e2e_tiny_writes_finite_rows(tmp_path):
    # every part but "graph" (TrainStepGraph needs CUDA; tests/test_train_graph.py covers it on a GPU)
    parts = "kdamoe,native,recipe,profile,host"
    argv = ["--tiny", "--device", "cpu", "--out", str(tmp_path), "--profile-recipe-t", "64", "--only", parts]
    assert load_script("bench_e2e").main(argv) == 0
    text = (tmp_path / "e2e.json").read_text()
    doc = json.loads(text)

    errors = {f"{g}/{k}": v for g, entries in doc["raw"].items() if isinstance(entries, dict)
              for k, v in entries.items() if isinstance(v, str) or (isinstance(v, dict) and "error" in v)}
    assert not errors, errors
    names = [r["name"] for r in doc["rows"]]
    assert names == ["train step 64", "train step 128", "recipe shape train step 64", "recipe shape train step 128"]
    for row in doc["rows"]:
        assert row["peer"] == ("plain" if row["name"].startswith("recipe") else "native+fla"), row
        for field in ("ours_ms", "peer_ms", "ratio", "ours_tok_s", "peer_tok_s", "ours_mfu", "peer_mfu"):
            value = row[field]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (row["name"], field, value)
        assert math.isclose(row["ratio"], row["ours_ms"] / row["peer_ms"], rel_tol=1e-12)
    for part in ("kdamoe", "native", "recipe"):
        model = doc["raw"][part]["model"]
        assert 0 < model["params_routed"] < model["params_total"] and model["params_active"] < model["params_total"]
        for T in (64, 128):
            entry = doc["raw"][part][f"train_T{T}"]
            assert len(entry["steps_ms"]) == doc["settings"]["steps"] and math.isfinite(entry["loss_last"])
    profile = doc["raw"]["profile"]["kdamoe_T64"]
    assert profile["wall_ms"] > 0 and profile["profiled_wall_ms"] > 0
    assert doc["raw"]["profile"]["recipe_T64"]["kernels_per_step"] >= 0
    host = doc["raw"]["host"]["kdamoe_T64"]
    for phase in ("forward_ms", "backward_ms", "gpu_tail_ms", "step_ms"):
        assert len(host[f"{phase}_all"]) == 8 and all(x >= 0 for x in host[f"{phase}_all"]), (phase, host)
    for a, b, c, total in zip(host["forward_ms_all"], host["backward_ms_all"], host["gpu_tail_ms_all"],
                              host["step_ms_all"], strict=True):
        assert math.isclose(a + b + c, total, rel_tol=1e-9), (a, b, c, total)  # the three phases tile the step
    # the model's forward runs under cProfile: a function of the model file appears among the cumulative rows
    assert any("modeling_kdamoe.py" in r["function"] for r in host["by_cumulative"]), host["by_cumulative"][:5]
    assert all(r["calls"] > 0 and r["cum_ms"] >= r["own_ms"] >= 0 for r in host["by_own"])
    md = (tmp_path / "e2e.md").read_text()
    assert "| train step 128 (kdamoe) |" in md and "## Host: where a kdamoe step at 64" in md
    assert "## Profile: one recipe-shape kdamoe training step at 64" in md
    for saved in (text, md):
        assert str(tmp_path) not in saved and ROOT not in saved


def test_both_graphed_rows_divide_kdamoe_graph_by_native_graph():
    bench = load_script("bench_e2e")
    raw = {"native": {"train_T8192": {"median_ms": 200.0, "tok_s": 40960.0}},
           "graph": {"kdamoe_train_T8192": {"median_ms": 74.0, "tok_s": 110702.7},
                     "kdamoe_train_T32768": {"median_ms": 300.0, "tok_s": 109226.7}},
           "native_graph": {"train_T8192": {"median_ms": 148.0, "tok_s": 55351.4},
                            "train_T32768": {"error": "RuntimeError: operation not permitted "
                                                      "when stream is capturing"}}}
    rows = {r["name"]: r for r in bench.make_rows(raw)}
    both = rows["CUDA-graph train step 8K, both sides graphed"]
    assert both["peer"] == "native+fla graphed" and both["ours_ms"] == 74.0 and both["peer_ms"] == 148.0
    assert math.isclose(both["ratio"], 0.5, rel_tol=1e-12)
    failed = rows["CUDA-graph train step 32K, both sides graphed"]
    assert failed["ratio"] is None and "stream is capturing" in failed["peer_note"]
    # the graphed step against native's eager step stays as before
    assert math.isclose(rows["CUDA-graph train step 8K"]["ratio"], 74.0 / 200.0, rel_tol=1e-12)


def test_time_graphed_calls_refuses_a_non_finite_loss():
    bench = load_script("bench_e2e")
    fake = types.SimpleNamespace(sync=lambda: None)
    losses = iter([torch.tensor(2.5), torch.tensor(float("nan"))])
    with pytest.raises(FloatingPointError, match="T=64"):
        bench.time_graphed_calls(fake, lambda: next(losses), 2, 64)
    times, values = bench.time_graphed_calls(fake, lambda: torch.tensor(1.25), 3, 64)
    assert values == [1.25, 1.25, 1.25] and len(times) == 3 and all(t >= 0 for t in times)
