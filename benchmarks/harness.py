"""The benchmarks' shared harness: argument checks, the deadline-keeping recorder, timing, result files, the stack.

Every script in ``benchmarks/`` (and ``benchmarks/tuning/``) imports this module; it holds what they used to copy
between them:

* paths: ``REPO`` (the repository root, put on ``sys.path`` so ``import kdamoe`` finds this checkout),
  :func:`kernels_only` (``import kdamoe.kernels`` without ``kdamoe/__init__``) and :func:`load_script` (a script as a
  module, for the tests);
* arguments: :func:`add_run_args` / :func:`finish_run_args` (``--out``, ``--only``, ``--tiny``, ``--device``,
  ``--budget-s``, each checked at parse time), :func:`ints` (comma lists of lengths), :func:`check_at_least`;
* recording: :class:`Recorder` (raw numbers, skips and errors of one run, rewritten after every measurement, with a
  deadline), :class:`Bench` (device, dtype, model shape, random ids), :func:`start_run`, :func:`run_part` and
  :func:`run_parts`;
* files: :func:`write_json` / :func:`write_text` (written whole, then renamed: a kill mid-write leaves the previous
  file) and :func:`write_results` (``<stem>.json`` + ``<stem>.md``);
* jobs: :func:`stream_job` (a launch with a watchdog, its output timestamped) and :func:`scalars` (what
  a job logged to TensorBoard);
* timing: :func:`time_ms` (``triton.testing.do_bench`` on CUDA, a wall-clock median on the CPU);
* the stack: :func:`stack_versions`, :func:`device_name`, :func:`commit`, :func:`sources_digest`;
* the model both long-context, end-to-end and RL benchmarks build: :class:`Shape`, ``TINY``, :func:`build_kdamoe`,
  :func:`build_native`; and the tables' cells: :func:`fmt`, :func:`value_of`, :func:`compare_row`, :func:`label`.

The benchmarks folder is not a package: a script puts its own folder on ``sys.path`` and imports ``harness``.
"""

import argparse
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # ``import kdamoe`` finds this checkout, not an installed copy

K, M = 1 << 10, 1 << 20
GIB = float(1 << 30)
NATIVE = "native+fla"  # the peer of the long-context and end-to-end benchmarks: transformers' KimiLinear (+ fla)


def label(T: int) -> str:
    """``131072`` -> ``128K``, ``1048576`` -> ``1M``, others as they are."""
    if T >= M and T % M == 0:
        return f"{T // M}M"
    if T >= K and T % K == 0:
        return f"{T // K}K"
    return str(T)


def kernels_only() -> None:
    """Make ``import kdamoe.kernels`` (and the PyTorch reference modules ``kdamoe.model.*_torch``) work without running
    ``kdamoe/__init__`` or ``kdamoe/model/__init__``, which import transformers and the modeling code (a GPU image's
    transformers may be older). The kernels and the references need only torch and triton. Does nothing when
    ``kdamoe`` is already imported (then the real package serves)."""
    if "kdamoe" not in sys.modules:
        for name, folder in (("kdamoe", "kdamoe"), ("kdamoe.model", os.path.join("kdamoe", "model"))):
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(REPO, folder)]
            sys.modules[name] = package


