"""Kimi K3 options of the layers: the full-rank KDA output gate (``kda_full_rank_output_gate``), the MLA output gate
(``mla_output_gate``) and the routed scaling inside a latent MoE (``latent_moe_routed_scaling``).

References: each gated layer against the ungated layer it extends, whose path is tested against transformers'
Kimi Linear elsewhere (``test_kda_gate_options.py``, ``test_mla_options.py``) — the low-rank KDA gate with an identity
first projection is the full-rank gate; the MLA output before ``o_proj`` (``o_proj`` replaced by the identity) gated by
hand. The model paths (cache, chunked prefill, packed rows) against the single full forward, in float64. The exactness
of the whole K3 model against NeMo's K3 is in ``test_kimi_k3_checkpoints.py``.
"""

import pytest
import torch
from torch import nn

from kdamoe import KDAMoEForCausalLM
from kdamoe.model.modeling_kdamoe import KDAMoEAttention, KDAMoEDeltaAttention, KDAMoETopkRouter
from tests.helpers import tiny_config

TOL = dict(rtol=1e-5, atol=1e-6)


def _perturb(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else 0.3 * torch.randn_like(p))


def test_full_rank_kda_gate_equals_the_low_rank_gate_with_an_identity_first_projection():
    # kda_head_dim = hidden_size, so the low-rank gate's g_a_proj can be the identity and g_b_proj the full matrix
    common = dict(kda_num_heads=2, kda_head_dim=32, kda_use_A_log=True, rms_norm_eps=1e-5)
    full = KDAMoEDeltaAttention(tiny_config(kda_full_rank_output_gate=True, **common), 0).double().eval()
    low = KDAMoEDeltaAttention(tiny_config(kda_output_gate_bias=False, **common), 0).double().eval()
    _perturb(full, 0)
    assert full.g_proj.weight.shape == (64, 32) and full.g_proj.bias is None
    assert not hasattr(full, "g_a_proj") and not hasattr(full, "g_b_proj")
    with torch.no_grad():
        for name, p in full.named_parameters():
            if not name.startswith("g_proj"):
                low.get_parameter(name).copy_(p)
        low.g_a_proj.weight.copy_(torch.eye(32, dtype=torch.float64))
        low.g_b_proj.weight.copy_(full.g_proj.weight)
        x = torch.randn(2, 13, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(full(x), low(x), **TOL)
        low.g_b_proj.weight.mul_(-1)  # a different gate gives a different output: the gate is read
        assert (full(x) - low(x)).abs().max() > 1e-2


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_output_gate_multiplies_the_attention_output_by_the_sigmoid_of_g_proj(q_lora_rank):
    common = dict(num_hidden_layers=1, layer_types=["full_attention"], q_lora_rank=q_lora_rank, qk_head_dim=24,
                  qk_rope_head_dim=8, v_head_dim=12, attnres_num_blocks=1)
    gated_config, plain_config = tiny_config(mla_output_gate=True, **common), tiny_config(**common)
    for c in (gated_config, plain_config):
        c._attn_implementation = "sdpa"
    gated, plain = KDAMoEAttention(gated_config, 0).double().eval(), KDAMoEAttention(plain_config, 0).double().eval()
    _perturb(gated, 2)
    assert gated.g_proj.weight.shape == (2 * 12, 32) and gated.g_proj.bias is None
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(gated.get_parameter(name))
        plain.o_proj = nn.Identity()  # the attention output before o_proj, [B, T, H·v_head_dim]
        x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        want = gated.o_proj(plain(x)[0] * torch.sigmoid(x @ gated.g_proj.weight.T))
        torch.testing.assert_close(gated(x)[0], want, **TOL)


def test_latent_moe_routed_scaling_scales_the_gate_weights_only_when_asked():
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(4))
    weights = {}
    for flag in (False, True):
        torch.manual_seed(5)
        router = KDAMoETopkRouter(tiny_config(routed_scaling_factor=2.5, latent_moe_routed_scaling=flag)).eval()
        nn.init.normal_(router.weight)
        with torch.no_grad():
            _, index, weights[flag] = router(x)
        # the reference: sigmoid scores of the chosen experts, renormalised to sum 1
        scores = torch.sigmoid(x @ router.weight.T).gather(1, index)
        torch.testing.assert_close(weights[flag], scores / scores.sum(-1, keepdim=True) * (2.5 if flag else 1.0))


K3_OPTIONS = dict(kda_full_rank_output_gate=True, mla_output_gate=True, latent_moe_routed_scaling=True,
                  routed_scaling_factor=2.5, kda_use_A_log=True, q_lora_rank=12, qk_head_dim=24, qk_rope_head_dim=8,
                  v_head_dim=16, rms_norm_eps=1e-5, mla_rms_norm_eps=1e-6, num_shared_experts=2,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"])


def _ids(seed, B, T):
    return torch.randint(3, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_model_paths_agree_with_every_k3_option():
    torch.manual_seed(6)
    model = KDAMoEForCausalLM(tiny_config(**K3_OPTIONS)).double().eval()
    _perturb(model, 7)
    ids = _ids(8, 2, 26)
    with torch.no_grad():
        full = model(ids, use_cache=False, prefill_chunk_size=0).logits
        # the RMSNorms and the router compute in float32 by design: paths that sum in another order differ by ~2e-6
        # of the largest logit here (every weight perturbed; the same without the K3 options), a wrong gate by ~1e-1
        TOL = dict(rtol=0, atol=1e-5 * full.abs().max().item())
        torch.testing.assert_close(model(ids, use_cache=True, prefill_chunk_size=7).logits, full, **TOL)
        out = model(ids[:, :17], use_cache=True)
        pieces = [out.logits]
        for t in range(17, 21):
            out = model(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            pieces.append(out.logits)
        pieces.append(model(ids[:, 21:], cache=out.cache, use_cache=True).logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, **TOL)  # decode attends in the latent space
        docs = [ids[:1, :11], ids[1:, :15]]
        position_ids = torch.cat([torch.arange(11), torch.arange(15)]).unsqueeze(0)
        packed = model(torch.cat(docs, 1), position_ids=position_ids, use_cache=False).logits
        alone = torch.cat([model(d, use_cache=False).logits for d in docs], 1)
        torch.testing.assert_close(packed, alone, **TOL)


def test_defaults_keep_todays_layers_and_bad_values_are_refused():
    model = KDAMoEForCausalLM(tiny_config())
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.g_a_proj.weight" in names and "model.layers.3.self_attn.g_proj.weight" not in names
    assert not any(".self_attn.g_proj." in n for n in names)
    assert model.model.layers[1].mlp.gate.scaling == 1.0
    for field in ("kda_full_rank_output_gate", "mla_output_gate", "latent_moe_routed_scaling"):
        with pytest.raises(ValueError, match=field):
            tiny_config(**{field: 1})
