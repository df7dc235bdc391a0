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
    rows = [line for line in out.getvalue().splitlines()
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

    with open(os.path.join(ROOT, "kdamoe", "configs", "cpu_default.yaml")) as f:
        fields = dict(yaml.safe_load(f)["model"])
    fields.setdefault("vocab_size", 8192)  # the script's stand-in for the tokenizer's size
    model = KDAMoEForCausalLM(KDAMoEConfig(**fields))
    total = sum(p.numel() for p in model.parameters())
    table_total = float(re.match(r"([\d.e+-]+) B", rows[0].split("|")[2].strip()).group(1)) * 1e9
    assert math.isclose(table_total, total, rel_tol=6e-3), (table_total, total)
