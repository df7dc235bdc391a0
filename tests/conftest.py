"""Test-wide set-up.

Triton kernels run on the CPU through the interpreter; the variable must be set before any
``@triton.jit`` function is defined, hence at the very top of conftest.
"""

import os

if not os.environ.get("KDAMOE_TEST_ON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
