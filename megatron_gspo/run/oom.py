"""Out of memory as one line naming the settings to lower, instead of an allocator traceback.

    with out_of_memory("the rollout", cfg, ROLLOUT):
        batch = sample(...)

torch reports an allocation it cannot make as `torch.OutOfMemoryError` (CUDA: "CUDA out of
memory. Tried to allocate ...") or, on the CPU, a RuntimeError from its allocator
("DefaultCPUAllocator: can't allocate memory: you tried to allocate 7516192768 bytes"); Python's
own is a MemoryError. Inside the block any of these becomes a `UserError`: where it happened, the
allocator's first line, and the config keys (with their values) that size that phase, which the
CLI prints as one line (exit 2). Other RuntimeErrors pass unchanged.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_gspo.config.schema import value_at
from megatron_gspo.errors import UserError

ROLLOUT = (("rollout.prompts_per_batch", "rollout.group_size", "rollout.max_new_tokens"), ())
"""What sizes sampling (keys to lower, keys to raise): rows x length of the KV cache."""
OLD_PASS = (("train.logprob_max_tokens", "rollout.prompts_per_batch", "rollout.group_size"), ())
"""What sizes the no-grad passes over the rollout batch (pi_old, the reference policy)."""
TRAIN_STEP = (("rollout.prompts_per_batch", "rollout.group_size"),
              ("train.num_minibatches", "model.recompute_granularity"))
"""What sizes one optimizer step's forward and backward (recompute: off -> selective -> full)."""
SFT_STEP = (("sft.batch_size",), ("model.recompute_granularity",))


def is_out_of_memory(error: BaseException) -> bool:
    """torch's CUDA / CPU allocator failures and Python's MemoryError."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text.lower()
                                                or "can't allocate memory" in text)


def remedy(cfg, settings: tuple) -> str:
    """'lower a=1, b=2, or raise c=4' for (keys to lower, keys to raise), with `cfg`'s values;
    a recompute already at its maximum (full) is left out."""
    lower, higher = settings
    higher = [k for k in higher if not (k == "model.recompute_granularity"
                                        and value_at(cfg, k) == "full")]
    text = "lower " + ", ".join(f"{k}={value_at(cfg, k)}" for k in lower)
    return text + (", or raise " + ", ".join(f"{k}={value_at(cfg, k)}" for k in higher)
                   if higher else "")


@contextlib.contextmanager
def out_of_memory(where: str, cfg, settings: tuple):
    """Re-raise an allocation failure inside the block as a `UserError` naming `settings`
    (keys to lower, keys to raise: `remedy`)."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        first = first[first.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in first \
            else first
        raise UserError(f"out of memory in {where} ({first[:160]}); "
                          f"{remedy(cfg, settings)}") from None
