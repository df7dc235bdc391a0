"""Packaging for kdamoe: a Transformers integration of the KDA + MLA + Stable LatentMoE hybrid."""

from setuptools import find_packages, setup

setup(
    name="kdamoe",
    version="0.1.0",
    description=(
        "Kimi Delta Attention (lower-bounded decay) + MLA/NoPE + Quantile-Balanced Stable LatentMoE "
        "+ Block Attention Residuals, as a Hugging Face Transformers model with Triton kernels."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["kdamoe", "kdamoe.*"]),
    package_data={"kdamoe": ["configs/*.yaml", "configs/posttrain/*.yaml", "common/model_cards/*.md"]},
    install_requires=[
        # Exactly the CPU wheel on disk: a looser pin downloads a multi-GB CUDA build.
        "torch==2.13.0",
        "triton==3.7.1",
        "numpy",
        # 5.24 renamed `past_key_values` to `cache` in generation; we follow 5.24.
        "transformers>=5.24,<6",
        "accelerate",
        "peft",
        "trl",
        "huggingface-hub",
        "datasets",
        "safetensors",
        "tokenizers",
        "tensorboard",
        "matplotlib",
        "tqdm",
        "pyyaml",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "ruff", "import-linter"],
        "dev": ["pytest", "pytest-xdist", "ruff", "import-linter"],
    },
    entry_points={
        "console_scripts": [
            "kdamoe-train=kdamoe.cli:train_main",
            "kdamoe-posttrain=kdamoe.cli:posttrain_main",
            "kdamoe-generate=kdamoe.cli:generate_main",
            "kdamoe-push=kdamoe.cli:push_main",
            "kdamoe-posttrain-demo=kdamoe.cli:posttrain_demo_main",
            "kdamoe-convert=kdamoe.cli:convert_main",
        ]
    },
)
