"""The benchmarks' shared harness (``benchmarks/harness.py``): argument checks, the recorder's files, deadline and
error lines, and the CPU timing path. Each check is against a value written out here, not one the harness made."""

import argparse
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import harness  # noqa: E402  (the benchmarks folder is not a package)


def test_label_and_ints():
    h = harness
    assert [h.label(t) for t in (64, 1024, 131072, 1 << 20, 3 << 20, 1500)] == ["64", "1K", "128K", "1M", "3M", "1500"]
    assert h.ints("8192, 32768,") == [8192, 32768] and h.ints("") == []
    with pytest.raises(argparse.ArgumentTypeError, match="'8K'"):
        h.ints("8K")


@pytest.mark.parametrize("argv, message", [
    (["--only", "a,zz"], "unknown part(s) ['zz']"),
    (["--only", ","], "--only names no part"),
    (["--budget-s", "0"], "--budget-s must be a positive number of seconds (got 0.0)"),
    (["--budget-s", "nan"], "--budget-s must be a positive number"),
    (["--device", "gpu0"], "--device 'gpu0'"),
    (["--steps", "0"], "--steps must be >= 1 (got 0)"),
])
def test_run_args_refuse_bad_values(argv, message, capsys):
    h = harness
    p = argparse.ArgumentParser()
    h.add_run_args(p, ("a", "b"), out_default=".", out_help="", budget_default=10.0)
    p.add_argument("--steps", type=int, default=None)
    with pytest.raises(SystemExit):
        a = h.finish_run_args(p, p.parse_args(["--device", "cpu"] + argv), ("a", "b"), {"steps": 3})
        h.check_at_least(p, a, ("steps",))
    assert message in capsys.readouterr().err


def test_run_args_fill_defaults_and_keep_the_order_asked():
    h = harness
    p = argparse.ArgumentParser()
    h.add_run_args(p, ("a", "b"), out_default="somewhere", out_help="", budget_default=10.0)
    p.add_argument("--steps", type=int, default=None)
    a = h.finish_run_args(p, p.parse_args(["--device", "cpu", "--only", "b,a"]), ("a", "b"), {"steps": 3})
    assert a.only == ["b", "a"] and a.steps == 3 and a.budget_s == 10.0


def test_recorder_extends_its_file_and_records_skips_and_errors(tmp_path):
    h = harness

    class Rec(h.Recorder):
        stem = "probe"
        strip_paths = True

    rec = Rec(str(tmp_path), 100.0, {"a": 1})
    rec.put("part", "x", {"ms": 2.5})
    assert rec.need("part", "long", 1e9) is False  # far past the deadline: recorded as a skip
    try:
        open("/no/such/folder/file.txt")
    except OSError:
        rec.error("part", "broken")
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert doc["raw"]["part"]["x"] == {"ms": 2.5} and doc["settings"] == {"a": 1}
    assert doc["raw"]["part"]["long"].startswith("skipped: time")
    assert doc["raw"]["part"]["broken"] == {"error": "FileNotFoundError: [Errno 2] No such file or directory: "
                                                     "'file.txt'"}
    assert (tmp_path / "probe.md").exists() and not list(tmp_path.glob("*.tmp"))

    again = Rec(str(tmp_path), 100.0, {"b": 2})  # a second invocation extends the same file
    again.put("other", "y", 1)
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert doc["raw"]["part"]["x"] == {"ms": 2.5} and doc["raw"]["other"]["y"] == 1
    assert doc["settings"] == {"a": 1, "b": 2}


def test_time_ms_on_the_cpu_clears_grads_before_each_call():
    h = harness
    w = torch.ones(3, requires_grad=True)
    seen = []

    def step():
        seen.append(w.grad is None)
        (w * 2).sum().backward()

    assert h.time_ms(step, False, grads=[w]) >= 0
    assert seen == [True, True, True]


def test_load_script_names_a_missing_script():
    with pytest.raises(FileNotFoundError, match="no_such_bench.py"):
        harness.load_script("no_such_bench")
