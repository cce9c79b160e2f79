"""Group-normalised advantages (GRPO / GSPO): A_i = (r_i - mean(r)) / (std(r) + eps).

Shapes: B responses = P prompts x G responses per prompt (`group_size`), laid out group-major
(the G responses of prompt 0 first, then prompt 1, ...).

    adv_B, metrics = group_advantages(rewards_B, group_size=8)

Choices (frameworks differ, docs/pitfalls.md#advantage-std):
  * std is the population std of the group (divide by G, no Bessel correction; TRL divides by
    G - 1). The GSPO paper writes std({r_j}) without saying which; we pick population.
  * eps defaults to 1e-6 (others use 1e-4 .. 1e-9).
  * A group whose rewards are all equal (population std < 1e-12) has no learning signal: its
    advantages are exactly 0 (not 0 / eps noise), and it is counted in `adv/zero_std_frac`.
Computed in float64; returned in the input dtype (float32 for integer / bool rewards).
"""

from __future__ import annotations

import torch

from moe.platform.checks import is_int

ZERO_STD_TOL = 1e-12
"""A group with population reward std below this counts as zero-variance."""


def group_advantages(rewards_B: torch.Tensor, group_size: int, eps: float = 1e-6,
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-response advantages normalised within each group of `group_size` responses.

    Returns (adv_B, metrics) with metrics `adv/zero_std_frac` (fraction of zero-variance
    groups), `adv/mean`, `adv/std` (population mean / std over all B advantages) and
    `reward/group_std/mean` (mean over groups of the population reward std).
    """
    if not isinstance(rewards_B, torch.Tensor) or rewards_B.ndim != 1:
        raise ValueError(f"rewards_B must be a 1-D tensor [B], got "
                         f"{tuple(getattr(rewards_B, 'shape', ())) or type(rewards_B).__name__}")
    if not is_int(group_size) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} must be an int >= 2 (advantages are "
                         "normalised within a group)")
    B = rewards_B.shape[0]
    if B == 0 or B % group_size:
        raise ValueError(f"rewards_B has {B} entries, not a positive multiple of "
                         f"group_size={group_size}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps={eps!r} must be a number >= 0")
    r_PG = rewards_B.detach().to(torch.float64).reshape(B // group_size, group_size)
    if not bool(torch.isfinite(r_PG).all()):
        bad = (~torch.isfinite(r_PG.flatten())).nonzero().flatten().tolist()
        raise ValueError(f"rewards_B is not finite at indices {bad[:8]}")
    mean_P1 = r_PG.mean(dim=1, keepdim=True)
    std_P1 = r_PG.std(dim=1, keepdim=True, unbiased=False)
    zero_P1 = std_P1 < ZERO_STD_TOL
    adv_PG = torch.where(zero_P1, torch.zeros_like(r_PG), (r_PG - mean_P1) / (std_P1 + eps))
    adv_B = adv_PG.reshape(B)
    metrics = {
        "adv/zero_std_frac": zero_P1.to(torch.float64).mean().item(),
        "adv/mean": adv_B.mean().item(),
        "adv/std": adv_B.std(unbiased=False).item(),
        "reward/group_std/mean": std_P1.mean().item(),
    }
    out_dtype = rewards_B.dtype if rewards_B.is_floating_point() else torch.float32
    return adv_B.to(out_dtype), metrics
