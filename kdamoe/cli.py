"""Command-line entry points: ``kdamoe-train`` and ``kdamoe-generate`` (argument parsing only)."""

from __future__ import annotations

import argparse
import logging
import sys


def train_main(argv: list[str] | None = None) -> int:
    """``kdamoe-train [--config FILE] [--output-dir DIR] [--set key=value ...] [--no-resume] [--stop-after N]``."""
    parser = argparse.ArgumentParser(prog="kdamoe-train", description="Pretrain a KDAMoE model from a YAML config.")
    parser.add_argument("--config", default=None,
                        help="YAML file, or the name of one in kdamoe/configs/ (default: cpu_default.yaml)")
    parser.add_argument("--output-dir", default=None, help="overrides output_dir of the config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.stages.0.steps=10 (repeatable)")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in the output folder")
    parser.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                        help="stop after this many optimizer steps in total, as if killed (resume later)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from kdamoe.training import load_config, run

    overrides = list(args.overrides) + ([f"output_dir={args.output_dir}"] if args.output_dir else [])
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as err:
        parser.error(str(err))
    summary = run(cfg, resume=not args.no_resume, stop_after_steps=args.stop_after)
    return 0 if summary["finished"] or args.stop_after is not None else 1


def generate_main(argv: list[str] | None = None) -> int:
    """``kdamoe-generate --model DIR --prompt TEXT [--max-new-tokens N] [--greedy] [--chat] ...``: stream a continuation."""
    parser = argparse.ArgumentParser(prog="kdamoe-generate", description="Stream text from a saved KDAMoE folder.")
    parser.add_argument("--model", required=True, help="folder written by kdamoe-train (…/final) or a Hub id")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--greedy", action="store_true", help="greedy decoding instead of the folder's sampling settings")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = parser.parse_args(argv)
    _check_generate_args(parser, args)

    from kdamoe.training.export import generate_text, load_for_generation

    model, tokenizer = load_for_generation(args.model, args.device)
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
    import math
    from pathlib import Path

    import torch

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


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(train_main())
