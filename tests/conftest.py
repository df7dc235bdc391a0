"""Test-wide set-up.

Triton kernels run on the CPU through the interpreter; the variable must be set before any
``@triton.jit`` function is defined, hence at the very top of conftest.

One intra-op thread per test process: the suite runs as ``pytest -n 2`` on 2 cores, and two processes
that each spin 2 OpenMP threads slow small CPU ops down by two orders of magnitude.
"""

import os

if not os.environ.get("KDAMOE_TEST_ON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 (imported after TRITON_INTERPRET and OMP_NUM_THREADS are set above)
import torch  # noqa: E402 (imported after TRITON_INTERPRET and OMP_NUM_THREADS are set above)

torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make ``@pytest.mark.xdist_group`` work: pytest-xdist 3.8's ``--dist loadgroup`` tags each grouped test by
    rewriting ``item._nodeid`` (``<id>@<group>``), which pytest 9 no longer reads (``nodeid`` comes from
    ``item._id``), so the group was silently ignored and two multi-process tests could run at once on the two
    cores. Carry the tag over; runs after xdist's own hook. Older pytest (9.1 and before, e.g. on the GPU
    machine) has no ``coerce_node_id`` and reads ``_nodeid`` itself: nothing to carry over there."""
    try:
        from _pytest.nodes import coerce_node_id  # noqa: PLC0415 (absent from pytest 9.1 and older, as on the GPU machine: the hook returns early there)
    except ImportError:
        return

    for item in items:
        tagged = getattr(item, "_nodeid", None)
        if isinstance(tagged, str) and tagged != item.nodeid:
            item._id = coerce_node_id(tagged)
