"""``kdamoe.kernels.launch``: the short launch path launches the config and binary Triton's own path would.

On the CPU the kernels run on the interpreter and are not wrapped (checked here); the short path itself is checked on
a GPU (``KDAMOE_TEST_ON_GPU=1``): the same outputs, bit for bit, as Triton's path for a plain and an autotuned kernel,
and the short path taken (not a silent fallback that would leave the overhead in place).
"""

import os

import pytest
import torch
import triton
import triton.language as tl

from kdamoe.kernels import launch
from kdamoe.kernels.conv import forward as conv_forward
from kdamoe.kernels.conv.conv import causal_conv1d
from kdamoe.kernels.launch import FastLaunch, fast_launch
from kdamoe.kernels.moe import grouped_gemm
from kdamoe.kernels.norm import forward as norm_forward
from kdamoe.kernels.utils import is_interpreter

ON_GPU = bool(os.environ.get("KDAMOE_TEST_ON_GPU")) and torch.cuda.is_available()


def test_interpreter_kernels_are_not_wrapped():
    """Under TRITON_INTERPRET=1 (the CPU suite) a launched kernel is Triton's own object, so the CPU tests run
    Triton's launch path; wrapping twice is a no-op and a non-kernel is refused."""
    if not is_interpreter():
        pytest.skip("the CPU suite's interpreter setting")
    assert not isinstance(norm_forward._forward_kernel, FastLaunch)
    assert not isinstance(grouped_gemm._rows_gemm_kernel, FastLaunch)
    assert fast_launch(norm_forward._forward_kernel) is norm_forward._forward_kernel
    with pytest.raises(TypeError, match="triton.jit"):
        FastLaunch(lambda: None)


@pytest.mark.skipif(not ON_GPU, reason="needs KDAMOE_TEST_ON_GPU=1 and CUDA")
def test_short_path_matches_tritons_path():
    """A plain kernel (the RMSNorm forward) and an autotuned one (the causal conv forward) give the same bits through
    both paths; after the first call (compile, tune) every call takes the short path."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(37, 1000, generator=gen).cuda().bfloat16()
    w = torch.randn(1000, generator=gen).cuda().bfloat16()
    xc = torch.randn(2, 75, 96, generator=gen).cuda().bfloat16()
    wc = torch.randn(96, 4, generator=gen).cuda().bfloat16()
    cases = [(norm_forward._forward_kernel,
              lambda: norm_forward.norm_forward(x, None, w, 1e-6, torch.bfloat16, torch.bfloat16)),
             (conv_forward._conv_fwd_kernel, lambda: causal_conv1d(xc, wc, output_final_state=False)[0])]
    for kernel, op in cases:
        assert isinstance(kernel, FastLaunch)
        launch.set_enabled(False)
        try:
            want = op()
        finally:
            launch.set_enabled(True)
        fast_before = kernel.fast
        got = [op() for _ in range(3)]
        torch.cuda.synchronize()
        assert kernel.fast - fast_before == 3, (kernel.fast, fast_before, kernel.slow)
        for g in got:
            assert torch.equal(g, want)


def _noop(X, Y, N, M, S: tl.constexpr, BLOCK: tl.constexpr):
    pass


def test_autotuned_launch_passes_what_tritons_autotuner_passes(monkeypatch):
    """On the CPU, with Triton's own objects (a ``JITFunction`` built with the interpreter off, an ``Autotuner``
    around it) and the launches stubbed: for positional, keyword, reordered and extra call-site arguments, the short
    path looks the config up under the key ``Autotuner.run`` stored, and hands the binder the arguments and keywords
    (same order) that ``Autotuner.run`` hands ``JITFunction.run``. A call-site keyword that the config also sets goes
    to Triton's path, which raises (before: the config's value silently won)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    jit = triton.jit(_noop)
    first, second = triton.Config({"BLOCK": 32}, num_warps=4), triton.Config({"BLOCK": 64}, num_warps=8)
    tuner = triton.autotune(configs=[first, second], key=["M", "N", "S"])(jit)
    tuner._bench = lambda *args, config, **kwargs: [1.0 if config is second else 2.0] * 3  # no GPU timing
    seen = {}
    monkeypatch.setattr(jit, "run", lambda *args, **kwargs: seen.setdefault("triton", (args, kwargs)))
    x, y = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float32)
    calls = [((), dict(Y=y, X=x, N=7, M=9, S=3)), ((x, y, 7, 9), dict(S=3)), ((x,), dict(N=7, Y=y, S=3, M=9)),
             ((x, y, 7), dict(S=3, M=9, extra=1))]
    for args, kwargs in calls:
        seen.clear()
        tuner.cache.clear()
        tuner.run(*args, **kwargs)  # Triton tunes (stubbed timings), stores the key, calls JITFunction.run
        fast = FastLaunch(tuner)
        monkeypatch.setattr(fast, "_run_jit", lambda grid, a, kw: seen.setdefault("fast", (a, kw)))
        fast.launch((1,), args, dict(kwargs))
        assert fast.slow == 0, (args, kwargs)  # the key Triton stored was found
        t_args, t_kwargs = seen["triton"]
        t_kwargs = {k: v for k, v in t_kwargs.items() if k not in ("grid", "warmup")}
        f_args, f_kwargs = seen["fast"]
        assert f_args == t_args and list(f_kwargs.items()) == list(t_kwargs.items()), (args, kwargs)
    fast = FastLaunch(tuner)
    monkeypatch.setattr(fast, "_run_jit", lambda *a: pytest.fail("the short path took a clashing keyword"))
    with pytest.raises(TypeError, match="num_warps"):
        fast.launch((1,), (x, y, 7, 9), dict(S=3, num_warps=2))
    assert fast.slow == 1
