"""megatron-gspo: GSPO / GRPO on megatron-core MoE policies, with Routing Replay and expert-flip
instrumentation.

Install torch first (`pip install torch==2.13.0`: a CPU wheel where no GPU is present), then
`pip install -e .[dev]`. TransformerEngine needs CUDA and is in the `[gpu]` extra.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-gspo",
    version="0.1.0",
    description="GSPO/GRPO RL for megatron-core MoE policies with Routing Replay and "
                "per-layer expert-flip instrumentation",
    python_requires=">=3.10,<3.12",  # megatron-core 0.17+ needs 3.12; we pin 0.16.1
    packages=find_packages(include=["megatron_gspo", "megatron_gspo.*", "moe", "moe.*"]),
    install_requires=[
        "torch>=2.4",
        "megatron-core==0.16.1",
        "numpy",
        "pyyaml",
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "wandb": ["wandb"],
        # local Hugging Face checkpoints and tokenizers (model.hf_path); nothing is downloaded
        "hf": ["transformers==5.23.0", "safetensors", "tokenizers"],
        "plot": ["matplotlib"],
        "math": ["math-verify==0.9.0"],  # reward.name=math; parquet data also needs pyarrow
        "dev": ["pytest", "matplotlib", "wandb", "transformers==5.23.0", "safetensors",
                "tokenizers", "math-verify==0.9.0", "pyarrow"],
        # tools/bench_throughput.py's TRL side; the versions it was measured with
        "bench": ["trl==1.16.0", "transformers==5.23.0", "accelerate==1.15.0", "datasets==5.2.0"],
    },
    entry_points={"console_scripts": ["megatron-gspo=megatron_gspo.cli:main"]},
)