def load_script(name: str) -> types.ModuleType:
    """Import ``benchmarks/<name>.py`` (``name`` may hold a sub-folder, e.g. ``"tuning/tune_norm"``) as a fresh module
    object, its code run anew (the folder is not a package); the tests call a script's ``main`` this way, in their
    own process. Raises ``FileNotFoundError`` naming the path when there is no such script."""
    path = os.path.join(BENCH_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no benchmark script {path}")
    spec = importlib.util.spec_from_file_location(os.path.basename(name), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ arguments


def ints(text: str) -> list[int]:
    """An argparse ``type``: a comma list of integers (``"8192,32768"`` -> ``[8192, 32768]``; empty -> ``[]``).

    Raises ``argparse.ArgumentTypeError`` naming the text when an item is not an integer."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, e.g. 8192,32768; got {text!r}") from None


def add_run_args(p: argparse.ArgumentParser, parts: tuple[str, ...], *, out_default: str, out_help: str,
                 budget_default: float) -> None:
    """The arguments every part-wise benchmark takes: ``--out`` (default ``$OUT``, else ``out_default``), ``--only``
    (a comma list of ``parts``, default all, run in the order given), ``--tiny`` (tiny shapes and lengths: the CPU
    smoke test), ``--device`` (default ``cuda`` when there is one) and ``--budget-s`` (the deadline, s)."""
    p.add_argument("--out", default=os.environ.get("OUT", out_default), help=out_help)
    p.add_argument("--only", default=",".join(parts), help=f"comma list of {', '.join(parts)}")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and lengths (CPU smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-s", type=float, default=budget_default,
                   help="deadline: measurements that do not fit in what is left are recorded as 'skipped: time'")


def finish_run_args(p: argparse.ArgumentParser, a: argparse.Namespace, parts: tuple[str, ...],
                    defaults: dict) -> argparse.Namespace:
    """Check what :func:`add_run_args` added and fill the ``None`` arguments from ``defaults`` (name -> value).

    ``a.only`` becomes a list of parts. ``p.error`` (exit status 2, the bad value named) for an unknown or empty
    ``--only``, a ``--device`` torch cannot parse or a CUDA device on a machine without one, and a ``--budget-s``
    that is not a positive number."""
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.only = [x.strip() for x in a.only.split(",") if x.strip()]
    bad = [x for x in a.only if x not in parts]
    if bad or not a.only:
        p.error(f"--only: unknown part(s) {bad}; choose from {', '.join(parts)}" if bad else "--only names no part")
    try:
        torch.device(a.device)
    except RuntimeError as error:
        p.error(f"--device {a.device!r}: {error}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: CUDA is not available here (use --device cpu with --tiny)")
    if not math.isfinite(a.budget_s) or a.budget_s <= 0:
        p.error(f"--budget-s must be a positive number of seconds (got {a.budget_s})")
    return a


def check_at_least(p: argparse.ArgumentParser, a: argparse.Namespace, names: tuple[str, ...], low: int = 1) -> None:
    """``p.error`` naming the first of ``names`` (attribute names of ``a``) whose value is below ``low``."""
    for name in names:
        if getattr(a, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low} (got {getattr(a, name)})")


def add_moe_shape_args(p: argparse.ArgumentParser) -> None:
    """The routed experts' shape of the tuners (``--tokens``, ``--experts``, ``--latent``, ``--inter``, ``--top-k``;
    defaults: the end-to-end benchmark's shape at 32K tokens)."""
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--latent", type=int, default=1024, help="ℓ: the experts' input/output width")
    p.add_argument("--inter", type=int, default=512, help="I: the experts' intermediate width")
    p.add_argument("--top-k", type=int, default=8)


# ------------------------------------------------------------------------------------------------ files


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path + ".tmp"``, then rename it to ``path``: a kill mid-write leaves the previous file
    whole (the device scripts remove a left-over ``*.tmp``)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, obj, indent: int = 1, default=None) -> None:
    """``obj`` as JSON (``json.dumps(obj, indent=indent, default=default)``) through :func:`write_text`."""
    write_text(path, json.dumps(obj, indent=indent, default=default))


def write_results(out_dir: str, stem: str, doc, markdown: str, default=None) -> None:
    """``<out_dir>/<stem>.json`` (``doc``) and ``<out_dir>/<stem>.md`` (``markdown``), each written whole; the folder
    is made when missing."""
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, f"{stem}.json"), doc, default=default)
    write_text(os.path.join(out_dir, f"{stem}.md"), markdown)


# ------------------------------------------------------------------------------------------------ timing


def time_ms(fn, cuda: bool, *, warmup: int = 25, rep: int = 100, grads=None, mode: str = "median") -> float:
    """Milliseconds one call of ``fn`` takes.

    CUDA: ``triton.testing.do_bench(fn, warmup, rep, grad_to_none=grads, return_mode=mode)`` (``warmup`` and ``rep``
    in ms of GPU time). CPU (smoke runs only, the number means little): the median of 3 wall-clock calls, the
    ``grads`` tensors' ``.grad`` set to None before each, as ``do_bench`` does."""
    if cuda:
        from triton.testing import do_bench  # noqa: PLC0415  (triton only where it times: the CPU path needs none)

        return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grads, return_mode=mode)
    times = []
    for _ in range(3):
        for g in grads or ():
            g.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ jobs


