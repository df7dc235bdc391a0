"""Training-state memory per rank for the shipped presets and a K3-scale shape, under DDP, FSDP2 and FSDP2 + expert
parallelism (the table in docs/distributed.md).

Parameters are counted on the meta device from the real model classes (no memory is allocated), split into routed
experts (``.experts.`` in the name) and the rest. Per parameter, training keeps a float32 master copy, its float32
gradient and AdamW's two float32 moments: 16 bytes (mixed precision computes in bf16 from a transient copy of the
layer being run, which is left out here, as are activations, which depend on batch and length). Per rank:

* DDP: every rank holds everything, ``16 · N``;
* FSDP2 over ``n`` ranks: ``16 · N / n``;
* FSDP2 + EP over ``n`` ranks (experts split across the ``n`` ranks, the rest sharded by FSDP over the same ranks):
  ``16 · (N_experts / n + N_rest / n)`` — the same bytes as FSDP2; what EP changes is the traffic: tokens travel
  (all-to-all of ``k`` rows per token) instead of expert weights (all-gather of every expert, every layer, every
  step). The table gives both: the experts' bytes all-gathered per step under FSDP2 (bf16, forward + backward) and
  the tokens' bytes exchanged under EP (bf16, dispatch + combine, forward + backward) for a given batch.

A second table is Kimi K3's released text model (``tests/fixtures/kimi_k3_config.json`` through
``kdamoe.model.kimi_k3_format``): per rank of ``n`` ranks that split the routed experts by expert parallelism and
shard everything else with FSDP2, the training state (16 bytes per parameter) and the weights alone for inference
(experts in MXFP4: 4.25 bits per weight, 32 four-bit values and one scale byte per block; the rest in bf16, sharded the
same way or, the last column, replicated on every rank).

    python benchmarks/memory_per_rank.py            # prints the markdown tables
"""

import contextlib
import json
import os
import sys

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import GIB, REPO  # noqa: E402  (the benchmarks folder is not a package)

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM  # noqa: E402  (needs the repository on sys.path: harness)
from kdamoe.model.kimi_k3_format import kimi_k3_to_kdamoe_config  # noqa: E402

BYTES_PER_PARAM = 16  # fp32 master + fp32 grad + AdamW m and v
MXFP4_BYTES_PER_PARAM = 17 / 32  # 32 four-bit values + one E8M0 scale byte per block of 32
K3_CONFIG = os.path.join(REPO, "tests", "fixtures", "kimi_k3_config.json")

# An assumed K3-scale shape: 896 routed experts, top-16 (the scale the issue names); the other dimensions are
# assumptions taken from the published Kimi K2 shape (hidden 7168, 61 layers with the first dense, MLA with 64 heads
# and kv_lora_rank 512, expert width 2048, one shared expert, vocab 163840), with our 3:1 KDA:MLA layout and the
# routed experts in a 2048-wide latent (LatentMoE). Change them here to plan another shape.
K3_SCALE = dict(vocab_size=163840, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, kv_lora_rank=512,
                qk_head_dim=128, v_head_dim=128, kda_num_heads=64, kda_head_dim=128, num_experts=896,
                num_experts_per_tok=16, num_shared_experts=1, moe_intermediate_size=2048, moe_latent_size=2048,
                first_k_dense_replace=1, intermediate_size=18432, attnres_num_blocks=8)


def preset(name: str) -> dict:
    with open(os.path.join(REPO, "kdamoe", "configs", name)) as f:
        model = dict(yaml.safe_load(f)["model"])
    model.setdefault("vocab_size", 8192)  # the presets take it from their tokenizer
    return model


def count(fields: dict) -> tuple[int, int, KDAMoEConfig]:
    """``(routed-expert parameters, all other parameters, config)`` of the model built on the meta device."""
    config = KDAMoEConfig(**fields)
    with torch.device("meta"), contextlib.redirect_stderr(open(os.devnull, "w")):
        model = KDAMoEForCausalLM(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return experts, sum(p.numel() for p in model.parameters()) - experts, config


def traffic_gib(config: KDAMoEConfig, experts: int, tokens: int) -> tuple[float, float]:
    """Per step and rank, bf16: (FSDP2 all-gather of every expert weight in forward and backward, EP all-to-all of
    ``tokens`` tokens' ``k`` routed rows: dispatch + combine, forward + backward)."""
    width = config.moe_latent_size or config.hidden_size
    moe_layers = config.num_sparse_layers
    gather = 2 * 2 * experts / GIB
    exchange = 4 * 2 * tokens * config.num_experts_per_tok * width * moe_layers / GIB
    return gather, exchange


def gib_per_rank(parameters: int, ranks: int) -> float:
    """GiB of weights, gradients and AdamW state per rank when ``ranks`` ranks shard ``parameters`` evenly."""
    return BYTES_PER_PARAM * parameters / ranks / GIB


def main() -> None:
    shapes = {"cpu_default.yaml": preset("cpu_default.yaml"), "gpu_h200.yaml": preset("gpu_h200.yaml"),
              "K3-scale (assumed, see K3_SCALE)": K3_SCALE}
    print("| shape | parameters (routed experts) | DDP per rank | FSDP2 / FSDP2+EP, 8 ranks | 64 ranks "
          "| FSDP2 expert all-gather per step | EP token all-to-all per step (8K tokens per rank) |")
    print("|---|---|---|---|---|---|---|")
    for name, fields in shapes.items():
        experts, rest, config = count(fields)
        total = experts + rest
        gather, exchange = traffic_gib(config, experts, 8192)
        print(f"| {name} | {total / 1e9:.3g} B ({experts / 1e9:.3g} B) | {gib_per_rank(total, 1):.3g} GiB "
              f"| {gib_per_rank(total, 8):.3g} GiB | {gib_per_rank(total, 64):.3g} GiB | {gather:.3g} GiB "
              f"| {exchange:.3g} GiB |")


    k3_table()


def k3_table() -> None:
    """Kimi K3's released text model per expert-parallel rank (module docstring)."""
    with open(K3_CONFIG) as f:
        fields = kimi_k3_to_kdamoe_config(json.load(f))
    experts, rest, _ = count(fields)
    print()
    print(f"Kimi K3 text model: {(experts + rest) / 1e9:.4g} B parameters, {experts / 1e9:.4g} B in routed experts")
    print()
    print("| ranks (EP = FSDP2 size) | training state per rank | inference weights per rank (rest sharded) "
          "| of which routed experts (MXFP4) | inference weights per rank (rest replicated) |")
    print("|---|---|---|---|---|")
    for n in (64, 128, 224, 448, 896):  # divisors of K3's 896 experts: whole experts per rank
        expert_bytes = experts * MXFP4_BYTES_PER_PARAM / n
        print(f"| {n} | {gib_per_rank(experts + rest, n):.4g} GiB | {(expert_bytes + 2 * rest / n) / GIB:.4g} GiB "
              f"| {expert_bytes / GIB:.4g} GiB | {(expert_bytes + 2 * rest) / GIB:.4g} GiB |")


if __name__ == "__main__":
    main()
