"""The K3 reference (``benchmarks/k3_reference/k3_reference.py``): its package folder builds (``pip install --no-deps
--target`` of NeMo AutoModel 0.7.0, fla-core 0.6.0 and einops from PyPI, 1 to 2 s), NeMo's K3 reproduces the
committed ``tests/fixtures/k3_tiny`` files, and NeMo's own MXFP4 decoder reads the fixture's experts as
``kdamoe.model.mxfp4`` does. NeMo runs in subprocesses so that its imports stay out of the test process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdamoe.model.mxfp4 import mxfp4_decode

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "k3_tiny"
SCRIPT = ROOT / "benchmarks" / "k3_reference" / "k3_reference.py"

# One worker runs the module: its tests share one build of the package folder and one run of the script.
pytestmark = pytest.mark.xdist_group("k3_reference")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One run of the script: builds its package folder, writes its files."""
    base = tmp_path_factory.mktemp("k3ref")
    subprocess.run([sys.executable, str(SCRIPT), "--env", str(base / "env"), "--out", str(base / "out")],
                   check=True, cwd=ROOT, capture_output=True, text=True)
    return base


def test_nemo_k3_reproduces_the_committed_fixture(reference_run):
    out = reference_run / "out"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["env_build_seconds"] is not None and meta["env_build_seconds"] < 180  # CI runs it only if <= 3 min
    committed, fresh = load_file(FIXTURE / "model.safetensors"), load_file(out / "model.safetensors")
    assert committed.keys() == fresh.keys()
    for key in committed:
        assert torch.equal(committed[key], fresh[key]), key
    ref_committed, ref_fresh = load_file(FIXTURE / "reference.safetensors"), load_file(out / "reference.safetensors")
    assert torch.equal(ref_committed["input_ids"], ref_fresh["input_ids"])
    # Same inputs and weights; only float32 summation order may differ between machines.
    torch.testing.assert_close(ref_fresh["logits"], ref_committed["logits"], rtol=0, atol=1e-5)


def test_nemo_decodes_the_fixture_experts_like_kdamoe(reference_run, tmp_path):
    decoded = tmp_path / "nemo_decoded.safetensors"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from safetensors.torch import load_file, save_file\n"
        "import torch\n"
        "from nemo_automodel.components.models.kimi_k3.state_dict_adapter import dequantize_mxfp4\n"
        "sd = load_file(sys.argv[2])\n"
        "save_file({k[:-len('_packed')]: dequantize_mxfp4(v, sd[k[:-len('_packed')] + '_scale'], torch.float32)"
        " for k, v in sd.items() if k.endswith('_packed')}, sys.argv[3])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(reference_run / "env"), str(FIXTURE / "model.safetensors"),
                    str(decoded)], check=True, capture_output=True, text=True)
    theirs = load_file(decoded)
    checkpoint = load_file(FIXTURE / "model.safetensors")
    assert len(theirs) == 3 * 8 * 4  # w1, w2, w3 of 8 experts on the 4 MoE layers
    for key, value in theirs.items():
        ours = mxfp4_decode(checkpoint[key + "_packed"], checkpoint[key + "_scale"], name=key)
        torch.testing.assert_close(ours, value, rtol=0, atol=0)


def test_released_config_fixture_builds_nemo_k3_with_the_released_parameter_count(reference_run):
    """``tests/fixtures/kimi_k3_config.json`` read by NeMo's ``KimiK3Config`` (its values equal NeMo's defaults,
    which NeMo documents as the released ones) builds, on the meta device, a text model of 2,779,484,393,568
    parameters: the count docs/checkpoints.md derives by hand from the same config."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1])\n"
        "import torch\n"
        "from nemo_automodel.components.models.common import BackendConfig\n"
        "from nemo_automodel.components.models.kimi_k3.config import KimiK3Config, KimiK3TextConfig\n"
        "from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM\n"
        "raw = json.load(open(sys.argv[2]))\n"
        "config = KimiK3Config(**{k: v for k, v in raw.items() if k not in ('architectures', 'model_type')})\n"
        "defaults = KimiK3TextConfig().to_dict()\n"
        "differ = [k for k, v in raw['text_config'].items() if defaults.get(k) != v and k != 'model_type']\n"
        "with torch.device('meta'):\n"
        "    model = KimiK3ForCausalLM(config, backend=BackendConfig(attn='sdpa', linear='torch', rms_norm='torch',"
        " experts='torch', dispatcher='torch'))\n"
        "print(json.dumps({'params': sum(p.numel() for p in model.parameters()), 'differ': differ}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(reference_run / "env"),
                           str(FIXTURE.parent / "kimi_k3_config.json")], check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["differ"] == []
    assert result["params"] == 2_779_484_393_568
