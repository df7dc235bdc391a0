"""Error of exporting kdamoe weights to Kimi K3's MXFP4 routed experts (``kdamoe-convert --to kimi_k3``, the numbers
in docs/checkpoints.md).

Loads the tiny K3 fixture (``tests/fixtures/k3_tiny``, experts MXFP4 by construction), changes its routed experts three
ways, exports them (``kdamoe_to_kimi_k3_tensors``: ``mxfp4.mxfp4_encode``, round to nearest E2M1 per block of 32 with
an E8M0 scale), reads them back, and prints for each: the relative RMS error of the expert weights, for an update of
MXFP4 weights how large the error is against the update and how much of the update survives (its projection on the
update direction), and the change of the fixture's logits (max |Δlogit| / max |logit|, float32):

* experts replaced by Gaussian weights of the same std (weights that were never MXFP4, e.g. trained in bf16);
* MXFP4 experts plus a Gaussian update of 1e-2 and 1e-1 times their std (a fine-tune of the released weights).

    PYTHONPATH=. python benchmarks/k3_requant_error.py     # a few seconds on a CPU
"""

from pathlib import Path

import torch
from safetensors.torch import load_file

from kdamoe import KDAMoEForCausalLM
from kdamoe.model.kimi_k3_format import kdamoe_to_kimi_k3_tensors, kimi_k3_to_kdamoe_tensors

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "k3_tiny"


def main() -> None:
    ref = load_file(str(FIXTURE / "reference.safetensors"))
    model = KDAMoEForCausalLM.from_pretrained(str(FIXTURE))
    config = model.config
    experts = [n for n in model.state_dict() if ".experts." in n]
    base = {k: v.clone() for k, v in model.state_dict().items()}

    def requantised(state):
        return dict(kimi_k3_to_kdamoe_tensors(kdamoe_to_kimi_k3_tensors(state.items(), config), config))

    def logits(state):
        model.load_state_dict(state)
        with torch.no_grad():
            return model(ref["input_ids"], use_cache=False).logits

    def norm(tensors):
        return torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)).item()

    g = torch.Generator().manual_seed(0)
    for label, size in (("Gaussian experts (never MXFP4)", None), ("MXFP4 + update 1e-2 std", 1e-2),
                        ("MXFP4 + update 1e-1 std", 1e-1)):
        state = {k: v.clone() for k, v in base.items()}
        for n in experts:
            noise = torch.randn(state[n].shape, generator=g) * state[n].std()
            state[n] = noise if size is None else state[n] + size * noise
        q = requantised(state)
        error = norm(q[n] - state[n] for n in experts)
        row = f"{label}: weight relative RMS error {error / norm(state[n] for n in experts):.4f}"
        if size is not None:
            update = [state[n].double() - base[n].double() for n in experts]
            moved = sum(((q[n].double() - base[n].double()) * u).sum() for n, u in zip(experts, update, strict=True))
            kept = moved / norm(update) ** 2
            row += f", error / update {error / norm(update):.3f}, update kept {kept.item():.3f}"
        a, b = logits(state), logits(q)
        row += f", max|dlogit| / max|logit| {((a - b).abs().max() / a.abs().max()).item():.4f}"
        print(row)


if __name__ == "__main__":
    main()