def scalars(run_dir: str, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one TensorBoard scalar written by the job under ``run_dir/tensorboard``."""
    # deferred: only the job benchmarks read TensorBoard events; harness itself needs torch alone, so that the
    # kernel benchmarks import it on an image with torch and triton only
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415  (see above)

    if not os.path.isdir(os.path.join(run_dir, "tensorboard")):  # a job that died before its first log
        return []
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def stream_job(cmd: list[str], log, limit_s: float, env: dict | None = None, on_line=None) -> dict:
    """Run ``cmd`` (from the repo root) with its output streamed into the open file ``log``, each line prefixed by
    the seconds since the start, so a run cut short still shows where its time went. A watchdog kills the whole
    process group after ``limit_s`` seconds (torchrun and every rank it started; also when the job prints nothing).
    ``on_line(line)``, if given, sees every line as it comes.

    Returns ``{"exit": int, "wall_s": float, "killed": bool, "tail": the last 40 lines}``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    killed = threading.Event()

    def kill():
        killed.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    watchdog = threading.Timer(limit_s, kill)
    watchdog.start()
    tail = []
    for line in proc.stdout:
        log.write(f"{time.perf_counter() - t0:7.1f} {line}")
        log.flush()
        tail = (tail + [line])[-40:]
        if on_line is not None:
            on_line(line)
    code = proc.wait()
    watchdog.cancel()
    return {"exit": code, "wall_s": round(time.perf_counter() - t0, 1), "killed": killed.is_set(), "tail": tail}


# ------------------------------------------------------------------------------------------------ the stack


def device_name(cuda: bool, cpu: str = "cpu") -> str:
    """``torch.cuda.get_device_name()`` on CUDA, else ``cpu`` (a label such as ``"cpu (TRITON_INTERPRET=1)"``)."""
    return torch.cuda.get_device_name() if cuda else cpu


def commit() -> str:
    """The measured commit: ``$KDAMOE_COMMIT`` first (a device copy of the working tree can carry an older ``.git``
    than the files measured), else ``git rev-parse HEAD`` in the repository; ``""`` when neither answers."""
    found = os.environ.get("KDAMOE_COMMIT", "")
    if not found:
        try:
            found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                   timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found = ""
    return found


def sources_digest(folders: tuple[str, ...]) -> str:
    """First 16 hex digits of the SHA-256 of the ``*.py`` files directly in ``folders`` (relative to the repository,
    each folder's files in name order): which sources a result measured, when the commit alone does not say."""
    digest = hashlib.sha256()
    for sub in folders:
        folder = os.path.join(REPO, sub)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as fh:
                    digest.update(fh.read())
    return digest.hexdigest()[:16]


def stack_versions(cuda: bool) -> dict:
    """The GPU (``"cpu"`` without CUDA), torch, triton, transformers, fla (``None`` when absent) and CUDA versions,
    and where native KimiLinear's KDA and conv kernels come from (:func:`implementation_module`)."""
    import transformers  # noqa: PLC0415  (a kernels-only benchmark runs where transformers may be too old to import)
    import triton  # noqa: PLC0415  (the same: loaded only when the stack is described)

    try:
        fla = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        fla = None
    out = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "transformers": transformers.__version__, "fla": fla,
           "cuda": torch.version.cuda}
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as kl  # noqa: PLC0415  (absent from older transformers)

        out["native_kda_from"] = implementation_module(kl.chunk_kimi_delta_attention)
        out["native_conv_from"] = implementation_module(kl.causal_conv1d_fn)
    except Exception as err:  # an older transformers without kimi_linear: the native part will say why
        out["native_kda_from"] = repr(err)
    return out


