"""``kdamoe.kernels.utils.cached_constant``: the shape-only index tables the kernels reuse across calls.

CUDA graph capture is simulated (``torch.cuda.is_available`` / ``is_current_stream_capturing`` patched): the policy
is host code, and the CPU has no graphs. The built values are compared with the tensors built directly.
"""

import pytest
import torch

from kdamoe.kernels import utils


@pytest.fixture
def cache(monkeypatch):
    """An empty cache with room for 3 keys, outside capture; returns a setter for the capture state."""
    monkeypatch.setattr(utils, "_CONSTANTS", {})
    monkeypatch.setattr(utils, "_PINNED", set())
    monkeypatch.setattr(utils, "_MAX_CONSTANTS", 3)
    state = {"capturing": False}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    return lambda on: state.update(capturing=on)


def test_built_once_and_reused(cache):
    calls = []

    def build():
        calls.append(1)
        return torch.arange(5)

    first, again = utils.cached_constant("a", build), utils.cached_constant("a", build)
    assert again is first and len(calls) == 1 and torch.equal(first, torch.arange(5))


def test_a_table_a_captured_graph_reads_survives_eviction(cache):
    """A graph captured with a cached table replays its address: once the cache is full, the other entries go, that one
    stays (it was dropped with the rest before, freeing memory a graph still read)."""
    pinned = utils.cached_constant("graph", lambda: torch.arange(4))
    cache(True)
    assert utils.cached_constant("graph", lambda: torch.zeros(1)) is pinned  # read during the capture
    cache(False)
    others = [utils.cached_constant(k, lambda: torch.arange(2)) for k in ("b", "c")]
    utils.cached_constant("d", lambda: torch.arange(3))  # the fourth key: the unpinned ones are dropped
    assert utils.cached_constant("graph", lambda: torch.zeros(1)) is pinned
    assert utils.cached_constant("b", lambda: torch.arange(2)) is not others[0]


def test_a_table_built_during_capture_is_not_kept(cache):
    cache(True)
    during = utils.cached_constant("x", lambda: torch.arange(3))
    cache(False)
    after = utils.cached_constant("x", lambda: torch.arange(3))
    assert after is not during and torch.equal(after, during)


def test_a_table_first_built_in_inference_mode_can_be_saved_for_backward(cache):
    with torch.inference_mode():
        table = utils.cached_constant("inf", lambda: torch.arange(3.0))
    assert not table.is_inference()
    w = torch.ones(3, requires_grad=True)
    (w * table).sum().backward()  # saves the table for backward
    assert torch.equal(w.grad, torch.arange(3.0))
