"""Smoke test of ``benchmarks/check_engine_graphs.py --smoke`` on the CPU (the GPU check of the rollout engine's
CUDA graphs of its decode steps; the lead runs it on a GPU).

The script's ``main`` runs in the test's process on its tiny model, with the slot kernels forced on (as in
``tests/test_engine_static_steps.py``: the engine takes them where ``kernel_backend`` resolves to the kdamoe kernels,
i.e. CUDA), so its runs take the static decode steps under the Triton interpreter. Checked: a run row for every case
with and without graphs, the equality checks passed (no graph on the CPU: both runs are the eager static path), the
JSON written. Not how fast anything is.
"""

import json
import os
import sys

import kdamoe  # noqa: F401  (imported first: the script then uses the real package)
from kdamoe.posttraining.engine import RolloutEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_check_engine_graphs_smoke(tmp_path, monkeypatch):
    monkeypatch.setattr(RolloutEngine, "_slot_kernels",
                        lambda self, attn, x: self.use_slot_kernels and getattr(attn, "lower_bound", 0) is not None)
    assert load_script("check_engine_graphs").main(["--smoke", "--steps", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "engine_graphs.json").read_text())
    assert doc["passed"] and doc["meta"]["smoke"]
    cases = {(c["case"], c["slots"]) for c in doc["checks"]}
    assert cases == {("greedy", 1), ("greedy", 2), ("sampled, padding rows", 4)}
    assert all(c["ok"] and c["same_tokens"] for c in doc["checks"])
    assert {(r["slots"], r["graphs"]) for r in doc["runs"]} == {(n, g) for n in (1, 2, 4) for g in (False, True)}
    for row in doc["runs"]:
        assert row["static_path"] and row["graph_captures"] == row["graph_replays"] == 0
        if row["case"] == "greedy":
            assert row["steps_timed"] >= 1 and row["step_ms"] > 0
