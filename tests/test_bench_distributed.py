"""``benchmarks/bench_distributed.py``'s plan when the one-process pretraining run fails (no launch is made).

The launcher is replaced by one that records the runs asked for and reports each as failed (exit 1), so nothing
trains. Checked: the bench does not stop at the first two-process pretraining run (it used to raise ``KeyError:
'_tokenizer'`` there, the one-process run having left no tokenizer to share), every planned run gets a row, the
two-process runs train their own tokenizer (no ``tokenizer.path``), and the SFT runs are skipped for want of a base
model.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from harness import load_script  # noqa: E402  (the benchmarks folder is not a package)


def test_bench_distributed_goes_on_after_the_one_process_pretraining_fails(tmp_path, monkeypatch):
    bench = load_script("bench_distributed")
    launched = []

    def failing_launch(self, name, kind, processes, dump, args, timeout_s=None, env=None):
        launched.append((name, processes, args))
        return {"exit": 1, "wall_s": 0.0, "resumed_line": None, "error": "ValueError: no corpus"}

    monkeypatch.setattr(bench.Launcher, "launch", failing_launch)
    monkeypatch.setattr(sys, "argv", ["bench_distributed.py", "--cpu-dry-run", "--only", "pretrain/ddp,sft/ddp",
                                      "--out", str(tmp_path / "out"), "--keep", str(tmp_path / "runs")])
    bench.main()

    assert [(name, processes) for name, processes, _ in launched] == [("pretrain/1", 1), ("pretrain/ddp", 2)]
    assert not any("tokenizer.path" in arg for arg in launched[1][2])
    runs = {r["name"]: r for r in json.loads((tmp_path / "out" / "distributed.json").read_text())["runs"]}
    assert list(runs) == ["pretrain/1", "pretrain/ddp", "sft/1", "sft/ddp"]
    assert runs["pretrain/ddp"]["launches"][0]["exit"] == 1
    assert runs["sft/1"]["skipped"] == runs["sft/ddp"]["skipped"] == "no base model: pretrain/1 did not write final/"
