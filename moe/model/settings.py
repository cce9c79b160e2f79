"""The model's parallel layout, activation recompute and optimizer settings: frozen dataclasses
with their rules, in plain Python (no torch, no megatron-core).

`megatron_gspo.config` validates against these and subclasses `OptimSettings`, so loading,
checking and describing a config (`megatron-gspo config`) imports neither torch nor megatron-core;
`moe.model.gpt`, `moe.platform.parallel` and `moe.model.optim` build from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is sharded; must match `moe.platform.parallel.init_parallel`."""

    tp: int = 1
    """Tensor parallel size (attention heads, expert FFN columns are not split: ETP=1)."""
    ep: int = 1
    """Expert parallel size (experts split across ranks)."""
    sequence_parallel: bool = False
    """Split LayerNorm/dropout activations along the sequence over the TP group (needs tp>1)."""
    dispatcher: str = "auto"
    """MoE token dispatcher: 'alltoall', 'allgather', or 'auto' (resolved here,
    `resolve_dispatcher`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatcher", resolve_dispatcher(self.dispatcher, self.ep))
        for name, msg in layout_problems(self):
            raise ValueError(f"{name}={getattr(self, name)!r}: {msg}")


DISPATCHERS = ("auto", "alltoall", "allgather")


def resolve_dispatcher(dispatcher: str, ep: int) -> str:
    """'auto' -> 'alltoall' with expert parallelism, else 'allgather'. On one EP rank both give
    bitwise-equal outputs and grads (`tests/moe/model/test_model.py`), but the all-to-all dispatcher
    still splits and re-concatenates every layer's permuted tokens (and their grads) to sort
    them by local expert, an identity copy there: ~9% of a CPU train step of qwen3-moe-tiny at
    16 x 135 tokens (`bench/throughput.py`). Other values pass through."""
    if dispatcher != "auto":
        return dispatcher
    return "alltoall" if ep > 1 else "allgather"


def layout_problems(layout) -> list[tuple[str, str]]:
    """(field, message) for each rule `layout` (anything with tp, sequence_parallel and
    dispatcher, e.g. `megatron_gspo.config.schema.ModelConfig`) breaks; the one place these rules
    live."""
    out = []
    if layout.sequence_parallel and layout.tp == 1:
        out.append(("sequence_parallel", f"requires tp > 1 (got tp={layout.tp})"))
    if not layout.sequence_parallel and layout.tp > 1:
        out.append(("sequence_parallel", f"must be true with tp={layout.tp}: megatron-core "
                    "requires sequence parallelism for MoE with tensor parallelism"))
    if layout.dispatcher not in DISPATCHERS:
        out.append(("dispatcher", f"expected one of {', '.join(DISPATCHERS)}"))
    return out


# megatron recompute modules this model has and the local (non-TE) spec runs
RECOMPUTE_MODULES = ("moe", "core_attn")


@dataclass(frozen=True)
class Recompute:
    """Activation recompute: megatron's `recompute_granularity` / `recompute_modules`.

    Saves activation memory for long responses by re-running part of the forward in the
    backward (megatron's `tensor_parallel.checkpoint`). 'selective' recomputes the listed
    submodules ('moe' = the whole MoE layer: router, dispatch, experts, combine); 'full'
    recomputes every transformer layer (uniform method, one layer per unit), keeping only layer
    inputs. The gradients are unchanged (tests/moe/model/test_recompute.py)."""

    granularity: str | None = None
    """None (off), 'selective' or 'full'."""
    modules: tuple[str, ...] = ("moe",)
    """Submodules recomputed under 'selective' (subset of RECOMPUTE_MODULES)."""

    def __post_init__(self) -> None:
        if self.granularity not in (None, "selective", "full"):
            raise ValueError(f"recompute granularity={self.granularity!r}: expected None, "
                             "'selective' or 'full'")
        bad = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        if bad or (self.granularity == "selective" and not self.modules):
            raise ValueError(f"recompute modules={self.modules!r}: expected a non-empty subset "
                             f"of {RECOMPUTE_MODULES}")

    @property
    def routing(self) -> bool:
        """True when the routers run again in the backward (full, or selective with 'moe')."""
        return self.granularity == "full" or (self.granularity == "selective"
                                              and "moe" in self.modules)

    def config_kwargs(self) -> dict:
        """The `TransformerConfig` fields for this setting."""
        if self.granularity == "full":
            return dict(recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=1)
        if self.granularity == "selective":
            return dict(recompute_granularity="selective", recompute_modules=list(self.modules))
        return {}


@dataclass(frozen=True)
class OptimSettings:
    """Adam (megatron-core's) and its learning-rate schedule.

    The one definition of the optimizer hyper-parameters: `megatron_gspo.config.schema.OptimConfig`
    subclasses it (adding only YAML coercion and dotted-key errors), so a new field here is a new
    config key.
    """

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the lr decay (lr_decay_style linear / cosine)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; megatron exempts biases and 1-D params (norm weights)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    router_lr_mult: float = 1.0
    """The routers' learning rate (and min_lr) as a multiple of lr, in a param group of their
    own (megatron's per-parameter overrides); 1 = the same lr, one group as without it. > 0.
    A knob for routing volatility: routes move with the router weights themselves."""
    warmup_steps: int = 0
    """Linear lr warmup: update k <= warmup_steps runs at lr * k / warmup_steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """lr after warmup: constant, or linear / cosine decay reaching min_lr at lr_decay_steps."""
    lr_decay_steps: int = 0
    """Update at which the decay reaches min_lr, warmup included (megatron's convention);
    0 = the run's last update."""
    distributed: bool = False
    """megatron's distributed optimizer: fp32 master weights and Adam moments sharded over the
    data-parallel ranks (grads reduce-scattered, params all-gathered)."""
    loss_scale: Optional[float] = None
    """fp16 only: a constant loss scale; null = megatron's dynamic loss scaler."""
    initial_loss_scale: float = 2.0 ** 16
    """fp16 only: the dynamic scaler's first scale (torch.amp's default; megatron's 2**32 costs
    about 17 skipped overflow steps before it settles)."""
    adam_kernel: Literal["fused", "foreach"] = "fused"
    """torch's Adam path when megatron builds torch's AdamW (no TE / Apex): 'fused' (one kernel
    per parameter tensor; on CPU 3.6x less time per update than 'foreach' over
    qwen3-moe-tiny's tensors, 159 when measured (one per expert weight), rounding differs at
    ~1e-7) or 'foreach' (multi-tensor ops,
    bitwise equal to torch's single-tensor loop). `moe.model.optim.use_adam_kernel`."""

    def __post_init__(self):
        for name, msg in self.problems():
            raise ValueError(f"{name}={getattr(self, name)!r}: {msg}")

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for each invalid value; empty when all are valid."""
        out = [(n, "must be >= 0") for n in ("lr", "min_lr", "weight_decay", "eps", "grad_clip",
                                             "warmup_steps", "lr_decay_steps")
               if not getattr(self, n) >= 0]
        out += [(n, "must be in [0, 1)") for n in ("beta1", "beta2")
                if not 0 <= getattr(self, n) < 1]
        if not self.router_lr_mult > 0:
            out.append(("router_lr_mult", "must be > 0"))
        if self.min_lr > self.lr:
            out.append(("min_lr", f"must be <= lr={self.lr}"))
        if self.lr_decay_style not in ("constant", "linear", "cosine"):
            out.append(("lr_decay_style", "expected 'constant', 'linear' or 'cosine'"))
        if self.loss_scale is not None and not self.loss_scale > 0:
            out.append(("loss_scale", "must be > 0 or null"))
        if not self.initial_loss_scale >= 1:
            out.append(("initial_loss_scale", "must be >= 1"))
        if self.adam_kernel not in ("fused", "foreach"):
            out.append(("adam_kernel", "expected 'fused' or 'foreach'"))
        return out
