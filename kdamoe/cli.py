"""Command-line entry points: ``kdamoe-train``, ``kdamoe-posttrain``, ``kdamoe-generate``, ``kdamoe-push`` and
``kdamoe-convert`` (argument parsing only)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import traceback
from pathlib import Path


def train_main(argv: list[str] | None = None) -> int:
    """``kdamoe-train [--config FILE] [--output-dir DIR] [--set key=value ...] [--no-resume] [--stop-after N]``."""
    parser = argparse.ArgumentParser(prog="kdamoe-train", description="Pretrain a KDAMoE model from a YAML config.")
    parser.add_argument("--config", default=None,
                        help="YAML file, or the name of one in kdamoe/configs/ (default: cpu_default.yaml)")
    parser.add_argument("--output-dir", default=None, help="overrides output_dir of the config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.stages.0.steps=10 (repeatable)")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in the output folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="on a fresh start, remove what an earlier pretraining run wrote into the output folder "
                             "(only that; without it a non-empty folder is refused)")
    parser.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                        help="stop after this many optimizer steps in total, as if killed (resume later)")
    args = parser.parse_args(argv)
    if args.stop_after is not None and args.stop_after < 1:
        parser.error(f"--stop-after must be >= 1 optimizer step (got {args.stop_after})")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from kdamoe.training import load_config, run  # noqa: PLC0415 (deferred: each entry point loads only its own job, after parsing its arguments)

    overrides = list(args.overrides) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as err:
        parser.error(str(err))
    summary = _user_errors_exit_2(parser, run, cfg, resume=not args.no_resume, stop_after_steps=args.stop_after,
                                  overwrite=args.overwrite)
    return 0 if summary["finished"] or args.stop_after is not None else 1


def _user_errors_exit_2(parser: argparse.ArgumentParser, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; a ``ValueError`` raised by kdamoe's own checks (a value, path or folder the user gave:
    its message names it and the fix) becomes ``parser.error`` (one line, exit 2). A ``ValueError`` from inside a
    library, and every other exception, keeps its traceback.

    A process group the job sets up (accelerate / TRL under ``torchrun``) is destroyed at interpreter exit
    (:func:`_destroy_process_group_at_exit`), not here: a process may run several jobs in turn in one group (the
    multi-run test harnesses do), and accelerate keeps its process state for the process's lifetime.
    """
    _destroy_process_group_at_exit()
    try:
        return fn(*args, **kwargs)
    except ValueError as err:
        if not _raised_by_kdamoe(err):
            raise
        parser.error(str(err))


_EXIT_HOOK = []


def _destroy_process_group_at_exit() -> None:
    """Register (once per process) an ``atexit`` hook that calls ``torch.distributed.destroy_process_group()`` when a
    default group exists. Left to interpreter finalization, gloo's worker threads can still hold work objects and a
    finished rank dies of ``terminate called without an active exception`` (SIGABRT; pytorch/pytorch#190489, seen
    on a 4-process CPU run); ``atexit`` hooks run while the interpreter is still whole."""
    if _EXIT_HOOK:
        return
    import atexit  # noqa: PLC0415 (deferred like the rest of this module's imports)

    def destroy() -> None:
        import torch.distributed as dist  # noqa: PLC0415 (only a process that ran a job gets here)

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)
    _EXIT_HOOK.append(destroy)


_THREADS_HELP = ("torch intra-op threads on the CPU (default 1: the small models gain ~20%% from a second thread "
                 "on an idle machine and lose several-fold when another job shares the cores)")


def _set_threads(parser: argparse.ArgumentParser, n: int) -> None:
    if n < 1:
        parser.error(f"--num-threads must be >= 1 (got {n})")
    import torch  # noqa: PLC0415 (deferred: `import kdamoe.cli` does not load torch; the entry points that use it do)

    torch.set_num_threads(n)