def implementation_module(fn) -> str:
    """Where the kernel behind one of transformers' ``use_kernel_func_from_hub_with_fallback`` wrappers comes from:
    the module of the ``implementation`` it closes over (transformers 5.24), ``torch fallback`` when that is
    transformers' own PyTorch function; for anything else (transformers 5.25 makes it a module that ``kernelize``
    swaps, with ``use_kernels``) its type's name."""
    if not hasattr(fn, "__code__"):
        return f"unknown ({type(fn).__qualname__} object, not a 5.24-style wrapper)"
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))  # one cell per free variable
    if "implementation" not in cells:
        return "unknown (no implementation in the wrapper's closure)"
    target = cells["implementation"].cell_contents
    if "torch_function" in cells and target is cells["torch_function"].cell_contents:
        return "torch fallback (transformers)"
    return f"{target.__module__}.{target.__name__}"


# ------------------------------------------------------------------------------------------------ recording


class Recorder:
    """Raw numbers, skips and errors of one run; ``save()`` rewrites ``<stem>.json`` and ``<stem>.md`` in ``out_dir``
    (after every measurement, so a crash or the deadline loses nothing measured before it). An existing
    ``<stem>.json`` there is extended (its ``raw``, ``notes``, ``stack`` and ``settings`` kept), so two invocations
    end in one file. ``need(group, key, seconds)`` is False, and records ``skipped: time``, when the deadline
    (``budget_s`` from construction) is nearer.

    A benchmark subclasses it with its ``stem`` (the file names), ``rows()`` (the comparison rows derived from
    ``raw``) and ``markdown(doc)``; ``strip_paths = True`` cuts the folders from any path in a recorded error line
    (the file name stays), so the saved files name no machine's paths.

    The JSON: ``{"stack", "settings", "rows", "raw", "notes"}``; ``raw[group][key]`` is a measurement (a dict), a
    skip's reason (a string) or ``{"error": the exception's last line}``.
    """

    stem = "results"
    strip_paths = False

    def __init__(self, out_dir: str, budget_s: float, settings: dict):
        self.out_dir = out_dir
        self.deadline = time.time() + budget_s
        self.path = os.path.join(out_dir, f"{self.stem}.json")
        old = json.load(open(self.path)) if os.path.exists(self.path) else {}
        self.raw: dict = old.get("raw", {})
        self.notes: dict = old.get("notes", {})
        self.stack: dict = old.get("stack", {})
        self.settings = {**old.get("settings", {}), **settings}

    def left(self) -> float:
        """Seconds to the deadline (negative past it)."""
        return self.deadline - time.time()

    def put(self, group: str, key: str, value) -> None:
        """Record ``value`` as ``raw[group][key]`` and save."""
        self.raw.setdefault(group, {})[key] = value
        self.save()

    def need(self, group: str, key: str, seconds: float) -> bool:
        """True when ``seconds`` fit before the deadline; else record ``skipped: time`` under ``group/key``."""
        if self.left() >= seconds:
            return True
        self.put(group, key, f"skipped: time ({self.left():.0f} s left, needs ~{seconds:.0f} s)")
        print(f"{group}/{key}: skipped: time", flush=True)
        return False

    def error(self, group: str, key: str) -> None:
        """Record the exception being handled: its whole traceback goes to the log, its last line (500 characters at
        most; folders cut from paths when ``strip_paths``) to the results."""
        text = traceback.format_exc()
        print(text, flush=True)
        line = text.strip().splitlines()[-1]
        if self.strip_paths:
            line = re.sub(r"(?<![\w.])/(?:[^\s/'\"]+/)+", "", line)
        self.put(group, key, {"error": line[:500]})

    def rows(self) -> list[dict]:
        """The comparison rows derived from ``raw`` (none here; a benchmark's recorder says)."""
        return []

    def markdown(self, doc: dict) -> str:
        """The ``.md`` file of ``doc`` (a benchmark's recorder says; here the JSON itself)."""
        return "```json\n" + json.dumps(doc, indent=1, default=str) + "\n```\n"

    def save(self) -> None:
        """Rewrite both files whole (:func:`write_json`, :func:`write_text`)."""
        doc = {"stack": self.stack, "settings": self.settings, "rows": self.rows(), "raw": self.raw,
               "notes": self.notes}
        write_json(self.path, doc)
        write_text(os.path.join(self.out_dir, f"{self.stem}.md"), self.markdown(doc))


