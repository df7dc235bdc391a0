"""Smoke test of ``benchmarks/bench_moe.py --smoke`` on the CPU under the Triton interpreter (the MoE router and
experts benchmark).

The script's ``main`` runs in the test's process. Checked: both results files hold every case and mode with finite
times; the route kernel and the model's PyTorch router op chose the same experts with the same weights and
histograms on the same input (the PyTorch op is the reference: it shares no code with the kernel); the experts
kernels' output and gradients match the PyTorch loop in float32; the stack names the commit. Not how fast anything is.
"""

import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_moe_smoke_writes_router_and_experts(tmp_path):
    load_script("bench_moe").main(["--smoke", "--out", str(tmp_path)])
    router = json.loads((tmp_path / "moe_router.json").read_text())
    assert router["stack"]["device"] == "cpu (TRITON_INTERPRET=1)" and len(router["stack"]["sources_sha256"]) == 16
    cases = {r["case"] for r in router["rows"]}
    assert cases == {"N64_d32_E16_k4", "N40_d32_E32_k8"}
    assert {(r["case"], r["mode"]) for r in router["rows"]} == {(c, m) for c in cases
                                                               for m in ("train_fwd", "train_fwdbwd", "eval_fwd")}
    for row in router["rows"]:
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("torch_ms", "triton_ms")), row
        if "agreement" in row:
            agree = row["agreement"]
            assert agree["index_mismatch_frac"] == 0.0 and agree["token_counts_l1_diff"] == 0.0, agree
            assert agree["histogram_l1_diff_frac"] == 0.0 and agree["weights_max_abs_diff"] < 1e-6, agree
    assert sum("agreement" in r for r in router["rows"]) == 2  # one per case

    experts = json.loads((tmp_path / "moe_experts.json").read_text())
    assert [r["name"] for r in experts["rows"]] == ["E8_I16_k2_fwd", "E8_I16_k2_fwdbwd"]
    assert all(math.isfinite(r["ours_ms"]) and math.isfinite(r["loop_ms"]) for r in experts["rows"])
    (errors,) = experts["errors"].values()
    assert set(errors) == {"out", "d_hidden", "d_weights", "d_gate_up", "d_down"}
    assert all(0 <= e < 1e-4 for e in errors.values()), errors  # float32 kernels against the float32 loop
    for name in ("moe_router.md", "moe_experts.md"):
        assert str(tmp_path) not in (tmp_path / name).read_text()
