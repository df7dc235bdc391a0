"""Which cheaper router linear keeps the top-k expert sets? Measured on real activations of a trained model (CPU).

Issue #40, Deliver 2 asks for the router's float32 GEMMs to be replaced by something at a fraction of the time that
changes at most 0.1 % of the top-k sets. This script answers the precision half on the CPU; the timing half is
``bench_moe.py --router-linear`` (GPU).

What it does:

1. Trains a small model with the pretraining job itself (``kdamoe.training.run``: ``cpu_default.yaml`` with the
   overrides in :data:`TRAIN_OVERRIDES`, i.e. our 1.68 B shape's 64 experts top-8 in a 2-layer model, Quantile
   Balancing on, on the Shakespeare plays that ``make data`` fetches), or takes an exported model (``--model DIR``).
2. Runs the held-out plays of ``cpu_default.yaml`` (``data.val_documents``, never trained on) through it and records,
   with a forward pre-hook on every ``KDAMoETopkRouter``, the router inputs ``x [T, d]``, its weight ``W [E, d]`` and
   its ``e_score_correction_bias b [E]``.
3. Computes the router logits ``x Wᵀ`` of every candidate (:data:`CANDIDATES`) from the same ``x`` and ``W`` and
   selects experts as the model does (``moe_torch.moe_route_torch``: ``s = σ(logits)``, the top-k of ``s + b``,
   weights ``p_j = c·s_j / Σ_{r∈T} s_r``), then compares each candidate's sets with those of float64 (the exact
   reference) and of float32 (today's op): :func:`compare_topk`.

How the candidates are emulated on the CPU. A tensor-core GEMM on bf16 (fp16) operands multiplies two 8-bit (11-bit)
significands exactly (the product fits float32's 24 bits) and adds the products in a float32 accumulator. So
``x.bfloat16().float() @ W.bfloat16().float().T`` computed in float32 is the same arithmetic up to the order of the
additions (cuBLAS splits K differently from the CPU's sgemm); the same products summed in float64 and rounded once
to float32 (``*_exact_acc``) bound what any accumulation order can do. If the two agree, the rounding of the inputs,
not the accumulation, decides the top-k changes. TF32 rounds both operands to a 10-bit mantissa (emulated: round to
nearest even) and accumulates in float32. ``bf16_out`` is a bf16 GEMM that also rounds its output to bf16 (what a
plain ``F.linear`` on bf16 tensors, e.g. under autocast, returns). ``bf16x3`` splits both operands into a bf16 high
part and a bf16 remainder and adds three of the four products (about 16 significant bits per operand; the dropped
``lo·lo`` term is ~2^-16 relative): on a GPU one bf16 GEMM over K = 3d, as emulated here, or three summed in
float32 (``bench_moe.RouterLinearBF16x3``; two when x is already bf16).

For scale, how far training moved the routers: the same measurement on the model at initialisation (same config and
seed), and per layer the expert-load spread and the gap between the k-th and (k+1)-th biased score (the margin a
rounding must cover). Quantile Balancing keeps the load near uniform by design, so the load spread shows balance;
the margins show how decisive the trained routers are.

Not measured: Kimi K3's or any released Kimi model's router (d = 7,168, E = 896 top-16): their weights and
activations are not on this machine, and random ones would measure near-ties that a trained router does not have.
A larger E with the same input rounding puts more experts near the k-th score; the GPU run should repeat this
comparison on a trained checkpoint of that shape.

Usage::

    python benchmarks/router_precision.py                 # train, collect, compare, write (3-9 min, 1 thread)
    python benchmarks/router_precision.py --model DIR     # an exported model folder instead of training
    python benchmarks/router_precision.py --steps 50 --tokens 4096 --out bench_out   # a quick look

Writes ``router_precision_cpu.{json,md}`` into ``--out`` (default ``benchmarks/results``).
"""

import argparse
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import commit, write_results  # noqa: E402  (the benchmarks folder is not a package; sys.path above)

from kdamoe.training.config import load_config  # noqa: E402  (harness puts the repository on sys.path)

