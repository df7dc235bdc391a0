"""A shorter host path for launching an already compiled Triton kernel (the training step is host-bound at 8K).

``kernel[grid](*args)`` on a ``triton.autotune``-wrapped ``triton.jit`` kernel runs, in Python, for every launch:
the autotuner's ``run`` (a dict of every argument, the tuning key with one ``str(dtype)`` per tensor, the config
lookup, a merged keyword dict), then ``JITFunction.run`` (knob reads, pre-run hooks, the argument binder that computes
the specialisation, the compiled-kernel lookup, the check of every global the kernel reads, the grid, the launch
metadata) and only then the C launcher. A training step of the e2e shape launches ~470 Triton kernels, 270 of them
autotuned, and at 8K tokens the host, not the GPU, sets the step time (``benchmarks/results/e2e_h200.md``: 72 ms of
GPU work in a 100-140 ms step).

:class:`FastLaunch` keeps the parts of that path that decide *which* compiled kernel runs and drops the rest:

- the autotuner's config is looked up under the key Triton's ``Autotuner.run`` builds (the ``key`` arguments' values,
  then ``str(dtype)`` of every argument with a dtype, in argument order), so a hit is the config Triton would run;
- Triton's own binder computes the specialisation (integer divisibility by 16, pointer alignment, the constexprs, the
  options) and Triton's ``compute_cache_key`` turns it into the compiled-kernel key, so a hit is the binary Triton
  would launch;
- that binary's C launcher is called with the same arguments ``JITFunction.run`` passes it.

Anything the short path does not handle goes through Triton's own ``kernel[grid](...)``, unchanged: a first call
(compilation, autotuning), a config with a ``pre_hook``, a call-site keyword the config also sets, pre-run hooks,
launch hooks (Triton's profiler), a pipeline inspection hook, a binary that failed to load. What is skipped is the
check that globals a kernel reads did not change after compilation (ours read none) and Python-side bookkeeping
(``Autotuner.nargs``). Under the CPU interpreter (``TRITON_INTERPRET=1``) kernels
are not wrapped at all. ``KDAMOE_FAST_LAUNCH=0`` (read at import) sends every launch through Triton's path, for a
comparison (``benchmarks/tuning/launch_overhead.py``); so does :func:`set_enabled`.

Written against Triton 3.6, the GPU machine's (``triton/runtime/jit.py``, ``JITFunction.run``;
``triton/runtime/autotuner.py``, ``Autotuner.run``), and read against 3.7, the CPU machine's (same path, plus a
pipeline-inspection hook). ``triton.__version__`` is checked when a kernel is wrapped: under any other version kernels
are left unwrapped and launch through Triton's own path.
"""

import os

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, compute_cache_key

from .utils import is_interpreter

try:
    from triton import knobs
except ImportError:  # pragma: no cover - Triton < 3.4 has no knobs module: not wrapped (see _SUPPORTED)
    knobs = None

_SUPPORTED = ("3.6.", "3.7.")  # the versions whose JITFunction.run / Autotuner.run this module mirrors
# the device index and raw stream handle as Triton's CUDA driver reads them (without building a torch.cuda.Stream)
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                          lambda device: torch.cuda.current_stream(device).cuda_stream)


_ENABLED = os.environ.get("KDAMOE_FAST_LAUNCH", "1") != "0"


def set_enabled(value: bool) -> None:
    """Send later launches through the short path (True) or Triton's own (False), e.g. to compare the two."""
    global _ENABLED
    _ENABLED = bool(value)


def _unhooked(hook) -> bool:
    """A launch hook that does nothing: None or an empty ``HookChain`` (the default of Triton 3.6 and 3.7, which
    Triton's path still calls twice per launch, with a launch-metadata dict built for it)."""
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


