"""Host memory of reading a Kimi Linear checkpoint: ``kdamoe-convert --to kda_moe`` at two shard sizes,
``KDAMoEForCausalLM.from_pretrained`` of the Kimi Linear folder, and of the converted kdamoe folder (the numbers in
docs/checkpoints.md).

Builds a 0.26 B-parameter float32 Kimi Linear model with transformers' ``KimiLinearForCausalLM`` (6 layers, 64
experts of width 512 at hidden 512: one MoE layer's experts are 0.19 GiB) and saves it in 200MB shards; then runs each
step in a fresh process and reports its peak resident set size (``ru_maxrss``) above a process that only imports
kdamoe and builds the model on the meta device. Resident memory counts the pages of memory-mapped shards a process has
touched, as well as its own allocations.

    python benchmarks/kimi_linear_memory.py          # ~1 minute on 2 CPU cores; prints a markdown table
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BUILD = """
import sys, torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM
raw = dict(model_type="kimi_linear", vocab_size=1000, hidden_size=512, intermediate_size=1024,
           moe_intermediate_size=512, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=4,
           kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=64,
           num_experts_per_token=4, num_shared_experts=1, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1,
           eos_token_id=2, linear_attn_config=dict(full_attn_layers=[3, 6], kda_layers=[1, 2, 4, 5], num_heads=4,
                                                   head_dim=64, short_conv_kernel_size=4))
torch.manual_seed(0)
model = KimiLinearForCausalLM(KimiLinearConfig.from_dict(raw))
model.save_pretrained(sys.argv[1], max_shard_size="200MB")
print(sum(p.numel() for p in model.parameters()))
"""

STEP = """
import json, resource, sys, torch
from kdamoe import KDAMoEConfig, KDAMoEForCausalLM
from kdamoe.conversion import convert_checkpoint
from kdamoe.model.kimi_linear_format import kimi_linear_to_kdamoe_config
step, src, out = sys.argv[1:4]
if step == "baseline":
    with torch.device("meta"):
        KDAMoEForCausalLM(KDAMoEConfig(**kimi_linear_to_kdamoe_config(json.load(open(src + "/config.json")))))
elif step.startswith("convert"):
    convert_checkpoint(src, out, to="kda_moe", max_shard_size=step.split(":")[1], overwrite=True)
else:
    KDAMoEForCausalLM.from_pretrained(src if step == "load-kimi" else out)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def run(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip().splitlines()[-1]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, out = f"{tmp}/kimi", f"{tmp}/kdamoe"
        parameters = int(run(BUILD, src))
        size = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
        base = int(run(STEP, "baseline", src, out))
        print(f"{parameters / 1e9:.3g} B parameters, {size / 2**30:.2f} GiB of float32 safetensors in 200MB shards; "
              f"baseline peak RSS {base / 2**30:.2f} GiB\n")
        print("| step | peak RSS above the baseline |")
        print("|---|---|")
        for step, label in (("convert:100MB", "kdamoe-convert --to kda_moe --max-shard-size 100MB"),
                            ("convert:400MB", "kdamoe-convert --to kda_moe --max-shard-size 400MB"),
                            ("load-kimi", "from_pretrained(Kimi Linear folder)"),
                            ("load-kdamoe", "from_pretrained(converted kdamoe folder)")):
            peak = int(run(STEP, step, src, out))
            print(f"| {label} | {(peak - base) / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