# The pretraining job's default config with our 1.68 B shape's routing (64 experts, top-8) and one short stage.
TRAIN_OVERRIDES = [
    "model.num_experts=64",
    "model.num_experts_per_tok=8",
    "model.moe_intermediate_size=64",
    "train.checkpoint_every=0",
    "eval.max_rows=4",
    "generate.prompts=[]",
]

# candidate name -> (what it is, function of (x float32 [T, d], W float32 [E, d]) -> float32 logits [T, E])
CANDIDATES = {}


def _candidate(name, text):
    def register(fn):
        CANDIDATES[name] = (text, fn)
        return fn
    return register


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to TF32's 10-bit mantissa (round to nearest, ties to even), still float32.

    Works on the bit pattern: adds half a unit of the last kept bit (minus one, plus the kept bit's parity, which
    makes ties go to even) and clears the 13 dropped bits. Finite inputs below float32's largest only.

    Raises:
        ValueError: ``t`` is not float32.
    """
    if t.dtype != torch.float32:
        raise ValueError(f"round_tf32 needs float32, got {t.dtype}")
    bits = t.contiguous().view(torch.int32)
    keep_lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + keep_lsb) & ~0x1FFF
    return rounded.view(torch.float32)


@_candidate("float32", "float32 x · float32 W, float32 accumulation (today's router op)")
def _fp32(x, w):
    return F.linear(x.float(), w.float())


@_candidate("bf16_fp32_acc", "bf16 x · bf16 W, float32 accumulation (a tensor-core GEMM with float32 output)")
def _bf16(x, w):
    return x.bfloat16().float() @ w.bfloat16().float().T


@_candidate("bf16_exact_acc", "bf16 x · bf16 W, products summed in float64, one rounding to float32")
def _bf16_exact(x, w):
    return (x.bfloat16().double() @ w.bfloat16().double().T).float()


@_candidate("bf16_out", "bf16 x · bf16 W, float32 accumulation, output rounded to bf16")
def _bf16_out(x, w):
    return (x.bfloat16().float() @ w.bfloat16().float().T).bfloat16().float()


@_candidate("fp16_fp32_acc", "fp16 x · fp16 W, float32 accumulation")
def _fp16(x, w):
    return x.half().float() @ w.half().float().T


@_candidate("tf32", "x and W rounded to TF32 (10-bit mantissa), float32 accumulation")
def _tf32(x, w):
    return round_tf32(x.float()) @ round_tf32(w.float()).T


def _split_bf16(t):
    hi = t.bfloat16().float()
    return hi, (t - hi).bfloat16().float()


@_candidate("bf16x3", "x = x_hi + x_lo, W = W_hi + W_lo in bf16; x_hi·W_hi + x_hi·W_lo + x_lo·W_hi, float32 "
            "accumulation (3 bf16 products: one bf16 GEMM over K = 3d)")
def _bf16x3(x, w):
    x_hi, x_lo = _split_bf16(x.float())
    w_hi, w_lo = _split_bf16(w.float())
    return torch.cat([x_hi, x_hi, x_lo], 1) @ torch.cat([w_hi, w_lo, w_hi], 1).T


@_candidate("bf16x_fp32w", "bf16 x · float32 W, float32 accumulation")
def _bf16x(x, w):
    return x.bfloat16().float() @ w.float().T


# ----------------------------------------------------------------------------------------------------------
# selection and comparison
# ----------------------------------------------------------------------------------------------------------
def select_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float = 1.0):
    """The model's expert choice from router logits (``moe_torch.moe_route_torch``, without the statistics).

    Args:
        logits: ``[T, E]`` float32 or float64; the selection runs in this dtype (float32 is what the model does).
        bias: ``[E]`` the ``e_score_correction_bias`` (cast to ``logits.dtype``).
        top_k: experts per token, ``1 <= top_k <= E``.
        scaling: the routed scaling factor ``c`` of the weights.
    Returns:
        ``(index [T, k] int64, weights [T, k])``: the top-k of ``σ(logits) + bias`` (descending) and
        ``c·σ_j / Σ_{r∈T} σ_r`` in ``logits.dtype``.
    Raises:
        ValueError: ``logits`` not 2-D floating, ``bias`` not ``[E]``, or ``top_k`` outside ``[1, E]``.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [T, E], got {tuple(logits.shape)} {logits.dtype}")
    num_experts = logits.shape[1]
    if tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must be [E={num_experts}], got {tuple(bias.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    scores = torch.sigmoid(logits)
    index = (scores + bias.to(logits.dtype)).topk(top_k, dim=-1).indices
    chosen = scores.gather(1, index)
    return index, chosen / chosen.sum(-1, keepdim=True) * scaling


def compare_topk(ref_logits: torch.Tensor, cand_logits: torch.Tensor, bias: torch.Tensor, top_k: int,
                 scaling: float = 1.0) -> dict:
    """How many top-k expert sets a candidate's logits change against a reference's (both selected by
    :func:`select_topk`, each in its own dtype).

    Args:
        ref_logits, cand_logits: ``[T, E]`` float logits of the same tokens.
        bias, top_k, scaling: as :func:`select_topk`.
    Returns:
        ``tokens`` T; ``sets_changed`` tokens whose set (order ignored) differs; ``slots_changed`` (token, slot)
        assignments that differ, i.e. ``Σ_t |ref_t \\ cand_t|`` out of ``T·k``; their fractions ``set_change_frac``
        and ``slot_change_frac``; on the tokens whose set is unchanged, the largest and the mean absolute change of
        the normalised weight of an expert (``weight_max_abs_diff``, ``weight_mean_abs_diff``, each expert compared
        with itself; 0 when no set is unchanged); ``logits_max_abs_diff`` and ``logits_rel_l2``
        (``‖cand − ref‖ / ‖ref‖``).
    Raises:
        ValueError: the two logits differ in shape, or see :func:`select_topk`.
    """
    if ref_logits.shape != cand_logits.shape:
        raise ValueError(f"logits shapes differ: reference {tuple(ref_logits.shape)}, candidate "
                         f"{tuple(cand_logits.shape)}")
    ref_index, ref_weights = select_topk(ref_logits, bias, top_k, scaling)
    cand_index, cand_weights = select_topk(cand_logits, bias, top_k, scaling)
    T, E = ref_logits.shape
    # membership masks make the comparison order-free: a slot is changed when its reference expert is not chosen
    ref_mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ref_index, True)
    cand_mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, cand_index, True)
    lost = (ref_mask & ~cand_mask).sum(-1)
    same = lost == 0
    w_max = w_mean = 0.0
    if same.any():
        # the same set in another order: sort each row's experts so that every expert meets itself
        r_order = ref_index[same].sort(-1)
        c_order = cand_index[same].sort(-1)
        rw = ref_weights[same].gather(1, r_order.indices).double()
        cw = cand_weights[same].gather(1, c_order.indices).double()
        diff = (rw - cw).abs()
        w_max, w_mean = diff.max().item(), diff.mean().item()
    delta = cand_logits.double() - ref_logits.double()
    sets_changed, slots_changed = int((~same).sum()), int(lost.sum())
    return {
        "tokens": T, "sets_changed": sets_changed, "slots_changed": slots_changed,
        "set_change_frac": sets_changed / T, "slot_change_frac": slots_changed / (T * top_k),
        "weight_max_abs_diff": w_max, "weight_mean_abs_diff": w_mean,
        "logits_max_abs_diff": delta.abs().max().item(),
        "logits_rel_l2": (delta.norm() / ref_logits.double().norm().clamp_min(1e-300)).item(),
    }


