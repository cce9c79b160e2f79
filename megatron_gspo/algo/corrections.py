"""Corrections for the train-inference mismatch: the sampler's log-probs (pi_sampler, e.g. a
bf16 engine) differ from the trainer's recompute of the same policy (pi_old). Each correction
reads the per-token ratio, in float64,

    rho_it = pi_old(y_it) / pi_sampler(y_it) = exp(old_logp_it - sampler_logp_it)

and gives the loss a weight per token (`is_weight_BT`) and / or the tokens it keeps
(`keep_BT`); `correction_inputs` builds both from `loss.*` (docs/corrections.md):

  tis_cap        w_it = min(rho_it, cap)                          a weight (truncated IS)
  icepop [a, b]  w_it = rho_it if a <= rho_it <= b, else 0        a weight (IcePop, arXiv
                 2510.18855): a zeroed token still counts in its sequence's token-mean
  is_mask_token  keep_it = low <= rho_it <= high                  a mask: the token leaves the
  [low, high]    loss, so its sequence's token-mean (and GSPO's sequence ratio) runs over the
                 kept tokens
  is_mask_seq    keep_i = low <= exp(mean_t log rho_it) <= high   a mask: the whole sequence
  [low, high]    leaves the loss (geometric-mean ratio over its response tokens)

Bands are closed. A sequence left with no token contributes 0 to the loss and still counts in
the mean over sequences (B does not shrink). tis_cap and icepop both set the weight and are not
combined; masks combine with either weight (masked IS = a mask plus tis_cap >= its high).
Shapes as in losses.py: B sequences, T tokens.
"""

from __future__ import annotations

import math

import torch

BAND_FIELDS = ("is_mask_token", "is_mask_seq", "icepop")


def band_problem(value) -> tuple[list | None, str | None]:
    """(value as [low, high] floats, None), or (None, why) when it is no ratio band: two finite
    numbers with 0 < low <= 1 <= high and low < high. None passes."""
    if value is None:
        return None, None
    why = "expected [low, high], two ratios with 0 < low <= 1 <= high, low < high"
    try:
        if isinstance(value, (str, bytes)) or any(isinstance(x, bool) for x in value):
            return None, why
        low, high = (float(x) for x in value)
    except (TypeError, ValueError):
        return None, why
    ok = math.isfinite(high) and 0 < low <= 1 <= high and low < high
    return ([low, high], None) if ok else (None, why)


def log_ratio(old_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor,
              mask_BT: torch.Tensor) -> torch.Tensor:
    """log rho = old - sampler in float64 on the masked tokens, 0 elsewhere; detached.
    ValueError on NaN at a masked token (a NaN ratio would pass no band silently)."""
    mask_BT = mask_BT.bool().to(old_logp_BT.device)
    with torch.no_grad():
        lr_BT = old_logp_BT.double() - sampler_logp_BT.to(old_logp_BT.device).double()
        bad_B = (torch.isnan(lr_BT) & mask_BT).any(-1)
        if bool(bad_B.any()):
            raise ValueError(f"log(pi_old / pi_sampler) is NaN at response tokens of rows "
                             f"{bad_B.nonzero().flatten().tolist()[:8]}")
        return torch.where(mask_BT, lr_BT, torch.zeros_like(lr_BT))


def in_band(ratio: torch.Tensor, band) -> torch.Tensor:
    """low <= ratio <= high (closed band), bool."""
    return (ratio >= band[0]) & (ratio <= band[1])


def token_keep(log_rho_BT: torch.Tensor, mask_BT: torch.Tensor, band) -> torch.Tensor:
    """is_mask_token: the masked tokens whose rho is in the band -> bool [B, T]."""
    return mask_BT.bool().to(log_rho_BT.device) & in_band(torch.exp(log_rho_BT), band)


def seq_keep(log_rho_BT: torch.Tensor, mask_BT: torch.Tensor, band) -> torch.Tensor:
    """is_mask_seq: sequences whose geometric-mean rho over their masked tokens,
    exp(sum_t log rho / n), is in the band -> bool [B] (a sequence with no token: kept)."""
    mask_BT = mask_BT.bool().to(log_rho_BT.device)
    n_B = mask_BT.sum(-1).clamp(min=1).double()
    mean_B = torch.where(mask_BT, log_rho_BT, torch.zeros_like(log_rho_BT)).sum(-1) / n_B
    return in_band(torch.exp(mean_B), band)