class FastLaunch:
    """A launched Triton kernel (``triton.jit``, or ``triton.autotune`` around it) with the short launch path.

    ``wrapped[grid](*args, **kwargs)`` launches as ``kernel[grid](*args, **kwargs)`` would: same config, same binary,
    same arguments. Every other attribute (``configs``, ``cache``, ``fn``, ``run``, ``best_config``, …) is the kernel's
    own.

    Attributes:
        kernel: the wrapped ``JITFunction`` or ``Autotuner``.
        fast, slow: launches that took the short path / Triton's path (counters, for tests and benchmarks).

    Raises:
        TypeError: ``kernel`` is neither a ``JITFunction`` nor an ``Autotuner`` around one.
    """

    def __init__(self, kernel):
        autotuner = kernel if isinstance(kernel, Autotuner) else None
        jit = kernel.fn if autotuner is not None else kernel
        if not isinstance(jit, JITFunction):
            raise TypeError(f"FastLaunch wraps a triton.jit kernel or an autotuner around one, got {type(kernel)}")
        self.kernel, self.autotuner, self.jit = kernel, autotuner, jit
        self.fast = self.slow = 0

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """Launch on ``grid`` (a tuple or a callable of the bound arguments); returns what Triton's launch returns
        on its path and the compiled kernel on the short one."""
        if not _ENABLED:
            return self._slow(grid, args, kwargs)
        at = self.autotuner
        if at is not None:
            if len(at.configs) > 1:
                named = dict(zip(at.arg_names, args, strict=False))  # the positional ones; kwargs follow
                for name, value in kwargs.items():
                    if name in at.arg_names:
                        named[name] = value
                # Autotuner.run's key: the key arguments' values, then str(dtype) of each argument with a dtype
                key = [named[k] for k in at.keys if k in named]
                for value in named.values():
                    if hasattr(value, "dtype"):
                        key.append(str(value.dtype))
                config = at.cache.get(tuple(key))
                if config is None:  # not tuned yet: Triton tunes and launches
                    return self._slow(grid, args, kwargs)
            else:
                config = at.configs[0]
            tuned = config.all_kwargs()
            # a pre_hook runs on Triton's path; a keyword the config also sets is Triton's TypeError, raised there
            if config.pre_hook is not None or not tuned.keys().isdisjoint(kwargs):
                return self._slow(grid, args, kwargs)
            at.best_config = config
            kwargs = {**kwargs, **tuned}
        return self._run_jit(grid, args, kwargs)

    def _slow(self, grid, args, kwargs):
        self.slow += 1
        return self.kernel[grid](*args, **kwargs)

    def _run_jit(self, grid, args, kwargs):
        jit = self.jit
        runtime = knobs.runtime
        if (jit.pre_run_hooks or not _unhooked(runtime.launch_enter_hook) or not _unhooked(runtime.launch_exit_hook)
                or getattr(runtime, "add_stages_inspection_hook", None) is not None):
            self.slow += 1
            return jit.run(*args, grid=grid, warmup=False, **kwargs)
        # the two options JITFunction.run adds before binding: part of the compiled kernel's key
        kwargs["debug"] = kwargs.get("debug", jit.debug) or runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        device = _current_device()
        kernel_cache, kernel_key_cache, _target, _backend, binder = jit.device_caches[device]
        bound_args, specialization, options = binder(*args, **kwargs)
        kernel = kernel_cache.get(compute_cache_key(kernel_key_cache, specialization, options))
        if kernel is None:  # not compiled for this specialisation yet
            self.slow += 1
            return jit.run(*args, grid=grid, warmup=False, **kwargs)
        if callable(grid):
            grid = grid(bound_args)
        n = len(grid)
        if hasattr(kernel, "result"):  # an asynchronous compilation's future (Triton 3.6)
            kernel = kernel.result()
        launcher = kernel.run  # first: loads the binary, which sets kernel.function
        if kernel.function is None:  # the binary did not load: Triton's path loads it again and raises its error
            self.slow += 1
            return jit.run(*args, grid=grid, warmup=False, **kwargs)
        launcher(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                 _current_stream(device), kernel.function, kernel.packed_metadata,
                 None, None, None, *bound_args.values())
        self.fast += 1
        return kernel


def fast_launch(kernel):
    """Decorator (outermost, above ``triton.jit`` / ``autotune``) giving a launched kernel :class:`FastLaunch`'s
    short path. Returns ``kernel`` itself under the interpreter, on a Triton version this module does not mirror
    (see ``_SUPPORTED``), or for an already wrapped kernel."""
    if (isinstance(kernel, FastLaunch) or knobs is None or not triton.__version__.startswith(_SUPPORTED)
            or is_interpreter()):
        return kernel
    return FastLaunch(kernel)


def autotune(configs, key, **kwargs):
    """``triton.autotune`` on a GPU, launched through ``launch.FastLaunch``; the first config, fixed, under the
    interpreter.

    The interpreter cannot time configs (each would run for real, at CPU speed), so the tests run
    ``configs[0]``; order each list so that its first entry is a config the GPU may pick. Only
    ``triton.Config.kwargs`` (block sizes) reach the interpreter: warps, stages and register caps do not
    exist there.

    Args:
        configs: list of ``triton.Config``; the first one is the interpreter's choice.
        key: argument names whose change triggers re-tuning (as in ``triton.autotune``).
        **kwargs: passed to ``triton.autotune`` (ignored under the interpreter).
    """
    if is_interpreter():
        first = configs[0]

        def wrap(fn):
            return triton.heuristics({name: (lambda _args, v=v: v) for name, v in first.kwargs.items()})(fn)

        return wrap
    tune = triton.autotune(configs=configs, key=key, **kwargs)
    return lambda fn: fast_launch(tune(fn))