def margins(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T]`` float64 gap between the k-th and the (k+1)-th biased score ``σ(logits) + b`` (the distance a
    rounding must cover to change a set). Needs ``top_k < E``."""
    top = (torch.sigmoid(logits.double()) + bias.double()).topk(top_k + 1, dim=-1).values
    return top[:, top_k - 1] - top[:, top_k]


def load_spread(index: torch.Tensor, num_experts: int) -> dict:
    """Per-expert share of the (token, slot) assignments in ``index [T, k]``, against the uniform ``1/E``: the
    largest and smallest share over ``1/E`` and the coefficient of variation of the shares."""
    counts = torch.bincount(index.flatten(), minlength=num_experts).double()
    share = counts / counts.sum()
    return {"max_over_uniform": (share.max() * num_experts).item(),
            "min_over_uniform": (share.min() * num_experts).item(),
            "cv": (share.std(unbiased=False) / share.mean()).item()}


# ----------------------------------------------------------------------------------------------------------
# model and activations
# ----------------------------------------------------------------------------------------------------------
def train_config(work: str, steps: int, data_path: str, extra: list[str] | None = None):
    """The run config of the model this script trains (``cpu_default.yaml`` + :data:`TRAIN_OVERRIDES`, one stage,
    then ``extra`` overrides such as ``model.num_experts=256``)."""
    stage = (f"train.stages=[{{name: router, seq_len: 128, batch_size: 8, steps: {steps}, lr: 5.0e-3, "
             f"warmup_steps: {max(1, steps // 20)}}}]")
    return load_config(None, [*TRAIN_OVERRIDES, stage, f"output_dir={work}", f"data.path={data_path}",
                              *(extra or [])])


def untrained_model(cfg, tokenizer):
    """The model of ``cfg`` at initialisation (the pretraining job's ``build_model`` after seeding with
    ``cfg.seed``), eval mode: the routers' starting point, for comparison."""
    from transformers import set_seed  # noqa: PLC0415  (as train_model)

    from kdamoe.training.trainer import build_model  # noqa: PLC0415  (as train_model)

    set_seed(cfg.seed)
    return build_model(cfg, tokenizer).float().eval()