def posttrain_main(argv: list[str] | None = None) -> int:
    """``kdamoe-posttrain --config NAME|FILE [--output-dir DIR] [--set key=value ...] [--no-resume]``.

    Runs one TRL recipe (:func:`kdamoe.posttraining.run_recipe`); names resolve in ``kdamoe/configs/posttrain/``
    (``sft``, ``grpo``, ``grpo_tools``, ``grpo_single_turn``, ``dpo``, ``rloo``, ``ppo``). A bad config value
    is a usage error (exit 2) naming it. Prints the ``final/`` folder.
    """
    parser = argparse.ArgumentParser(prog="kdamoe-posttrain",
                                     description="Post-train a KDAMoE model with a TRL recipe from a YAML config.")
    parser.add_argument("--config", required=True,
                        help="YAML file, or the name of one in kdamoe/configs/posttrain/ (sft, grpo, dpo, rloo, ...)")
    parser.add_argument("--output-dir", default=None, help="overrides output_dir of the config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set trainer.max_steps=2 (repeatable)")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoint-N folders already in output_dir")
    parser.add_argument("--overwrite", action="store_true",
                        help="on a fresh start, remove what an earlier post-training run wrote into output_dir (only "
                             "that; without it a non-empty folder is refused)")
    parser.add_argument("--num-threads", type=int, default=1, help=_THREADS_HELP)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _set_threads(parser, args.num_threads)

    from kdamoe.posttraining import load_posttrain_config, run_recipe  # noqa: PLC0415 (deferred: each entry point loads only its own job, after parsing its arguments)

    overrides = list(args.overrides) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
    try:
        cfg = load_posttrain_config(args.config, overrides)
    except (ValueError, ImportError) as err:  # ImportError: the ppo recipe outside its venv (make ppo-env)
        parser.error(str(err))
    summary = _user_errors_exit_2(parser, run_recipe, cfg, resume=not args.no_resume, overwrite=args.overwrite)
    print(summary["final"])
    return 0


