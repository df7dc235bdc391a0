"""Model-level parity and speed on a GPU: Triton kernels vs the pure-PyTorch path (docs/architecture.md §6).

Builds one KDAMoE model (479M parameters, 8 layers) in bf16 on CUDA and runs forward + backward on one packed
row of 4096 tokens with ``kernel_backend="torch"`` and ``"triton"``:

1. ``bf16``: the two backends in bf16. Routing is discontinuous: at random initialisation many tokens sit on a
   top-k near-tie, and any rounding difference moves some of them to other experts, more in each layer. So
   the errors of logits and gradients are taken with the triton run replaying the torch run's expert choices;
   the free-routing logits error and the share of re-routed tokens per layer are reported beside them.
2. ``bf16_vs_fp32``: each bf16 backend against a float32 copy of the weights on the torch path (tf32 off),
   expert choices replayed: passes when the triton path is no more than 1.25× further from float32 than
   the torch path, for logits and for the largest and median gradient error.
3. ``fp32``: (1) in float32; passes with logits ≤ 1e-2 and every gradient ≤ 3e-2 relative L2 (the
   kernels' products are tf32 there).
4. ``step_ms_*``: one training step of each backend (bf16).

    python benchmarks/model_parity.py --out results.json     # needs CUDA, torch, triton, transformers>=5.24

``--op-parity`` also runs one bf16 forward on the torch path while every KDA and experts call is repeated with
the Triton kernel and with the torch op in float32 (tf32 off) on the same inputs, and reports each kernel's
and the bf16 torch op's relative L2 error against that float32 result, call by call.
"""

import argparse
import copy
import os
import sys
import time
from itertools import pairwise

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import write_json  # noqa: E402  (the benchmarks folder is not a package; it puts the repo on the path)

import kdamoe.model.kernel_dispatch as dispatch  # noqa: E402  (needs the repository on sys.path: harness)
import kdamoe.model.modeling_kdamoe as modeling  # noqa: E402  (the same)
from kdamoe import KDAMoEConfig, KDAMoEForCausalLM  # noqa: E402  (the same)
from kdamoe.kernels.utils import relative_error as relative_l2  # noqa: E402  (the same)


def _route_hook(record=None, replay=None):
    """Router forward hook: append each call's top-k index to ``record``, or force the next index of ``replay``
    (weights recomputed from this run's own scores as ``KDAMoETopkRouter.forward`` does, so router gradients
    still flow)."""
    def hook(router, inputs, out):
        logits, index, weights = out
        if record is not None:
            record.append(index)
        if replay is None:
            return None
        index = replay.pop(0)
        weights = torch.sigmoid(logits).gather(1, index)
        return logits, index, weights / weights.sum(-1, keepdim=True) * router.scaling
    return hook


def run(model, ids, position_ids, backend, record=None, replay=None):
    """Forward + backward with one backend; returns ``(logits float32, loss, {name: grad})``. ``record`` / ``replay``:
    see :func:`_route_hook`."""
    model.config.kernel_backend = backend
    model.zero_grad(set_to_none=True)
    hook = _route_hook(record, replay)
    watch = record is not None or replay is not None
    handles = [r.register_forward_hook(hook) for r in model._routers()] if watch else []
    try:
        out = model(ids, position_ids=position_ids, labels=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), out.loss.item(), grads


