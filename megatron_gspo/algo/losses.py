"""Policy losses: GSPO, GSPO-token and GRPO on one shared clipped surrogate.

Shapes: B sequences (responses), T tokens (padded length). Inputs are per-token log-probs of
the sampled tokens, `logp_BT` (with grad), `old_logp_BT` (pi_old, a constant) and optionally
`ref_logp_BT` (reference model, a constant), one advantage per sequence `adv_B`, and
`mask_BT` (1 on the response tokens that count, 0 on prompt / padding).

    cfg = PolicyLossConfig(name="gspo")            # its settings: the paper's clip range
    loss, metrics = policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, cfg)
    loss.backward()

The three losses differ only in how the importance ratio is built (GSPO paper, arXiv
2507.18071, sec. 2 and 4); all of them go through `clipped_surrogate`:
  grpo       w_it = exp(logp_it - old_it), clipped per token; objective per sequence is the
             token-mean over its unmasked tokens of min(w A, clip(w) A).
  gspo       s_i = exp(mean_t (logp_it - old_it)) (length-normalised sequence ratio), clipped
             once per sequence; objective per sequence is min(s A, clip(s) A). The gradient
             reaches each token with weight 1/|y_i|.
  gspo_token s_it = sg[s_i] * exp(logp_it - sg[logp_it]): the value is s_i, the gradient per
             token is s_i (so with equal token advantages it equals gspo in value, clip
             decisions and gradient); token-mean per sequence.
The loss is -(mean over sequences of the per-sequence objective): one term per sequence, NOT a
token-mean over all tokens of the batch (that over-weights long responses) and NOT a seq-mean
of token-sums (docs/pitfalls.md#sequence-aggregation). Clip ranges default to the paper's (sec. 5.1): gspo / gspo_token
eps = (3e-4, 4e-4), grpo (0.2, 0.27).

Departures from the paper:
  * Numerical guard (not in the paper, docs/pitfalls.md#ratio-overflow): the log-ratio is clamped to
    [-max_log_ratio, max_log_ratio] before exp -- per token for grpo, the sequence mean for
    gspo / gspo_token. Beyond the clamp the gradient is zero (torch.clamp's gradient); gspo_token
    clamps its token factor inside the same clamp, so that it still equals gspo there. The same
    clamp guards the KL exponent.
  * gspo_token also accepts token advantages `adv_BT` [B, T] (the paper's A_it); the other
    losses take one advantage per sequence.
  * Optional KL to a reference model (off by default, as in the paper): the k3 estimator
    exp(ref - logp) - (ref - logp) - 1, token-mean per sequence, mean over sequences.
  * Train-inference corrections (`corrections.py`) arrive as `is_weight_BT` (a weight per
    token) and `keep_BT` (the tokens that stay in the mask).
  * Optional dual clip (`loss.dual_clip`, off by default; verl's clip_ratio_c): where A < 0
    the objective is at least dual_clip * A, so a ratio above dual_clip adds a constant
    (`clipped_surrogate`; counted in `policy/clip_frac/token_dual`).

Clipped = the clipped branch is the active one in the min, as verl counts it: A > 0 and
ratio > 1 + eps_high (`high`), or A < 0 and ratio < 1 - eps_low (`low`). Clip fractions are
logged both token-weighted (`policy/clip_frac/token*`, the paper's "fraction of clipped tokens";
a clipped gspo sequence counts all its tokens) and sequence-weighted (`policy/clip_frac/seq*`,
the mean over sequences of each sequence's clipped-token fraction; for gspo the fraction of
clipped sequences), see docs/pitfalls.md#clip-fractions.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from megatron_gspo.config.parts import register_settings, registered, settings_of
from megatron_gspo.config.loss import ClipRange
from megatron_gspo.config.loss import LossConfig as PolicyLossConfig
from megatron_gspo.errors import ConfigError, UnknownName
from megatron_gspo.algo.corrections import tis_weights  # noqa: F401 (its former home)
from moe.platform.checks import refuse_duplicate

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str, *, eps: tuple[float, float] | None = None,
                         settings: type = ClipRange):
    """Decorator adding a loss to POLICY_LOSSES with its own settings (`loss.<key>` beside
    `loss.name`, `megatron_gspo.config.parts`): `settings`, a frozen dataclass (a loss that
    clips subclasses `ClipRange`), `eps` the default (eps_low, eps_high) of its clip range
    (without one the config must give loss.eps_low / eps_high). The built-in losses' settings
    are declared in the config room (`config.sections.ClipRange`)."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            refuse_duplicate("policy loss", name, POLICY_LOSSES[name], fn)
        if registered("loss", name) is None:  # the built-ins' are declared already
            defaults = {} if eps is None else {"eps_low": float(eps[0]),
                                               "eps_high": float(eps[1])}
            register_settings("loss", name, settings, defaults=defaults)
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def get_policy_loss(name: str) -> PolicyLossFn:
    """The registered loss called `name`; KeyError listing the valid names otherwise."""
    if name not in POLICY_LOSSES:
        raise UnknownName(
            f"unknown policy loss {name!r}; valid names: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def clip_range(cfg: PolicyLossConfig) -> tuple[float, float]:
    """(eps_low, eps_high) of `cfg`: the selected loss's settings (`ClipRange`), as given or
    its defaults (the paper's for the built-in losses, sec. 5.1). UnknownName for an
    unregistered loss, ConfigError for a loss without a clip range or a default."""
    get_policy_loss(cfg.name)
    own = settings_of(cfg)
    if not isinstance(own, ClipRange):
        raise ConfigError(f"loss.name={cfg.name}: its settings have no clip range (subclass "
                          "ClipRange to clip)")
    return own.eps_low, own.eps_high


# ----------------------------------------------------------------------------- shared pieces


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip: float | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate min(r A, clip(r, 1-eps_low, 1+eps_high) A), elementwise.

    `ratio` and `adv` broadcast together (e.g. [B] and [B], or [B, T] and [B, 1]). Returns
    (term, clipped_low, clipped_high): the bool masks mark where the clipped branch is the
    active one (A < 0 and r < 1 - eps_low; A > 0 and r > 1 + eps_high). There the term is the
    constant clip(r) A, so its gradient is zero; elsewhere it is r A. With `dual_clip` c
    (dual-clip PPO, Ye et al. 2020; verl's clip_ratio_c) the term is max(term, c A) where
    A < 0: a ratio above c adds the constant c A (gradient zero) instead of r A, unbounded
    below; `dual_clipped` gives that mask.
    """
    clipped_low = (adv < 0) & (ratio < 1.0 - eps_low)
    clipped_high = (adv > 0) & (ratio > 1.0 + eps_high)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    term = torch.minimum(ratio * adv, clipped_ratio * adv)
    if dual_clip is not None:
        term = torch.where(adv < 0, torch.maximum(term, dual_clip * adv), term)
    return term, clipped_low, clipped_high


def dual_clipped(ratio: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    """bool, broadcast like `clipped_surrogate`'s masks: where `loss.dual_clip` holds the term
    at c A (A < 0 and ratio > c); all False when it is off."""
    if cfg.dual_clip is None:
        return torch.zeros(torch.broadcast_shapes(ratio.shape, adv.shape), dtype=torch.bool,
                           device=ratio.device)
    return (adv < 0) & (ratio > cfg.dual_clip)


class _Batch(NamedTuple):
    logp_BT: torch.Tensor       # masked to 0, compute dtype, with grad
    log_ratio_BT: torch.Tensor  # logp - old_logp, 0 at masked positions (before clamp)
    adv: torch.Tensor           # [B] (or [B, T] for gspo_token)
    mask_BT: torch.Tensor       # bool
    n_B: torch.Tensor           # unmasked tokens per sequence (compute dtype)
    ref_BT: torch.Tensor | None  # masked to 0, detached
    w_BT: torch.Tensor          # importance weight per token (TIS), 1 without; detached


def _nan_row(x_BT: torch.Tensor, mask_BT: torch.Tensor, what: str) -> None:
    bad_B = (torch.isnan(x_BT) & mask_BT).any(-1)
    if bool(bad_B.any()):
        rows = bad_B.nonzero().flatten().tolist()
        raise ValueError(f"{what} is NaN at unmasked positions of rows {rows[:8]}")


def _prepare(logp_BT, old_logp_BT, adv, mask_BT, ref_logp_BT, token_adv: bool,
             is_weight_BT=None, keep_BT=None) -> _Batch:
    """Validate shapes / masks / NaN; cast to a float>=32 dtype on logp's device; mask.
    `keep_BT` (corrections.py) drops tokens from the mask after the empty-row check: a row
    left empty adds 0 (n_B is clamped to 1) and still counts in the mean over sequences."""
    if not isinstance(logp_BT, torch.Tensor) or logp_BT.ndim != 2 \
            or not logp_BT.is_floating_point():
        raise ValueError(f"logp_BT must be a float tensor [B, T], got "
                         f"{getattr(logp_BT, 'dtype', type(logp_BT))} "
                         f"{tuple(getattr(logp_BT, 'shape', ()))}")
    B, T = logp_BT.shape
    named = {"old_logp_BT": old_logp_BT, "mask_BT": mask_BT, "ref_logp_BT": ref_logp_BT,
             "is_weight_BT": is_weight_BT, "keep_BT": keep_BT}
    for key, t in named.items():
        if (t is not None or key in ("old_logp_BT", "mask_BT")) and (
                not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, T)):
            raise ValueError(f"{key} must have shape {(B, T)} like logp_BT, got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    adv_shapes = [(B,), (B, T)] if token_adv else [(B,)]
    if not isinstance(adv, torch.Tensor) or tuple(adv.shape) not in adv_shapes:
        raise ValueError(f"advantages must have shape {' or '.join(map(str, adv_shapes))}, "
                         f"got {tuple(getattr(adv, 'shape', ())) or type(adv).__name__}")
    dev, dtype = logp_BT.device, torch.promote_types(logp_BT.dtype, torch.float32)
    mask_BT = mask_BT.to(dev)
    if mask_BT.dtype != torch.bool:
        if not bool(((mask_BT == 0) | (mask_BT == 1)).all()):
            raise ValueError("mask_BT must hold only 0 and 1")
        mask_BT = mask_BT != 0
    empty_B = ~mask_BT.any(-1)
    if bool(empty_B.any()):
        raise ValueError(f"every sequence needs at least one unmasked token; rows "
                         f"{empty_B.nonzero().flatten().tolist()[:8]} have none")
    if keep_BT is not None:
        mask_BT = mask_BT & (keep_BT.to(dev) != 0)

    def masked(x_BT, what):
        x_BT = x_BT.to(dev, dtype)
        _nan_row(x_BT, mask_BT, what)
        return torch.where(mask_BT, x_BT, torch.zeros((), device=dev, dtype=dtype))

    logp_m = masked(logp_BT, "logp_BT")
    old_m = masked(old_logp_BT.detach(), "old_logp_BT")
    ref_m = None if ref_logp_BT is None else masked(ref_logp_BT.detach(), "ref_logp_BT")
    adv = adv.detach().to(dev, dtype)
    if bool(torch.isnan(adv if adv.ndim == 1 else adv[mask_BT]).any()):
        raise ValueError("advantages contain NaN")
    if adv.ndim == 2:
        adv = torch.where(mask_BT, adv, torch.zeros((), device=dev, dtype=dtype))
    log_ratio_BT = logp_m - old_m
    _nan_row(log_ratio_BT, mask_BT, "logp_BT - old_logp_BT (inf - inf)")
    n_B = mask_BT.sum(-1).clamp(min=1).to(dtype)
    w_BT = torch.ones_like(logp_m.detach()) if is_weight_BT is None else \
        masked(is_weight_BT.detach(), "is_weight_BT")
    return _Batch(logp_m, log_ratio_BT, adv, mask_BT, n_B, ref_m, w_BT)


def _token_mean(x_BT: torch.Tensor, b: _Batch) -> torch.Tensor:
    """Mean of x over each sequence's unmasked tokens -> [B]."""
    return torch.where(b.mask_BT, x_BT, torch.zeros_like(x_BT)).sum(-1) / b.n_B


def _kl_k3(b: _Batch, cfg: PolicyLossConfig) -> torch.Tensor:
    """k3 estimate of KL(pi || ref): token-mean per sequence, mean over sequences."""
    d_BT = (b.ref_BT - b.logp_BT).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
    return _token_mean(torch.exp(d_BT) - d_BT - 1.0, b).mean()


def _finish(obj_B, ratio, low_BT, high_BT, abs_log_ratio, b: _Batch, cfg: PolicyLossConfig,
            dual_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = -mean_B(obj_B) + kl_coef * kl, and the metrics (one host sync).

    ratio: the clipped ratios to summarise (unmasked token ratios, or sequence ratios);
    low_BT / high_BT / dual_BT: per-token clipped and dual-clipped masks (already restricted
    to unmasked tokens).
    """
    loss = -obj_B.mean()
    if b.ref_BT is not None and cfg.kl_coef > 0:
        kl = _kl_k3(b, cfg)
        loss = loss + cfg.kl_coef * kl
    elif b.ref_BT is not None:
        with torch.no_grad():
            kl = _kl_k3(b, cfg)
    else:
        kl = torch.zeros((), dtype=obj_B.dtype, device=obj_B.device)
    n_tokens = b.mask_BT.sum().clamp(min=1).to(b.n_B.dtype)
    if ratio.numel() == 0:  # the corrections dropped every token
        ratio = obj_B.new_full((1,), float("nan"))
    stats = [loss.detach(), ratio.mean(), ratio.min(), ratio.max()]
    for m_BT in (low_BT | high_BT, low_BT, high_BT):
        m_BT = m_BT.to(b.n_B.dtype)
        stats += [m_BT.sum() / n_tokens, (m_BT.sum(-1) / b.n_B).mean()]
    stats += [dual_BT.to(b.n_B.dtype).sum() / n_tokens, abs_log_ratio.max(), kl.detach()]
    values = torch.stack([s.detach().to(torch.float64) for s in stats]).tolist()
    keys = ["policy/loss", "policy/ratio/mean", "policy/ratio/min", "policy/ratio/max",
            "policy/clip_frac/token", "policy/clip_frac/seq",
            "policy/clip_frac/token_low", "policy/clip_frac/seq_low",
            "policy/clip_frac/token_high", "policy/clip_frac/seq_high",
            "policy/clip_frac/token_dual", "policy/log_ratio/abs_max", "policy/kl"]
    return loss, dict(zip(keys, values))


def _check_kl(cfg: PolicyLossConfig, ref_logp_BT) -> None:
    if cfg.kl_coef > 0 and ref_logp_BT is None:
        raise ValueError(f"PolicyLossConfig.kl_coef={cfg.kl_coef} > 0 needs ref_logp_BT "
                         "(the reference model's log-probs), got None")


# ----------------------------------------------------------------------------- the losses


@register_policy_loss("grpo")
def grpo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, cfg: PolicyLossConfig, ref_logp_BT=None,
              is_weight_BT=None, keep_BT=None):
    """GRPO (paper sec. 2): token ratio exp(logp - old) clipped per token, token-mean per
    sequence, mean over sequences. Metrics: ratio over unmasked tokens; log_ratio/abs_max
    is the largest unmasked |token log-ratio| before the clamp."""
    _check_kl(cfg, ref_logp_BT)
    b = _prepare(logp_BT, old_logp_BT, adv_B, mask_BT, ref_logp_BT, token_adv=False,
                 is_weight_BT=is_weight_BT, keep_BT=keep_BT)
    ratio_BT = torch.exp(b.log_ratio_BT.clamp(-cfg.max_log_ratio, cfg.max_log_ratio))
    term_BT, low_BT, high_BT = clipped_surrogate(ratio_BT, b.adv[:, None], *clip_range(cfg),
                                                 cfg.dual_clip)
    obj_B = _token_mean(term_BT * b.w_BT, b)
    return _finish(obj_B, ratio_BT.detach()[b.mask_BT], low_BT & b.mask_BT,
                   high_BT & b.mask_BT, b.log_ratio_BT.detach().abs(), b, cfg,
                   dual_clipped(ratio_BT.detach(), b.adv[:, None], cfg) & b.mask_BT)


def _seq_log_ratio(b: _Batch) -> torch.Tensor:
    """mean_t (logp - old) over each sequence's unmasked tokens -> [B] (before the clamp)."""
    return b.log_ratio_BT.sum(-1) / b.n_B


@register_policy_loss("gspo")
def gspo_loss(logp_BT, old_logp_BT, adv_B, mask_BT, cfg: PolicyLossConfig, ref_logp_BT=None,
              is_weight_BT=None, keep_BT=None):
    """GSPO (paper sec. 4.1): s_i = exp(mean_t log-ratio), clipped once per sequence;
    loss = -mean_i min(s_i A_i, clip(s_i) A_i). Metrics: ratio over sequences (s_i);
    log_ratio/abs_max is the largest |sequence mean log-ratio| before the clamp."""
    _check_kl(cfg, ref_logp_BT)
    b = _prepare(logp_BT, old_logp_BT, adv_B, mask_BT, ref_logp_BT, token_adv=False,
                 is_weight_BT=is_weight_BT, keep_BT=keep_BT)
    seq_lr_B = _seq_log_ratio(b)
    s_B = torch.exp(seq_lr_B.clamp(-cfg.max_log_ratio, cfg.max_log_ratio))
    term_B, low_B, high_B = clipped_surrogate(s_B, b.adv, *clip_range(cfg), cfg.dual_clip)
    return _finish(term_B * _token_mean(b.w_BT, b), s_B.detach()[b.mask_BT.any(-1)],
                   low_B[:, None] & b.mask_BT, high_B[:, None] & b.mask_BT,
                   seq_lr_B.detach().abs(), b, cfg,
                   dual_clipped(s_B.detach(), b.adv, cfg)[:, None] & b.mask_BT)


@register_policy_loss("gspo_token")
def gspo_token_loss(logp_BT, old_logp_BT, adv_B, mask_BT, cfg: PolicyLossConfig,
                    ref_logp_BT=None, is_weight_BT=None, keep_BT=None):
    """GSPO-token (paper sec. 4.3): s_it = sg[s_i] * exp(logp_it - sg[logp_it]), clipped on
    its value s_i; token-mean per sequence, mean over sequences. `adv_B` may be [B] or token
    advantages [B, T]. Where the sequence clamp is active the token factor's gradient is
    zeroed, as gspo's is. Metrics as for gspo (ratio = s_i)."""
    _check_kl(cfg, ref_logp_BT)
    b = _prepare(logp_BT, old_logp_BT, adv_B, mask_BT, ref_logp_BT, token_adv=True,
                 is_weight_BT=is_weight_BT, keep_BT=keep_BT)
    seq_lr_B = _seq_log_ratio(b).detach()
    clamped_B = seq_lr_B.clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
    token_BT = b.logp_BT - b.logp_BT.detach()  # value 0, gradient 1 (NaN if logp = -inf)
    token_BT = torch.where(torch.isfinite(b.logp_BT), token_BT, torch.zeros_like(token_BT))
    # the token factor inside gspo's own clamp: value exp(clamped_B), gradient zero exactly
    # where gspo's is (torch's rule at the bound itself too: 1 up to torch 2.13, 0 from 2.14)
    s_BT = torch.exp((seq_lr_B[:, None] + token_BT).clamp(-cfg.max_log_ratio,
                                                           cfg.max_log_ratio))
    adv_BT = b.adv[:, None] if b.adv.ndim == 1 else b.adv
    term_BT, low_BT, high_BT = clipped_surrogate(s_BT, adv_BT, *clip_range(cfg), cfg.dual_clip)
    obj_B = _token_mean(term_BT * b.w_BT, b)
    return _finish(obj_B, torch.exp(clamped_B)[b.mask_BT.any(-1)], low_BT & b.mask_BT,
                   high_BT & b.mask_BT, seq_lr_B.abs(), b, cfg,
                   dual_clipped(s_BT.detach(), adv_BT, cfg) & b.mask_BT)


def policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, cfg: PolicyLossConfig, ref_logp_BT=None,
                is_weight_BT=None, keep_BT=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Dispatch to the loss registered as `cfg.name` (`keep_BT` only when set: a registered
    loss need not take it)."""
    keep = {} if keep_BT is None else {"keep_BT": keep_BT}
    return get_policy_loss(cfg.name)(logp_BT, old_logp_BT, adv_B, mask_BT, cfg,
                                     ref_logp_BT=ref_logp_BT, is_weight_BT=is_weight_BT, **keep)