class PartBench:
    """What :func:`run_part` / :func:`run_parts` need, for a benchmark that builds its own models rather than a
    :class:`Bench`'s: the parsed ``args`` (``args.only``: the parts), the recorder, and a way to free memory."""

    def __init__(self, args, rec: Recorder, cuda: bool):
        self.args, self.rec, self.cuda = args, rec, cuda

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def run_part(bench: "Bench", part: str, fn) -> None:
    """Run one part of a benchmark: an exception is recorded under ``part`` (the run goes on with the next part),
    memory is freed after it, and the time it took is printed. Shared by the device benchmarks."""
    t0 = time.time()
    try:
        fn()
    except Exception:
        bench.rec.error(part, "part")
    bench.free()
    print(f"part {part}: {time.time() - t0:.0f} s; {bench.rec.left():.0f} s left", flush=True)


def start_run(a: argparse.Namespace, recorder_cls: type, settings: dict) -> "Bench":
    """The start every part-wise benchmark shares, from arguments :func:`finish_run_args` checked: ``a.out`` made,
    one intra-op thread for a tiny CPU run (a second only adds contention on a shared machine), the recorder
    (``recorder_cls``, extending an existing file; its settings ``tiny`` and the model ``shape``, then ``settings``),
    the :class:`Bench` and the stack (:func:`stack_versions`). Returns the Bench (its ``rec`` is the recorder)."""
    os.makedirs(a.out, exist_ok=True)
    if a.tiny and a.device == "cpu":
        torch.set_num_threads(1)
    rec = recorder_cls(a.out, a.budget_s, {"tiny": a.tiny, "shape": asdict(TINY if a.tiny else Shape()), **settings})
    bench = Bench(a, rec)
    rec.stack = stack_versions(bench.cuda)
    return bench


def run_parts(bench: "Bench", runners: dict) -> int:
    """Run ``bench.args.only`` in the order asked, each through :func:`run_part` with ``runners[part]`` (a function
    of no arguments), then save and print the markdown. Returns 0 (a part's error is in the results, not the exit
    status)."""
    for part in bench.args.only:
        run_part(bench, part, runners[part])
    bench.rec.save()
    with open(os.path.join(bench.rec.out_dir, f"{bench.rec.stem}.md")) as f:
        print(f.read())
    return 0


# ------------------------------------------------------------------------------------------------ table cells


def value_of(entry, field: str):
    """``entry[field]`` of a measurement; ``None`` for a skip (a string), an error or a missing entry."""
    return entry.get(field) if isinstance(entry, dict) else None


def compare_row(name: str, ours, peer: str, peer_ms, **extra) -> dict:
    """``{name, ours_ms, peer, peer_ms, ratio}`` with ratio = ours / peer (``None`` when a side is missing) and
    ``extra``."""
    ratio = ours / peer_ms if ours is not None and peer_ms else None
    return {"name": name, "ours_ms": ours, "peer": peer, "peer_ms": peer_ms, "ratio": ratio, **extra}


def fmt(x, digits: int = 3) -> str:
    """A table cell: ``—`` for None, a float to ``digits`` significant digits (whole below 1000 or not), else str."""
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


# ------------------------------------------------------------------------------------------------ the model


@dataclass
class Shape:
    """The model shape both implementations are built with (see the module docstring)."""

    vocab_size: int = 32000
    hidden_size: int = 1024
    num_hidden_layers: int = 16
    num_attention_heads: int = 8
    kv_lora_rank: int = 256
    head_dim: int = 128  # MLA value (and our query/key) head dim; native's nope part of the key
    native_rope_dim: int = 64  # native's shared key part (transformers default)
    kda_num_heads: int = 8
    kda_head_dim: int = 128
    num_experts: int = 64
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    intermediate_size: int = 2816

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.num_hidden_layers)]




TINY = Shape(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, kv_lora_rank=32,
             head_dim=16, native_rope_dim=8, kda_num_heads=2, kda_head_dim=16, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, intermediate_size=128)


