"""Small helpers shared by the Triton kernel families.

``autotune`` is ``triton.autotune`` on a GPU; under ``TRITON_INTERPRET=1`` (CPU tests) it keeps only
the first config, because the interpreter cannot benchmark and each config would be run for real.
"""

import os

import triton


def is_interpreter() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune(configs, key, **kwargs):
    """``triton.autotune`` that degrades to the first config under the interpreter.

    Args:
        configs: list of ``triton.Config``; the first one is the interpreter's choice.
        key: argument names whose change triggers re-tuning (as in ``triton.autotune``).
    """
    if is_interpreter():
        first = configs[0]

        def wrap(fn):
            return triton.heuristics({name: (lambda _args, v=v: v) for name, v in first.kwargs.items()})(fn)

        return wrap
    return triton.autotune(configs=configs, key=key, **kwargs)
