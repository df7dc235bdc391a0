"""PEFT LoRA reaches attention projections and the fused 3-D expert weights (``target_parameters``)."""

import torch
from peft import LoraConfig, get_peft_model

from kdamoe import KDAMoEForCausalLM
from tests.helpers import tiny_config


def test_lora_on_attention_and_experts_trains_and_merges():
    torch.manual_seed(0)
    model = KDAMoEForCausalLM(tiny_config())
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    base = model(ids, use_cache=False).logits.detach()
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "kv_b_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, config)
    out = peft_model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, base)  # LoRA B starts at zero
    out.loss.backward()
    expert_lora = [p for n, p in peft_model.named_parameters() if "experts" in n and "lora_B" in n]
    assert expert_lora and all(float(p.grad.abs().sum()) > 0 for p in expert_lora)
    with torch.no_grad():  # move away from the identity, then merging must keep the function
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        adapted = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(ids, use_cache=False).logits, adapted, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(adapted, base)
