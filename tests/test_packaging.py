"""The kernels import with torch + triton alone; the model names say what they need."""

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