def _errors(logits, grads, logits_ref, grads_ref):
    """Relative L2 of the logits and of every parameter gradient (largest, which, median).

    Some gradients are exactly zero at initialisation on every path (Block AttnRes: with the zero pseudo-query the
    key norm's weight gets none, and the first block's query mixes one source); a relative error means nothing
    there, so those are counted apart and must be exactly zero on the compared path too."""
    zero = [n for n in grads_ref if not grads_ref[n].abs().sum() > 0]
    grad_errors = {n: relative_l2(grads[n], grads_ref[n]) for n in grads_ref if n not in zero}
    worst = max(grad_errors, key=grad_errors.get)
    return {"logits_rel_l2": relative_l2(logits, logits_ref), "grad_rel_l2_max": grad_errors[worst],
            "grad_rel_l2_worst_param": worst,
            "grad_rel_l2_median": sorted(grad_errors.values())[len(grad_errors) // 2],
            "grads_zero_in_reference": len(zero),
            "grads_nonzero_where_reference_is_zero": [n for n in zero if grads[n].abs().sum() > 0]}


def compare(model, ids, position_ids):
    """torch vs triton backends: free routing (how many tokens pick other experts, logits error), then the triton
    run replaying the torch run's expert choices (logits and gradient errors: the kernels' own error)."""
    routes_ref, routes = [], []
    logits_ref, loss_ref, grads_ref = run(model, ids, position_ids, "torch", record=routes_ref)
    logits_free, _, _ = run(model, ids, position_ids, "triton", record=routes)
    logits, loss, grads = run(model, ids, position_ids, "triton", replay=list(routes_ref))
    result = {
        "free_routing_tokens_with_other_experts_per_layer": [
            round((a.sort(-1).values != b.sort(-1).values).any(-1).float().mean().item(), 4)
            for a, b in zip(routes_ref, routes, strict=True)],  # one index per router call on both runs
        "free_routing_logits_rel_l2": relative_l2(logits_free, logits_ref),
        "loss_torch": loss_ref, "loss_triton": loss,
        **_errors(logits, grads, logits_ref, grads_ref),
    }
    result["pass"] = (result["logits_rel_l2"] <= 1e-2 and result["grad_rel_l2_max"] <= 3e-2
                      and not result["grads_nonzero_where_reference_is_zero"])
    return result


def against_fp32(model, ids, position_ids):
    """Both bf16 backends against a float32 copy of the same weights on the torch path (tf32 off), every run
    replaying the float32 run's expert choices: is the Triton path as close to float32 as the torch path?"""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    routes = []
    try:
        logits_ref, _, grads_ref = run(copy.deepcopy(model).float(), ids, position_ids, "torch", record=routes)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    result = {backend: _errors(*run(model, ids, position_ids, backend, replay=list(routes))[::2], logits_ref, grads_ref)
              for backend in ("torch", "triton")}
    keys = ("logits_rel_l2", "grad_rel_l2_max", "grad_rel_l2_median")
    result["pass"] = all(result["triton"][key] <= 1.25 * result["torch"][key] for key in keys)
    return result


def time_step(model, ids, position_ids, backend, repeats=5):
    model.config.kernel_backend = backend
    for _ in range(2):
        model(ids, position_ids=position_ids, labels=ids, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        model(ids, position_ids=position_ids, labels=ids, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _compare(record, tag, torch_run, kernel_run, args, kw):
    """Run the torch op (returned), and record the kernel's and the bf16 torch op's error against the torch op
    run in float32 on the same inputs."""
    def up(x):
        return x.float() if torch.is_tensor(x) and x.is_floating_point() else x

    ref = torch_run(*args, **kw)
    with torch.no_grad():
        got = kernel_run(*args, **kw)
        f32 = torch_run(*[up(x) for x in args], **{k: up(v) for k, v in kw.items()})
    pick = (lambda r: r[0]) if isinstance(ref, tuple) else (lambda r: r)
    record.append({"op": tag, "kernel_vs_fp32": relative_l2(pick(got), pick(f32)),
                   "torch_bf16_vs_fp32": relative_l2(pick(ref), pick(f32)),
                   "kernel_vs_torch_bf16": relative_l2(pick(got), pick(ref))})
    return ref


def _dual_kda(record):
    """Stands in for ``kernel_dispatch.chunk_kda`` (the model's KDA op, ``backend=`` keyword)."""

    def torch_run(*a, **k):
        return dispatch.chunk_kda(*a, backend="torch", **k)

    def kernel_run(*a, **k):
        return dispatch.chunk_kda(*a, backend="triton", **k)

    def run(*args, backend="auto", **kw):
        return _compare(record, "chunk_kda", torch_run, kernel_run, args, kw)
    return run


def _dual_experts(record):
    """Stands in for ``kernel_dispatch.moe_experts_op`` (a factory of the experts op)."""
    def factory(backend, device):
        torch_op, kernel_op = dispatch.moe_experts_op("torch", device), dispatch.moe_experts_op("triton", device)
        return lambda *args, **kw: _compare(record, "moe_experts", torch_op, kernel_op, args, kw)
    return factory


def op_parity(model, ids, position_ids):
    """Per-call kernel errors on the model's own activations (see the module docstring)."""
    record = []
    saved = modeling.chunk_kda, modeling.moe_experts_op
    modeling.chunk_kda = _dual_kda(record)
    modeling.moe_experts_op = _dual_experts(record)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            model.config.kernel_backend = "torch"
            model(ids, position_ids=position_ids, use_cache=False)
    finally:
        modeling.chunk_kda, modeling.moe_experts_op = saved
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=3, help="documents packed into the row")
    parser.add_argument("--out", default="model_parity.json")
    parser.add_argument("--op-parity", action="store_true", help="per-call kernel errors on the model's activations")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = KDAMoEConfig(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, kv_lora_rank=512,
        qk_head_dim=128, v_head_dim=128, kda_num_heads=8, kda_head_dim=128, num_experts=64,
        num_experts_per_tok=8, moe_intermediate_size=512, moe_latent_size=512, intermediate_size=2048,
        attnres_num_blocks=4, attn_implementation="sdpa",
    )
    model = KDAMoEForCausalLM(config).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (1, args.seq_len), device="cuda")
    # Packed documents: position_ids restart, exercising cu_seqlens in KDA and the block mask in MLA.
    bounds = sorted(torch.randperm(args.seq_len - 2)[: args.docs - 1].add(1).tolist())
    lengths = [b - a for a, b in pairwise([0, *bounds, args.seq_len])]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()

    def save():  # after every stage: a run cut short by a deadline keeps what it measured
        write_json(args.out, result, indent=2)

    result = {"seq_len": args.seq_len, "doc_lengths": lengths,
              "total_params": sum(p.numel() for p in model.parameters())}
    result["bf16"] = compare(model, ids, position_ids)
    save()
    result["step_ms_torch"] = 1e3 * time_step(model, ids, position_ids, "torch")
    result["step_ms_triton"] = 1e3 * time_step(model, ids, position_ids, "triton")
    save()
    result["tokens_per_s_triton"] = args.seq_len / (result["step_ms_triton"] / 1e3)
    if args.op_parity:
        result["op_parity"] = op_parity(model, ids, position_ids)
    result["bf16_vs_fp32"] = against_fp32(model, ids, position_ids)
    save()
    result["fp32"] = compare(model.float(), ids, position_ids)
    result["pass"] = result["bf16_vs_fp32"]["pass"] and result["fp32"]["pass"]
    save()
    for key, value in result.items():
        print(f"{key:>28}: {value}")


if __name__ == "__main__":
    main()