def _raised_by_kdamoe(err: BaseException) -> bool:
    """Whether ``err`` was raised in this package's own code (a check naming a value, whose message says it all),
    not inside TRL, transformers, accelerate or torch."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(Path(__file__).resolve().parent)


def posttrain_demo_main(argv: list[str] | None = None) -> int:
    """``kdamoe-posttrain-demo [--seeds N] [--base DIR] [--output-dir DIR] [--held-out N]``: what
    ``make posttrain`` runs.

    SFT then GRPO (and an SFT control trained for GRPO's wall time) in the key-hunt environment from the pretrained
    model, scored on the same held-out tasks (:mod:`kdamoe.posttraining.demo`). Exit 0 when the verdict holds (on
    every seed, the paired one-sided 95 % lower bound of GRPO's success minus SFT's, and minus the control's, is at
    least 5 points), else 1; 2 for a usage error.
    """
    parser = argparse.ArgumentParser(prog="kdamoe-posttrain-demo",
                                     description="SFT then GRPO in the key-hunt environment, scored on held-out tasks.")
    parser.add_argument("--seeds", type=int, default=1, help="run seeds 0..N-1 (default 1)")
    parser.add_argument("--base", default="outputs/cpu_default/final", help="the pretrained model folder (make train)")
    parser.add_argument("--output-dir", default="outputs/posttrain", help="where the stages and results.json go")
    parser.add_argument("--held-out", type=int, default=200, help="held-out tasks (each needs >= 2 tool calls)")
    parser.add_argument("--sft-set", dest="sft_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the shipped sft config (repeatable)")
    parser.add_argument("--grpo-set", dest="grpo_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the shipped grpo config (repeatable)")
    parser.add_argument("--num-threads", type=int, default=1, help=_THREADS_HELP)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _set_threads(parser, args.num_threads)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1 (got {args.seeds})")
    if args.held_out < 1:
        parser.error(f"--held-out must be >= 1 (got {args.held_out})")

    from kdamoe.posttraining.demo import run_demo  # noqa: PLC0415 (deferred: each entry point loads only its own job, after parsing its arguments)

    summary = _user_errors_exit_2(parser, run_demo, args.base, args.output_dir, seeds=tuple(range(args.seeds)),
                                  n_held_out=args.held_out, sft_overrides=args.sft_overrides,
                                  grpo_overrides=args.grpo_overrides)
    return 0 if summary["verdict"] else 1


def generate_main(argv: list[str] | None = None) -> int:
    """``kdamoe-generate --model DIR --prompt TEXT [--max-new-tokens N] [--greedy] [--chat] ...``: stream a
    continuation."""
    parser = argparse.ArgumentParser(prog="kdamoe-generate", description="Stream text from a saved KDAMoE folder.")
    parser.add_argument("--model", required=True, help="folder written by kdamoe-train (…/final) or a Hub id")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--greedy", action="store_true",
                        help="greedy decoding instead of the folder's sampling settings")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = parser.parse_args(argv)
    _check_generate_args(parser, args)

    from kdamoe.training.export import generate_text, load_for_generation  # noqa: PLC0415 (deferred: each entry point loads only its own job, after parsing its arguments)

    model, tokenizer = _user_errors_exit_2(parser, load_for_generation, args.model, args.device)
    kwargs = {"max_new_tokens": args.max_new_tokens}
    if args.greedy:
        kwargs.update(do_sample=False, temperature=None, top_k=None)
    for key in ("temperature", "top_k"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    generate_text(model, tokenizer, args.prompt, args.device, stream=True, chat=args.chat, seed=args.seed, **kwargs)
    return 0


def _check_generate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2, naming the value) for what transformers would reject only after loading the model,
    with a traceback: sampling settings, the device, and a local model path that is not an exported folder."""
    import torch  # noqa: PLC0415 (deferred: `import kdamoe.cli` does not load torch; the entry points that use it do)

    if args.temperature is not None and not (math.isfinite(args.temperature) and args.temperature > 0):
        parser.error(f"--temperature must be a finite number > 0 (got {args.temperature}); "
                     "use --greedy for deterministic decoding")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k must be >= 1 (got {args.top_k})")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a torch device (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda" and not _cuda():
        parser.error(f"--device {args.device} but this torch has no CUDA device; use --device cpu")
    folder = Path(args.model).expanduser()
    looks_local = folder.exists() or args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1
    if looks_local and not (folder / "config.json").is_file():
        hint = (f"; the exported model is {folder / 'final'}" if (folder / "final" / "config.json").is_file()
                else "; pass the final/ folder kdamoe-train wrote (checkpoints/ are training states) or a Hub id")
        parser.error(f"--model {args.model}: no config.json there{hint}")
    for name in ("tokenizer_config.json", "tokenizer.json"):
        if looks_local and not (folder / name).is_file():
            parser.error(f"--model {args.model}: no {name} there; generation needs the model's tokenizer in its "
                         "folder (tokenizer.save_pretrained(folder))")


def push_main(argv: list[str] | None = None) -> int:
    """``kdamoe-push SRC REPO_ID [--dry-run] [--private] [--revision R] [--create-pr] [--commit-message M] ...``.

    Builds the Hub folder of SRC, validates it without kdamoe, and uploads it (see :mod:`kdamoe.hub`).
    """
    parser = argparse.ArgumentParser(
        prog="kdamoe-push", description="Build, validate and upload the Hub folder of a model kdamoe wrote.")
    parser.add_argument("src", metavar="SRC", help="a pretraining final/ or checkpoints/stage<i>-step<n>/ folder, a "
                        "save_pretrained / trainer output_dir, or a PEFT adapter folder")
    parser.add_argument("repo_id", metavar="REPO_ID", help="namespace/name on the Hub")
    parser.add_argument("--dry-run", action="store_true",
                        help="build and validate, then print the files and the card metadata; no network")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    parser.add_argument("--commit-message", default=None)
    parser.add_argument("--adapter", action="store_true",
                        help="PEFT SRC: publish the adapter (with its own card) instead of merging it into its base")
    parser.add_argument("--base-model", default=None, help="Hub id of the model SRC was trained from (card base_model)")
    parser.add_argument("--base-model-path", default=None, help="PEFT SRC: local folder of the base model")
    parser.add_argument("--dataset", dest="datasets", action="append", default=None, metavar="NAME",
                        help="card datasets entry (repeatable; replaces what SRC records)")
    parser.add_argument("--training-description", default=None, help="a paragraph for the card's Training section")
    parser.add_argument("--license", default="apache-2.0")
    parser.add_argument("--out-dir", default=None, help="keep the built folder here (must be empty or absent)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from kdamoe.common.cards import check_repo_id  # noqa: PLC0415 (deferred: huggingface_hub loads after the arguments parse)

    try:
        check_repo_id(args.repo_id, "REPO_ID")
    except ValueError as err:
        parser.error(str(err))
    from kdamoe.hub import detect_source, push_to_hub  # noqa: PLC0415 (deferred: each entry point loads only its own job, after parsing its arguments)
    try:
        source = detect_source(args.src)
    except ValueError as err:
        parser.error(str(err))
    if args.adapter and source.kind != "peft-adapter":
        parser.error(f"--adapter: SRC {args.src} is not a PEFT adapter folder (no adapter_config.json)")
    if args.base_model_path and source.kind != "peft-adapter":
        parser.error(f"--base-model-path: SRC {args.src} is not a PEFT adapter folder")
    _user_errors_exit_2(parser, push_to_hub, args.src, args.repo_id, private=args.private or None,
                        revision=args.revision, create_pr=args.create_pr, commit_message=args.commit_message,
                        dry_run=args.dry_run, out_dir=args.out_dir, merge_adapter=not args.adapter,
                        base_model=args.base_model, base_model_path=args.base_model_path, datasets=args.datasets,
                        training_description=args.training_description, license=args.license)
    if not args.dry_run:
        print(f"pushed to https://huggingface.co/{args.repo_id}" + (f" ({args.revision})" if args.revision else ""))
    return 0


def _cuda() -> bool:
    import torch  # noqa: PLC0415 (deferred: `import kdamoe.cli` does not load torch; the entry points that use it do)

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(train_main())


def convert_main(argv: list[str] | None = None) -> int:
    """``kdamoe-convert SRC DST --to {kimi_linear,kimi_k3,kda_moe} [--overwrite] [--max-shard-size SIZE]
    [--experts-dtype {mxfp4,bf16}]``.

    Rewrites a checkpoint between Moonshot's Kimi Linear or Kimi K3 format and kdamoe's, shard by shard
    (:func:`kdamoe.conversion.convert_checkpoint`); prints DST. A bad argument, a config the target format cannot
    represent or a checkpoint that does not match its config is a usage error (one line, exit 2).
    """
    parser = argparse.ArgumentParser(
        prog="kdamoe-convert",
        description="Convert a checkpoint between Kimi Linear (transformers' kimi_linear) or Kimi K3 (kimi_k3, its "
                    "text model) and kdamoe (kda_moe).")
    parser.add_argument("src", metavar="SRC", help="the source folder or Hub id (safetensors weights + config.json)")
    parser.add_argument("dst", metavar="DST", help="the output folder (absent or empty, unless --overwrite)")
    parser.add_argument("--to", required=True, choices=("kimi_linear", "kimi_k3", "kda_moe"),
                        help="target format: kda_moe reads a Kimi Linear or Kimi K3 SRC, kimi_linear and kimi_k3 a "
                             "kdamoe SRC")
    parser.add_argument("--experts-dtype", default=None, choices=("mxfp4", "bf16"),
                        help="--to kimi_k3 only: routed experts re-quantised to MXFP4 (default, as released) or "
                             "bfloat16")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST once the conversion is done")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    args = parser.parse_args(argv)
    if args.experts_dtype is not None and args.to != "kimi_k3":
        parser.error(f"--experts-dtype {args.experts_dtype}: only --to kimi_k3 writes quantised experts "
                     f"(got --to {args.to})")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from kdamoe.conversion import convert_checkpoint  # noqa: PLC0415 (deferred: each entry point loads only its own job, after parsing its arguments)

    out = _user_errors_exit_2(parser, convert_checkpoint, args.src, args.dst, to=args.to, overwrite=args.overwrite,
                              max_shard_size=args.max_shard_size, experts_format=args.experts_dtype or "mxfp4")
    print(out)
    return 0
