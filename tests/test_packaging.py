"""The kernels import with torch + triton alone; the model names say what they need; the PPO venv
(requirements-ppo.txt: no peft, tensorboard or triton) imports what its recipe and test import."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["transformers"] = None  # as on an image without (a recent enough) transformers
import kdamoe.kernels as kernels
assert callable(kernels.chunk_kda) and callable(kernels.fused_recurrent_kda) and callable(kernels.moe_experts)
import kdamoe
try:
    kdamoe.KDAMoEForCausalLM
except ImportError as error:
    assert "transformers>=5.24" in str(error), error
else:
    raise SystemExit("expected an ImportError")
print("ok")
"""


def test_kernels_import_without_transformers():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# What tests/test_ppo.py and the ppo recipe import, in a process where the packages that requirements-ppo.txt leaves
# out cannot be imported (trl.experimental.ppo itself exists only in that venv, so the recipe module is not imported).
PPO_VENV_SCRIPT = """
import sys
for name in ("peft", "tensorboard", "torch.utils.tensorboard", "triton"):
    sys.modules[name] = None  # as in the PPO venv, which does not install them
import kdamoe.posttraining, kdamoe.posttraining.data, kdamoe.posttraining.environments, kdamoe.training.tokenizer
import kdamoe.callbacks, kdamoe.model, kdamoe.posttraining.recipes.common, kdamoe.posttraining.run
print("ok")
"""


def test_the_ppo_venv_imports_what_its_recipe_needs():
    result = subprocess.run([sys.executable, "-c", PPO_VENV_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
