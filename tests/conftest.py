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

import torch  # noqa: E402

torch.set_num_threads(1)