def icepop_weights(log_rho_BT: torch.Tensor, mask_BT: torch.Tensor, band) -> torch.Tensor:
    """IcePop's M(rho; a, b) = rho inside [a, b], 0 outside; 1 off the mask -> float64 [B, T]."""
    mask_BT = mask_BT.bool().to(log_rho_BT.device)
    rho_BT = torch.exp(log_rho_BT)
    w_BT = torch.where(in_band(rho_BT, band), rho_BT, torch.zeros_like(rho_BT))
    return torch.where(mask_BT, w_BT, torch.ones_like(w_BT))


def tis_weights(old_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights min(exp(old - sampler), cap) per token (1 off the mask),
    detached, and `policy/tis/{mean,max_raw,clip_frac}` over the masked tokens.

    Yao et al., "Your efficient RL framework secretly brings you off-policy RL training" (2025);
    verl's rollout importance sampling (`truncate` mode) and slime's `tis_clip` apply the same
    per-token weight to the policy-gradient term. Here `old` is pi_old from the trainer and
    `sampler` is what the rollout engine reported; the weight multiplies each token's clipped
    surrogate (GRPO, GSPO-token) or, for GSPO, the sequence's term times its token-mean weight.
    """
    if not cap > 0:
        raise ValueError(f"tis cap={cap!r} must be > 0")
    mask_BT = mask_BT.bool().to(old_logp_BT.device)
    with torch.no_grad():
        log_w_BT = (old_logp_BT.double() - sampler_logp_BT.to(old_logp_BT.device).double())
        raw_BT = torch.where(mask_BT, log_w_BT.clamp(max=60).exp(), torch.ones_like(log_w_BT))
        w_BT = raw_BT.clamp(max=cap)
        n = mask_BT.sum().clamp(min=1)
        stats = {"policy/tis/mean": float(w_BT[mask_BT].sum() / n),
                 "policy/tis/max_raw": float(raw_BT[mask_BT].max()) if mask_BT.any() else 1.0,
                 "policy/tis/clip_frac": float((raw_BT > cap)[mask_BT].sum() / n)}
    return w_BT.to(old_logp_BT.dtype), stats


def masked_fracs(dropped_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, float]:
    """`policy/is_masked_frac/token` (dropped / masked tokens) and `/seq` (mean over sequences
    of each one's dropped-token fraction: for is_mask_seq, the fraction of sequences dropped)."""
    mask_BT = mask_BT.bool().to(dropped_BT.device)
    d_BT = (dropped_BT & mask_BT).double()
    n_B = mask_BT.sum(-1).double()
    token = float(d_BT.sum() / n_B.sum().clamp(min=1))
    seq = float((d_BT.sum(-1) / n_B.clamp(min=1)).mean()) if len(n_B) else 0.0
    return {"policy/is_masked_frac/token": token, "policy/is_masked_frac/seq": seq}


def correction_inputs(old_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor,
                      mask_BT: torch.Tensor, cfg) -> tuple[dict, dict[str, float]]:
    """The loss's keyword arguments (`is_weight_BT`, `keep_BT`) for the corrections `cfg` (a
    PolicyLossConfig) turns on, and their metrics; both empty when none is on."""
    if cfg.tis_cap is None and all(getattr(cfg, f) is None for f in BAND_FIELDS):
        return {}, {}
    kwargs, metrics = {}, {}
    if cfg.tis_cap is not None:
        kwargs["is_weight_BT"], metrics = tis_weights(old_logp_BT, sampler_logp_BT, mask_BT,
                                                      cfg.tis_cap)
    if all(getattr(cfg, f) is None for f in BAND_FIELDS):
        return kwargs, metrics
    mask_BT = mask_BT.bool().to(old_logp_BT.device)
    log_rho_BT = log_ratio(old_logp_BT, sampler_logp_BT, mask_BT)
    keep_BT = mask_BT.clone()
    if cfg.is_mask_token is not None:
        keep_BT &= token_keep(log_rho_BT, mask_BT, cfg.is_mask_token)
    if cfg.is_mask_seq is not None:
        keep_BT &= seq_keep(log_rho_BT, mask_BT, cfg.is_mask_seq)[:, None]
    dropped_BT = mask_BT & ~keep_BT
    if cfg.icepop is not None:
        w_BT = icepop_weights(log_rho_BT, mask_BT, cfg.icepop)
        dropped_BT |= mask_BT & (w_BT == 0)
        kwargs["is_weight_BT"] = w_BT.to(old_logp_BT.dtype)
    if cfg.is_mask_token is not None or cfg.is_mask_seq is not None:
        kwargs["keep_BT"] = keep_BT
    metrics.update(masked_fracs(dropped_BT, mask_BT))
    return kwargs, metrics
