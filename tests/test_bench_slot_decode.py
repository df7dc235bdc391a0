"""Smoke test of ``benchmarks/bench_slot_decode.py --smoke`` on the CPU under the Triton interpreter (the rollout
engine's slot decode kernels against its former gather → op → scatter path, per layer).

The script's ``main`` runs in the test's process at N = 1 and 3 slots. Checked: a row for every op and N with finite
times, the slot kernels' outputs equal the former path's in float32 (the former path is independent code: the
batch ops on gathered states, and the engine's PyTorch MLA loop), the Markdown table. Not how fast anything is.
"""

import json
import math
import os
import sys

import kdamoe  # noqa: F401  (imported first: the script then uses the real package, not its kernels-only stand-in)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_slot_decode_smoke_rows_agree(tmp_path):
    load_script("bench_slot_decode").main(["--smoke", "--group", "2", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "slot_decode.json").read_text())
    assert doc["meta"]["device"] == "cpu (interpreter smoke)" and doc["meta"]["dtype"] == "torch.float32"
    assert {(r["op"], r["N"]) for r in doc["rows"]} == {(op, n) for op in ("kda", "conv", "mla") for n in (1, 3)}
    for row in doc["rows"]:
        assert math.isfinite(row["former_ms"]) and math.isfinite(row["slot_ms"]), row
        assert row["err"] < 1e-5, row  # float32: the same values by two independent paths
    assert "| mla | 3 |" in (tmp_path / "slot_decode.md").read_text()