def build_kdamoe(shape: Shape, device, dtype, moe_latent_size: int | None = None, attnres_num_blocks: int = 0):
    """``KDAMoEForCausalLM`` of ``shape``; by default no latent experts and no AttnRes (the native model has
    neither); ``moe_latent_size`` / ``attnres_num_blocks`` turn them on (the training recipe's shape)."""
    from kdamoe import KDAMoEConfig, KDAMoEForCausalLM  # noqa: PLC0415  (kernels-only benchmarks never build it)

    cfg = KDAMoEConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       num_hidden_layers=shape.num_hidden_layers, layer_types=shape.layer_types,
                       num_attention_heads=shape.num_attention_heads, kv_lora_rank=shape.kv_lora_rank,
                       qk_head_dim=shape.head_dim, v_head_dim=shape.head_dim, kda_num_heads=shape.kda_num_heads,
                       kda_head_dim=shape.kda_head_dim, num_experts=shape.num_experts,
                       num_experts_per_tok=shape.num_experts_per_tok, num_shared_experts=1,
                       moe_intermediate_size=shape.moe_intermediate_size, moe_latent_size=moe_latent_size,
                       first_k_dense_replace=1, intermediate_size=shape.intermediate_size,
                       attnres_num_blocks=attnres_num_blocks,
                       max_position_embeddings=1 << 20, kernel_backend="auto", pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: the CPU takes tens of seconds for 1.7B parameters
        model = KDAMoEForCausalLM(cfg)
    return model.to(dtype).eval()


def build_native(shape: Shape, device, dtype):
    """transformers' ``KimiLinearForCausalLM`` of ``shape`` (transformers defaults otherwise; fla kernels when
    installed)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: PLC0415  (only the native side needs it)

    cfg = KimiLinearConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                           intermediate_size=shape.intermediate_size, moe_intermediate_size=shape.moe_intermediate_size,
                           num_hidden_layers=shape.num_hidden_layers, layer_types=shape.layer_types,
                           num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_attention_heads,
                           kv_lora_rank=shape.kv_lora_rank, qk_nope_head_dim=shape.head_dim,
                           qk_rope_head_dim=shape.native_rope_dim, v_head_dim=shape.head_dim,
                           num_local_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
                           n_shared_experts=1, linear_num_heads=shape.kda_num_heads, linear_head_dim=shape.kda_head_dim,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = KimiLinearForCausalLM(cfg)
    return model.to(dtype).eval()


class Bench:
    """What every measurement needs: device, dtype (bf16 on CUDA, float32 on the CPU), shape (``TINY`` with
    ``args.tiny``), a seeded id generator, the parsed ``args`` and the recorder."""

    def __init__(self, args, rec: Recorder):
        self.args, self.rec = args, rec
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.shape = TINY if args.tiny else Shape()
        self.gen = torch.Generator(device="cpu").manual_seed(0)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def ids(self, batch: int, T: int) -> torch.Tensor:
        """Random token ids ``[batch, T]`` away from the special ids 0-2."""
        return torch.randint(3, self.shape.vocab_size, (batch, T), generator=self.gen).to(self.device)

    def est(self, seconds_full: float) -> float:
        """Seconds a step needs in full mode (the deadline's yardstick); the tiny mode always fits."""
        return 0.0 if self.args.tiny else seconds_full


# ------------------------------------------------------------------------------------------------ profiles


LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")


def kernel_summary(prof, steps: int, top: int = 15) -> dict:
    """GPU work of a finished ``torch.profiler.profile`` over ``steps`` steps, parsed from its exported trace:
    summed kernel (and memcpy/memset) time per step (``kernel_ms``), kernels run per step, host launch calls
    per step by API name, and the ``top`` kernel names by time (``calls`` and ``us`` per step, ``share``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.get("name", "?"), []).append(float(e.get("dur", 0.0)))
    total_us = sum(sum(v) for v in by_name.values())
    table = sorted(({"name": n if len(n) <= 90 else n[:87] + "...", "calls": len(v) / steps, "us": sum(v) / steps,
                     "share": sum(v) / total_us if total_us else None} for n, v in by_name.items()),
                   key=lambda r: -r["us"])[:top]
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in LAUNCH_CALLS:
            launches[e["name"]] = launches.get(e["name"], 0) + 1 / steps
    return {"kernel_ms": total_us / steps / 1e3, "kernels_per_step": len(kernels) / steps,
            "launch_calls_per_step": launches, "table": table}
