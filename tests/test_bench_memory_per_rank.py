"""Smoke test of ``benchmarks/memory_per_rank.py`` (the training-state table of docs/distributed.md) on the CPU.

Checked: the table has a row per shape, and each row's per-rank columns follow from its own parameter count the
way the module docstring says (16 bytes per parameter; DDP keeps all of it on every rank, FSDP2 an n-th on each
of n ranks), so a column computed from the wrong count or divided by the wrong rank number shows. The parameter
count of the CPU preset is checked against the model built from that preset independently here.
"""

import contextlib
import io
import math
import os
import re
import sys

import yaml

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_memory_per_rank_table_follows_from_the_parameter_counts():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        load_script("memory_per_rank").main()
    text = out.getvalue()
    rows = [line for line in text.split("Kimi K3 text model")[0].splitlines()
            if line.startswith("| ") and "GiB" in line and not line.startswith("| shape")]
    assert [r.split("|")[1].strip() for r in rows] == ["cpu_default.yaml", "gpu_h200.yaml",
                                                       "K3-scale (assumed, see K3_SCALE)"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        total_b = float(re.match(r"([\d.e+-]+) B", cells[1]).group(1))
        ddp, fsdp8, fsdp64 = (float(c.split()[0]) for c in cells[2:5])
        # three significant digits per cell (each within 0.5 % of its value): two cells agree within 1 %
        assert math.isclose(ddp, 16 * total_b * 1e9 / 2**30, rel_tol=1.1e-2), row
        assert math.isclose(fsdp8, ddp / 8, rel_tol=1.1e-2) and math.isclose(fsdp64, ddp / 64, rel_tol=1.1e-2), row

    # Kimi K3's table: 2,779,484,393,568 parameters (NeMo's K3 on the meta device, docs/checkpoints.md), of which
    # 2,722,740,830,208 in routed experts; per rank of n: 16 B per parameter for training, for inference 17/32 B per
    # expert weight (MXFP4) plus 2 B per other weight, sharded or replicated
    total, experts = 2_779_484_393_568, 2_722_740_830_208
    k3_rows = [line for line in text.split("Kimi K3 text model")[1].splitlines()
               if line.startswith("| ") and "GiB" in line]
    assert [int(r.split("|")[1]) for r in k3_rows] == [64, 128, 224, 448, 896]
    for row in k3_rows:
        n, train, sharded, expert, replicated = (float(c.split()[0]) for c in row.split("|")[1:-1])
        for got, want in ((train, 16 * total / n), (expert, experts * 17 / 32 / n),
                          (sharded, (experts * 17 / 32 + 2 * (total - experts)) / n),
                          (replicated, experts * 17 / 32 / n + 2 * (total - experts))):
            assert math.isclose(got, want / 2**30, rel_tol=1e-3), row

    with open(os.path.join(ROOT, "kdamoe", "configs", "cpu_default.yaml")) as f:
        fields = dict(yaml.safe_load(f)["model"])
    fields.setdefault("vocab_size", 8192)  # the script's stand-in for the tokenizer's size
    model = KDAMoEForCausalLM(KDAMoEConfig(**fields))
    total = sum(p.numel() for p in model.parameters())
    table_total = float(re.match(r"([\d.e+-]+) B", rows[0].split("|")[2].strip()).group(1)) * 1e9
    assert math.isclose(table_total, total, rel_tol=6e-3), (table_total, total)
