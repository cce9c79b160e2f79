"""megatron_gspo.rollout.precision.sampler_precision: the sampler's forwards in bf16, the rest untouched."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.rollout.precision import sampler_precision

CPU = SimpleNamespace(device=torch.device("cpu"))


def test_bf16_runs_matmuls_on_bf16_inputs_and_only_inside():
    """Inside "bf16" a matmul takes bf16-rounded inputs (a bf16 engine's numbers, not fp16's
    or fp32's); after the block, and under "same", the model's own precision again."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=g), torch.randn(64, 32, generator=g)
    with sampler_precision(CPU, "bf16"):
        inside = x @ w
    assert inside.dtype == torch.bfloat16
    assert torch.equal(inside, x.bfloat16() @ w.bfloat16())
    assert (inside.float() - x @ w).abs().max() > 1e-3  # a real mismatch, not rounding of fp32
    assert (x @ w).dtype == torch.float32  # autocast ended with the block
    with sampler_precision(CPU, "same"):
        assert torch.equal(x @ w, torch.mm(x, w))


def test_unknown_sampler_dtype_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"sampler dtype 'fp16': expected one of \['bf16', "
                                         r"'same'\]"):
        with sampler_precision(CPU, "fp16"):
            pass


def test_same_leaves_matmuls_in_full_precision():
    """Guards "same" -> no autocast: a matmul inside stays float32 and equals the one outside
    (comparing two matmuls both inside the block would not notice a bf16 autocast)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g)
    with sampler_precision(CPU, "same"):
        inside = x @ w
    assert inside.dtype == torch.float32 and torch.equal(inside, x @ w)


def test_autocast_is_for_the_policys_device(monkeypatch):
    """Guards device_type=policy.device.type: a CUDA policy gets a CUDA autocast (a CPU
    autocast would leave its GPU matmuls in full precision)."""
    seen = []

    @contextlib.contextmanager
    def fake_autocast(device_type, dtype):
        seen.append((device_type, dtype))
        yield

    monkeypatch.setattr(torch, "autocast", fake_autocast)
    with sampler_precision(SimpleNamespace(device=torch.device("cuda", 0)), "bf16"):
        pass
    assert seen == [("cuda", torch.bfloat16)]