def train_model(work: str, steps: int, data_path: str, extra: list[str] | None = None) -> tuple[str, dict]:
    """Train the small model with the pretraining job; return its exported folder and the job's summary."""
    from kdamoe.training import run  # noqa: PLC0415  (the training stack is imported only when training)

    summary = run(train_config(work, steps, data_path, extra), resume=False, overwrite=True)
    print(f"trained: val ppl {summary['before']['ppl']:.1f} -> {summary['after']['ppl']:.1f} "
          f"(bigram {summary['bigram']['ppl']:.1f}) in {summary['seconds']:.0f} s", flush=True)
    return summary["final_dir"], summary


def held_out_rows(tokenizer, data_path: str, seq_len: int, max_tokens: int) -> tuple[torch.Tensor, list[str]]:
    """``[N, seq_len]`` token ids of ``cpu_default.yaml``'s held-out plays (whole rows only, at most ``max_tokens``)
    and the plays' names."""
    from kdamoe.training.corpus import load_corpus  # noqa: PLC0415  (as above)
    from kdamoe.training.data import pack_documents, tokenize_documents  # noqa: PLC0415  (as above)

    cfg = load_config(None, [f"data.path={data_path}"])
    _, val_docs = load_corpus(cfg.data, cfg.seed)
    ids = tokenize_documents(tokenizer, [d.text for d in val_docs], tokenizer.bos_token_id, tokenizer.eos_token_id)
    rows = pack_documents(ids, seq_len, tokenizer.pad_token_id, drop_last=True)["input_ids"]
    return rows[: max(1, max_tokens // seq_len)], [d.name for d in val_docs]


@torch.no_grad()
def collect_router_inputs(model, rows: torch.Tensor, batch_size: int = 8) -> list[dict]:
    """Run ``rows`` through ``model`` (eval mode) and return, per MoE router in layer order, ``x [T, d]`` float32
    (its inputs), ``weight [E, d]``, ``bias [E]`` float32, ``top_k`` and ``scaling``."""
    routers = [m for m in model.modules() if type(m).__name__ == "KDAMoETopkRouter"]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no KDAMoETopkRouter: nothing to measure")
    seen = [[] for _ in routers]
    hooks = [r.register_forward_pre_hook(lambda _m, args, i=i: seen[i].append(args[0].detach().float().clone()))
             for i, r in enumerate(routers)]
    try:
        model.eval()
        for start in range(0, rows.shape[0], batch_size):
            model(input_ids=rows[start:start + batch_size])
    finally:
        for h in hooks:
            h.remove()
    return [{"x": torch.cat(s), "weight": r.weight.detach().float().clone(),
             "bias": r.e_score_correction_bias.detach().float().clone(), "top_k": r.top_k,
             "scaling": float(r.scaling)} for s, r in zip(seen, routers, strict=True)]


# ----------------------------------------------------------------------------------------------------------
# the measurement
# ----------------------------------------------------------------------------------------------------------
def measure(layers: list[dict]) -> dict:
    """Every candidate against float64 and against float32, per layer and summed over layers."""
    per_layer = []
    for i, layer in enumerate(layers):
        x, w, b, k, c = layer["x"], layer["weight"], layer["bias"], layer["top_k"], layer["scaling"]
        ref64 = x.double() @ w.double().T
        ref32 = CANDIDATES["float32"][1](x, w)
        ref_index, _ = select_topk(ref64, b.double(), k, c)
        gap = margins(ref64, b, k)
        entry = {"layer": i, "tokens": x.shape[0], "d": x.shape[1], "experts": w.shape[0], "top_k": k,
                 "load": load_spread(ref_index, w.shape[0]),
                 "bias_range": [b.min().item(), b.max().item()],
                 "margin_quantiles": {q: torch.quantile(gap, float(q)).item() for q in ("0.001", "0.01", "0.5")},
                 "margin_below": {t: (gap < float(t)).double().mean().item() for t in ("1e-5", "1e-4", "1e-3")},
                 "vs_float64": {}, "vs_float32": {}}
        logits = {}
        for name, (_, fn) in CANDIDATES.items():
            logits[name] = cand = fn(x, w)
            entry["vs_float64"][name] = compare_topk(ref64, cand, b, k, c)
            if name != "float32":
                entry["vs_float32"][name] = compare_topk(ref32, cand, b, k, c)
        # the same bf16 products summed in float32 vs summed exactly: what the order of the additions alone changes
        entry["accumulation_only"] = compare_topk(logits["bf16_exact_acc"], logits["bf16_fp32_acc"], b, k, c)
        per_layer.append(entry)
    total = {}
    for ref in ("vs_float64", "vs_float32"):
        total[ref] = {}
        for name in per_layer[0][ref]:
            rows = [layer[ref][name] for layer in per_layer]
            tokens = sum(r["tokens"] for r in rows)
            slots = sum(r["tokens"] * layer["top_k"] for r, layer in zip(rows, per_layer, strict=True))
            sets, lost = sum(r["sets_changed"] for r in rows), sum(r["slots_changed"] for r in rows)
            total[ref][name] = {"tokens": tokens, "sets_changed": sets, "slots_changed": lost,
                                "set_change_frac": sets / tokens, "slot_change_frac": lost / slots,
                                "weight_max_abs_diff": max(r["weight_max_abs_diff"] for r in rows),
                                "logits_rel_l2_max": max(r["logits_rel_l2"] for r in rows)}
    return {"per_layer": per_layer, "total": total}


def _pct(v: float) -> str:
    return f"{100 * v:.4f} %"


def report(result: dict, header: str) -> str:
    """The markdown page of one run."""
    meta, per_layer, total = result["meta"], result["per_layer"], result["total"]
    lines = ["# Router linear precision: top-k sets of cheaper GEMMs on real activations (CPU)", "", header, "",
             f"Model: {meta['model']}. Held-out text: {', '.join(meta['held_out'])} ({meta['tokens']} tokens per "
             f"layer, rows of {meta['seq_len']}). Each MoE layer's router: d = {per_layer[0]['d']}, "
             f"E = {per_layer[0]['experts']}, top-{per_layer[0]['top_k']}. Selection as the model's router op: top-k "
             "of σ(logits) + e_score_correction_bias; weights normalised over the set. Candidate logits are "
             "selected in float32, float64's in float64.", "",
             "## Against float64 (the exact reference) and against float32 (today's op), all MoE layers", "",
             "| candidate | sets changed vs float64 | slots changed vs float64 | sets changed vs float32 | "
             "slots changed vs float32 | max Δ weight, unchanged sets (vs float32) | logits rel. L2 (vs float64) |",
             "|---|---|---|---|---|---|---|"]
    for name, (text, _) in CANDIDATES.items():
        a = total["vs_float64"][name]
        b = total["vs_float32"].get(name)
        lines.append(f"| `{name}`: {text} | {a['sets_changed']} ({_pct(a['set_change_frac'])}) | "
                     f"{a['slots_changed']} ({_pct(a['slot_change_frac'])}) | "
                     + (f"{b['sets_changed']} ({_pct(b['set_change_frac'])}) | {b['slots_changed']} "
                        f"({_pct(b['slot_change_frac'])}) | {b['weight_max_abs_diff']:.2e} | "
                        if b else "— | — | — | ")
                     + f"{a['logits_rel_l2_max']:.2e} |")
    lines += ["", "## Per layer (sets changed against float32, of the layer's tokens)", "",
              "| layer | tokens | " + " | ".join(f"`{n}`" for n in CANDIDATES if n != "float32") + " |",
              "|---|---|" + "---|" * (len(CANDIDATES) - 1)]
    for layer in per_layer:
        lines.append(f"| {layer['layer']} | {layer['tokens']} | " + " | ".join(
            f"{v['sets_changed']} ({_pct(v['set_change_frac'])})" for v in layer["vs_float32"].values()) + " |")
    acc = [layer["accumulation_only"] for layer in per_layer]
    lines += ["", f"Accumulation alone: `bf16_fp32_acc` against `bf16_exact_acc` (the same bf16 products, summed in "
              f"float32 or exactly) changes {sum(a['sets_changed'] for a in acc)} of "
              f"{sum(a['tokens'] for a in acc)} sets (logits rel. L2 at most "
              f"{max(a['logits_rel_l2'] for a in acc):.1e}): the rounding of the inputs decides."]
    lines += ["", "## Are the routers trained? Load and margins per layer (float64 selection)", "",
              "| layer | load max / uniform | load min / uniform | load CV | bias range | margin k vs k+1: "
              "0.1 % / 1 % / 50 % quantile | tokens with margin < 1e-5 / 1e-4 / 1e-3 |",
              "|---|---|---|---|---|---|---|"]
    for layer in per_layer:
        ld, q, m = layer["load"], layer["margin_quantiles"], layer["margin_below"]
        lines.append(f"| {layer['layer']} | {ld['max_over_uniform']:.2f} | {ld['min_over_uniform']:.2f} | "
                     f"{ld['cv']:.3f} | [{layer['bias_range'][0]:.3g}, {layer['bias_range'][1]:.3g}] | "
                     f"{q['0.001']:.2e} / {q['0.01']:.2e} / {q['0.5']:.2e} | "
                     f"{_pct(m['1e-5'])} / {_pct(m['1e-4'])} / {_pct(m['1e-3'])} |")
    if "untrained" in result:
        u = result["untrained"]
        lines += ["", "The same model at initialisation (same config and seed, routers untrained, bias 0), on the same "
                  "text: sets changed against float32, all layers, and the margins per layer.", "",
                  "| candidate | sets changed vs float32, trained | untrained |", "|---|---|---|"]
        for name in u["total"]["vs_float32"]:
            a, b = total["vs_float32"][name], u["total"]["vs_float32"][name]
            lines.append(f"| `{name}` | {_pct(a['set_change_frac'])} | {_pct(b['set_change_frac'])} |")
        lines += ["", "| layer (untrained) | load max / uniform | load CV | margin 0.1 % / 1 % / 50 % quantile |",
                  "|---|---|---|---|"]
        for layer in u["per_layer"]:
            q = layer["margin_quantiles"]
            lines.append(f"| {layer['layer']} | {layer['load']['max_over_uniform']:.2f} | {layer['load']['cv']:.3f} | "
                         f"{q['0.001']:.2e} / {q['0.01']:.2e} / {q['0.5']:.2e} |")
    if meta.get("training"):
        t = meta["training"]
        lines += ["", f"Training: {t['steps']} steps of 8 × 128 tokens; validation perplexity {t['ppl_before']:.1f} "
                  f"(untrained) → {t['ppl_after']:.1f} (token bigram: {t['ppl_bigram']:.1f}), {t['seconds']:.0f} s."]
    lines += ["", "Not measured: Kimi K3's or a released Kimi model's router shape (d = 7,168, E = 896 top-16): no "
              "trained weights or activations of that shape are on this machine.", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="an exported model folder (kdamoe-train's final/); default: train one")
    parser.add_argument("--steps", type=int, default=400, help="training steps of 8 × 128 tokens (default 400)")
    parser.add_argument("--data", default="data/shakespeare", help="the corpus folder (make data)")
    parser.add_argument("--work", default="runs/router_precision", help="the training run's folder (overwritten)")
    parser.add_argument("--tokens", type=int, default=65536, help="held-out tokens per layer, at most (default 65536)")
    parser.add_argument("--seq-len", type=int, default=512, help="held-out row length (default 512)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="results folder (default benchmarks/results)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more override of the trained model's config, e.g. model.num_experts=256 (repeatable)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as the training job)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tokens < args.seq_len:
        parser.error(f"--steps must be >= 1 and --tokens >= --seq-len, got {args.steps}, {args.tokens}")
    if args.model and args.set:
        parser.error(f"--set {args.set} changes the model this script trains; --model {args.model} is trained already")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    training = None
    folder = args.model
    if folder is None:
        folder, summary = train_model(args.work, args.steps, args.data, args.set)
        torch.set_num_threads(args.threads)  # the training job set its own (train.num_threads)
        training = {"steps": args.steps, "ppl_before": summary["before"]["ppl"],
                    "ppl_after": summary["after"]["ppl"], "ppl_bigram": summary["bigram"]["ppl"],
                    "seconds": summary["seconds"]}
    from kdamoe.training.export import load_for_generation  # noqa: PLC0415  (as train_model)

    model, tokenizer = load_for_generation(folder, "cpu")
    rows, names = held_out_rows(tokenizer, args.data, args.seq_len, args.tokens)
    layers = collect_router_inputs(model.float(), rows)
    print(f"collected {len(layers)} routers × {layers[0]['x'].shape[0]} tokens in {time.time() - t0:.0f} s",
          flush=True)
    result = measure(layers)
    if training:
        # the same measurement on the routers at initialisation: how far training moved them
        init_cfg = train_config(args.work, args.steps, args.data, args.set)
        init_layers = collect_router_inputs(untrained_model(init_cfg, tokenizer), rows)
        result["untrained"] = measure(init_layers)
    result["meta"] = {"model": "trained here with kdamoe.training.run (cpu_default.yaml + "
                               + ", ".join([*TRAIN_OVERRIDES, *args.set]) + f", {args.steps} steps)" if training else
                      f"the exported folder given by --model ({os.path.basename(os.path.normpath(folder))})",
                      "held_out": names, "tokens": int(rows.numel()), "seq_len": args.seq_len,
                      "training": training, "seconds": time.time() - t0,
                      "candidates": {n: t for n, (t, _) in CANDIDATES.items()}}
    # absolute paths (a machine's folders) are not written into the results
    given = [os.path.basename(os.path.normpath(a)) if os.path.isabs(a) else a for a in (argv or sys.argv[1:])]
    cmd = "python benchmarks/router_precision.py" + "".join(f" {shlex.quote(a)}" for a in given)
    header = (f"Commit {commit() or 'unknown'}, machine CPU ({torch.get_num_threads()} threads, torch "
              f"{torch.__version__}), {time.strftime('%Y-%m-%d')}; command: `{cmd}`; "
              f"{result['meta']['seconds']:.0f} s.")
    result["meta"]["header"] = header
    text = report(result, header)
    write_results(args.out, "router_precision_cpu", result, text)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
