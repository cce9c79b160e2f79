"""The run config's `loss` section: the hyper-parameters every policy loss shares, and beside
them the selected loss's own settings (`megatron_gspo.config.parts`): the built-in losses' clip
range (`ClipRange`), declared here with each loss's paper defaults (GSPO paper, arXiv
2507.18071, sec. 5.1) so that `megatron-gspo config` lists them without importing torch; the
losses register in `megatron_gspo.algo.losses`. Conventions as in `megatron_gspo.config.sections`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_gspo.config.fields import Band, check, check_ratio_band, validate
from megatron_gspo.config.parts import check_host, part_field, register_settings, settings_of


@dataclass(frozen=True)
class LossConfig:
    """Policy loss (GSPO / GRPO): the hyper-parameters every loss shares (the KL, the guards,
    the train-inference corrections, the advantage's epsilon), which the loss functions
    (`megatron_gspo.algo.losses`) take as they are, and beside them the selected loss's own
    settings (`megatron_gspo.config.parts`; the built-in losses': their clip range, `ClipRange`).
    A loss with a new hyper-parameter brings it in its own settings."""
    _section: ClassVar[str] = "loss"
    _parts: ClassVar[tuple] = ("loss", "name", False)

    name: str = "gspo"
    """Registered loss: "gspo" (sequence ratio), "gspo_token" (sequence ratio, token
    advantages) or "grpo" (token ratio); checked against the registry at set-up. Its own
    settings are keys of this section too (`megatron-gspo config` lists them per loss)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (>= 0; 0 = off, as in the paper)."""
    max_log_ratio: float = 20.0
    """Clamp of |log-ratio| before exp (> 0): a numerical guard, not in the paper; the
    gradient is zero beyond it."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling against the train-inference mismatch (None = off): each
    response token's loss term is weighted by min(pi_old / pi_sampler, tis_cap), pi_old being the
    trainer's recompute (verl's rollout IS `truncate`, slime's `tis_clip`). > 0."""
    is_mask_token: Band = None
    """[low, high]: masked IS per token (None = off): a response token whose pi_old / pi_sampler
    is outside the band leaves the loss (its sequence's token-mean runs over the kept tokens;
    docs/corrections.md). 0 < low <= 1 <= high."""
    is_mask_seq: Band = None
    """[low, high]: masked IS per sequence (None = off): a sequence whose geometric-mean
    pi_old / pi_sampler, exp(mean_t log ratio), is outside the band leaves the loss (it adds 0,
    the mean over sequences keeps it). 0 < low <= 1 <= high."""
    icepop: Band = None
    """[alpha, beta]: IcePop (None = off): each response token's weight is pi_old / pi_sampler
    inside [alpha, beta] and 0 outside (it stays in the token-mean's denominator); the paper used
    [0.5, 5]. Not with tis_cap (both set the weight). 0 < alpha <= 1 <= beta."""
    adv_eps: float = 1e-6
    """Epsilon in the group advantage (r - mean) / (std + eps)."""
    dual_clip: Optional[float] = None
    """Dual-clip PPO (verl's clip_ratio_c; None = off): where the advantage is negative the
    objective is at least dual_clip * A, so a token (GSPO: a sequence) whose ratio exceeds
    dual_clip stops pulling the loss (its gradient is 0) instead of weighing in unbounded.
    > 1 (verl's default is 3)."""

    settings: object = part_field(nested=False)
    """The selected loss's own settings as given (None: its defaults; `parts.settings_of`)."""

    @staticmethod
    def _read_older(data: dict) -> dict:
        """`data` without `eps_low: null` / `eps_high: null`: configs saved before the clip
        range was the loss's own setting said null for the loss's default."""
        return {k: v for k, v in data.items()
                if not (k in ("eps_low", "eps_high") and v is None)}

    def __getattr__(self, name: str):
        """A setting of the selected loss's own, read as its key is: `cfg.loss.eps_low` for
        `loss.eps_low` (`parts.settings_of`: as given, or the loss's default)."""
        if name.startswith("_") or name == "settings":  # copy / pickle ask before fields exist
            raise AttributeError(name)
        own = settings_of(self)
        if not hasattr(own, name):
            raise AttributeError(f"loss.{name}: neither a key of the loss section nor a setting "
                                 f"of loss {self.name!r}")
        return getattr(own, name)

    def __post_init__(self):
        validate(self, nonempty=("name",), ge={"kl_coef": 0},
                 gt={"max_log_ratio": 0, "tis_cap": 0, "adv_eps": 0})
        check_host(self)
        check(self, "dual_clip", self.dual_clip is None or self.dual_clip > 1,
              "must be > 1 or null")
        for name in ("is_mask_token", "is_mask_seq", "icepop"):
            check_ratio_band(self, name)
        check(self, "icepop", self.icepop is None or self.tis_cap is None,
              f"and loss.tis_cap={self.tis_cap} both set the token weight: choose one")


@dataclass(frozen=True)
class ClipRange:
    """The clip range of a PPO-style loss: the built-in losses' own settings (a plugin loss
    that clips subclasses it). Its defaults are each loss's (`register_settings`' defaults)."""
    _section: ClassVar[str] = "loss"

    eps_low: float
    """Lower clip range, ratio >= 1 - eps_low, in [0, 1); the paper's (sec. 5.1): 3e-4 for
    gspo / gspo_token, 0.2 for grpo. Formerly null for that default (still read)."""
    eps_high: float
    """Upper clip range, ratio <= 1 + eps_high, >= 0; the paper's: 4e-4 for gspo /
    gspo_token, 0.27 for grpo."""

    def __post_init__(self):
        validate(self, ge={"eps_high": 0})
        check(self, "eps_low", 0 <= self.eps_low < 1, "must be in [0, 1)")


for _name, _eps in (("gspo", (3e-4, 4e-4)), ("gspo_token", (3e-4, 4e-4)), ("grpo", (0.2, 0.27))):
    # declared here, not where the losses register (algo.losses imports torch), so that
    # `megatron-gspo config` lists them
    register_settings("loss", _name, ClipRange, defaults={"eps_low": _eps[0], "eps_high": _eps[1]})
