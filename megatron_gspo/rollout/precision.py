"""A real train-inference mismatch: the sampler runs in another precision than the trainer.

Shape legend: B sequences, T tokens.

Production RL samples with an inference engine (vLLM / SGLang, bf16 kernels) and trains with
another stack, so pi_sampler != pi_old even for the same weights: the log-probs differ, and in an
MoE the routing does too (near-tied router logits pick other experts). The trainer logs both
(`rollout/logprob_mismatch/...`: sampler vs the trainer's recompute on response tokens;
`rollout/routing_mismatch/...`: the sampler's recorded routing vs the recompute's, under R3).
With one framework and one precision on both sides they are float rounding only.

`rollout.decoders.sampler_dtype=bf16` makes the mismatch real: the sampler's forwards (and only
those) run under `torch.autocast(dtype=bfloat16)`, so every matmul (attention, router, experts, output
layer) takes bf16 inputs, as a bf16 engine's would, while the trainer's pi_old, loss and eval
forwards stay in the model's own precision. Autocast rounds the current weights at each call,
which equals a bf16 copy refreshed after every optimizer step without holding one. Departure
from a real engine: norms, softmax and the residual stream stay fp32 under autocast (an engine
with bf16 weights keeps them in bf16), so the mismatch here is a lower bound.

The corrections: R3 (`train.routing_replay=r3`) replays the sampler's routing in the trainer;
truncated importance sampling (`loss.tis_cap`, `losses.tis_weights`) reweights each token by
min(pi_old / pi_sampler, cap).
"""

from __future__ import annotations

import contextlib

import torch

SAMPLER_DTYPES = {"same": None, "bf16": torch.bfloat16}


@contextlib.contextmanager
def sampler_precision(policy, dtype: str):
    """Run the forwards inside in the sampler's precision ("same": unchanged)."""
    if dtype not in SAMPLER_DTYPES:
        raise ValueError(f"sampler dtype {dtype!r}: expected one of {sorted(SAMPLER_DTYPES)}")
    torch_dtype = SAMPLER_DTYPES[dtype]
    if torch_dtype is None:
        yield
        return
    with torch.autocast(device_type=policy.device.type, dtype=torch_dtype):
        yield
