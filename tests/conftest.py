"""Shared fixtures: one 1-process gloo/NCCL megatron group per test session."""

import os
import warnings

import pytest

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture(scope="session")
def single_process():
    """megatron parallel state with tp=ep=dp=1 in the pytest process itself."""
    from moe.platform.parallel import init_parallel

    os.environ.pop("RANK", None)
    os.environ.pop("WORLD_SIZE", None)
    return init_parallel(tp=1, ep=1, seed=0)
