"""Tiny configs shared by the model tests (fast on 2 CPU cores)."""

from kdamoe import KDAMoEConfig


def tiny_config(**overrides) -> KDAMoEConfig:
    """A 4-layer model (3 KDA + 1 MLA) with 8 experts top-2, widths of a few dozen."""
    fields = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        kv_lora_rank=16,
        kda_num_heads=2,
        kda_head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_latent_size=16,
        intermediate_size=32,
        attnres_num_blocks=2,
        kda_chunk_size=16,
        kernel_backend="torch",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return KDAMoEConfig(**fields)
