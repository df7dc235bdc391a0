"""Model-level parity and speed on a GPU: Triton kernels vs the pure-PyTorch path (DESIGN.md §6).

Builds one KDAMoE model in bf16 on CUDA, runs forward + backward with ``kernel_backend="torch"`` and
``"triton"`` on the same packed batch, and reports the relative L2 error of the logits and of every
parameter gradient (bounds: 1e-2 logits, 3e-2 gradients), then times a training step of each backend.

    python benchmarks/model_parity.py --out results.json     # needs CUDA, torch, triton, transformers>=5.24
"""

import argparse
import json
import time

import torch

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run(model, ids, position_ids, backend):
    model.config.kernel_backend = backend
    model.zero_grad(set_to_none=True)
    out = model(ids, position_ids=position_ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), out.loss.item(), grads


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=3, help="documents packed into the row")
    parser.add_argument("--out", default="model_parity.json")
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
    lengths = [b - a for a, b in zip([0] + bounds, bounds + [args.seq_len])]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()

    logits_ref, loss_ref, grads_ref = run(model, ids, position_ids, "torch")
    logits, loss, grads = run(model, ids, position_ids, "triton")
    grad_errors = {n: relative_l2(grads[n], grads_ref[n]) for n in grads_ref}
    worst = max(grad_errors, key=grad_errors.get)
    result = {
        "seq_len": args.seq_len, "doc_lengths": lengths,
        "loss_torch": loss_ref, "loss_triton": loss,
        "logits_rel_l2": relative_l2(logits, logits_ref),
        "grad_rel_l2_max": grad_errors[worst], "grad_rel_l2_worst_param": worst,
        "grad_rel_l2_median": sorted(grad_errors.values())[len(grad_errors) // 2],
        "step_ms_torch": 1e3 * time_step(model, ids, position_ids, "torch"),
        "step_ms_triton": 1e3 * time_step(model, ids, position_ids, "triton"),
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    result["tokens_per_s_triton"] = args.seq_len / (result["step_ms_triton"] / 1e3)
    result["pass"] = result["logits_rel_l2"] <= 1e-2 and result["grad_rel_l2_max"] <= 3e-2
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for key, value in result.items():
        print(f"{key:>28}: {value}")


if __name__ == "__main__":
    main()
