"""The policy's optimizer and learning-rate schedule: megatron-core's own, on CUDA and on CPU.

`PolicyOptimizer` wraps what megatron-core's training loop uses (Megatron-LM `training.py`):

- `megatron.core.optimizer.get_megatron_optimizer`: a `ChainedOptimizer` of one Adam (AdamW mode)
  over the dense and one over the expert parameters. An fp32 model gets its `FP32Optimizer` (Adam
  steps the parameters, reading DDP's fp32 `main_grad`); a bf16 / fp16 model gets
  `Float16OptimizerWithFloat16Params`: fp32 master copies of the 16-bit parameters, fp32 main
  grads (DDP reduces in fp32), Adam on the masters, masters copied back into the model after each
  step. fp16 adds megatron's `DynamicGradScaler` (loss scaling, inf/NaN skip). `distributed=True`
  selects its `DistributedOptimizer`: masters and Adam moments sharded over the data-parallel
  ranks (ZeRO-1; grads reduce-scattered, params all-gathered).
- `megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`: linear warmup, then
  constant, linear or cosine decay to `min_lr`; it also sets each group's weight decay (megatron
  exempts biases and 1-D parameters, i.e. norm weights).

On CPU `moe.platform.compat.apply_cpu_training_patches` lets the same classes run (their few CUDA-only
tensor allocations and type-string checks); no second optimizer is written here. Without
TransformerEngine or Apex kernels, megatron's per-tensor fallbacks for the grad norm, the clip
scaling and the master-to-model copies run as `_foreach` ops
(`moe.platform.compat.use_foreach_optimizer_kernels`).

Departures from megatron's `ChainedOptimizer.step`: (1) a non-finite global grad norm skips the
update on every rank (megatron clips with it; its fp16 scaler skips only on fp16); `step` is
megatron's own pieces in its order (`prepare_grads`, `get_grad_norm`,
`clip_grad_by_total_norm_fp32`, `step_with_ready_grads`) with that check in between. (2) The
schedule counts applied updates from 1: update k uses the lr of scheduler step k (Megatron-LM
steps the scheduler after the update, so its first update runs at `init_lr` = 0 under warmup).
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer import (OptimizerConfig, ParamKey, clip_grads,
                                     get_megatron_optimizer, get_standard_config_overrides)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from moe.platform.compat import apply_cpu_training_patches, use_foreach_optimizer_kernels
from moe.model.settings import OptimSettings


def megatron_optimizer_config(settings: OptimSettings, params_dtype: torch.dtype):
    """megatron's `OptimizerConfig` for these settings and the model's parameter dtype."""
    return OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=settings.min_lr,
        weight_decay=settings.weight_decay, adam_beta1=settings.beta1,
        adam_beta2=settings.beta2, adam_eps=settings.eps, clip_grad=settings.grad_clip,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        params_dtype=params_dtype, loss_scale=settings.loss_scale,
        initial_loss_scale=settings.initial_loss_scale,
        use_distributed_optimizer=settings.distributed)


ROUTER_WEIGHTS = "*.mlp.router.weight"
"""The routers' parameters by name (megatron's `TopKRouter.weight`; no bias here)."""


def param_overrides(config: OptimizerConfig, settings: OptimSettings) -> dict | None:
    """megatron's per-parameter overrides: None (its standard ones: no weight decay on biases
    and 1-D parameters) unless `router_lr_mult` != 1, then those plus the routers' max_lr and
    min_lr times the multiplier, which puts them in a param group of their own."""
    mult = settings.router_lr_mult
    if mult == 1:
        return None
    out = get_standard_config_overrides(config)
    out[ParamKey(name=ROUTER_WEIGHTS)] = {"max_lr": settings.lr * mult,
                                          "min_lr": settings.min_lr * mult}
    return out


class PolicyOptimizer:
    """megatron's optimizer + lr scheduler for one DDP-wrapped model (`moe.model.policy`)."""

    def __init__(self, ddp_model, settings: OptimSettings):
        apply_cpu_training_patches()
        use_foreach_optimizer_kernels()  # CPU and CUDA alike, where megatron has no fused ones
        dtype = next(ddp_model.module.parameters()).dtype
        if settings.distributed != ddp_model.ddp_config.use_distributed_optimizer:
            raise ValueError(f"distributed={settings.distributed} but the DDP wrapper was built "
                             f"with use_distributed_optimizer="
                             f"{ddp_model.ddp_config.use_distributed_optimizer}")
        decay_steps = settings.lr_decay_steps
        if settings.lr_decay_style == "constant":
            decay_steps = max(decay_steps, settings.warmup_steps + 1)  # unused; megatron's assert
        elif decay_steps <= settings.warmup_steps:
            raise ValueError(f"lr_decay_steps={decay_steps} must exceed warmup_steps="
                             f"{settings.warmup_steps} for lr_decay_style="
                             f"{settings.lr_decay_style!r}")
        self.settings = settings
        self.config = megatron_optimizer_config(settings, dtype)
        self.optimizer = get_megatron_optimizer(self.config, [ddp_model],
                                                config_overrides=param_overrides(self.config,
                                                                                 settings))
        use_adam_kernel(self.optimizer, settings.adam_kernel)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=settings.lr, min_lr=settings.min_lr,
            lr_warmup_steps=settings.warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=settings.lr_decay_style, start_wd=settings.weight_decay,
            end_wd=settings.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
            # on resume the config's schedule wins; only the update count comes from the state
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
        self.last_lr = self.lr_at(1)

    @property
    def updates(self) -> int:
        """Applied (not skipped) updates so far."""
        return self.scheduler.num_steps

    def lr_at(self, update: int) -> float:
        """The learning rate of update `update` (1-based) of the default param group."""
        saved = self.scheduler.num_steps
        self.scheduler.num_steps = update
        try:
            group = next(g for g in self.optimizer.param_groups if g["default_config"])
            return self.scheduler.get_lr(group)
        finally:
            self.scheduler.num_steps = saved

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current loss scale (1 except under fp16)."""
        return self.optimizer.scale_loss(loss)

    @torch.no_grad()
    def step(self) -> tuple[bool, float]:
        """Update from the reduced main grads. Returns (stepped, global grad norm).

        A non-finite grad norm (the same on every rank) or an fp16 overflow skips the update on
        every rank and leaves the schedule where it was.
        """
        opt = self.optimizer
        self.scheduler.step(1)  # this update's lr and weight decay
        self.last_lr = self.lr_at(self.scheduler.num_steps)
        found_inf = opt.prepare_grads()  # main grads -> grads of the fp32 (master) params
        grad_norm = float("nan") if found_inf else float(opt.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            self.scheduler.step(-1)
            return False, grad_norm
        # megatron's `clip_grad_by_total_norm_fp32` scales only below this coefficient, after a
        # Python pass over every grad: skip the pass where it would not scale
        if self.settings.grad_clip > 0 and self.settings.grad_clip / (grad_norm + 1.0e-6) < 1.0:
            for sub in opt.chained_optimizers:
                params = [] if sub.is_stub_optimizer else sub.get_parameters()
                if params:
                    clip_grads.clip_grad_by_total_norm_fp32(params, self.settings.grad_clip,
                                                            grad_norm)
        opt.step_with_ready_grads()
        return True, grad_norm

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors Adam updates on this rank: master copies (16-bit models; shards
        under the distributed optimizer) or the model's own fp32 params."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """This rank's optimizer state (megatron's format; masters included) and schedule.

        Under the distributed optimizer megatron's `state_dict` leaves out the per-parameter
        state; this rank's shard of it (fp32 masters, Adam moments) is added the way megatron's
        `DistributedOptimizer.load_state_dict` reads it back ("dp_reshardable": same layout).
        """
        state = {"optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict()}
        if self.settings.distributed:
            subs = state["optimizer"]
            for sub, sub_state in zip(self.optimizer.chained_optimizers,
                                      subs if isinstance(subs, list) else [subs]):
                param_state = sub.get_parameter_state_dp_reshardable()
                for bucket in _bucket_states(param_state):
                    for elem in bucket:
                        elem["padding"] = False  # megatron's loader filters on this key
                sub_state.update(param_state=param_state,
                                 param_state_sharding_type="dp_reshardable")
        return state

    @torch.no_grad()  # fp32 params are their own masters (views under the distributed optimizer)
    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        # the loaded param groups carry the saved flags
        use_adam_kernel(self.optimizer, self.settings.adam_kernel)
        if self.settings.distributed:
            _restore_adam_steps(self.optimizer.chained_optimizers)
        self.scheduler.load_state_dict(state["scheduler"])
        self.last_lr = self.lr_at(max(self.scheduler.num_steps, 1))


def use_adam_kernel(chained, kernel: str = "fused") -> None:
    """Run torch's Adam/AdamW fused (`kernel="fused"`) or multi-tensor (`"foreach"`), on CPU too.

    Without TE / Apex megatron builds `torch.optim.AdamW` with `foreach=None`, which torch
    resolves to the single-tensor loop unless every parameter is on CUDA: one Python iteration
    and about ten ops per parameter tensor (39 tensors for qwen3-moe-tiny, 159 when each expert
    weight was its own).
    The foreach path does the same arithmetic in multi-tensor ops (bitwise equal updates on CPU);
    the fused one runs one kernel per tensor (equal to rounding). Tested in
    tests/moe/model/test_optim.py. Also after loading a checkpoint, whose param groups carry the flags
    it was saved with: the fused kernel wants each `step` on its parameter's device, the
    foreach one on the host (else one device sync per tensor and update)."""
    for sub in getattr(chained, "chained_optimizers", [chained]):
        opt = getattr(sub, "optimizer", None)
        if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            for group in opt.param_groups:
                group["fused"], group["foreach"] = kernel == "fused", kernel == "foreach"
                for param in group["params"]:  # where each kernel keeps `step` (torch's rule)
                    step = opt.state.get(param, {}).get("step")
                    if torch.is_tensor(step):
                        opt.state[param]["step"] = step.to(
                            param.device if kernel == "fused" else "cpu", torch.float32)


def _restore_adam_steps(distributed_optimizers) -> None:
    """Give each torch-Adam parameter state its own `step`, equal to its param group's.

    megatron's DistributedOptimizer keeps Adam's step in the param groups (TE's FusedAdam keeps
    it there); on the torch-Adam path its load_state_dict then hands every parameter the *same*
    step tensor (torch increments it in place once per parameter per update), and its
    dist-checkpoint loader copies the pre-load local step over it ('step' is a
    LocalNonpersistentObject there). Either breaks Adam's bias correction after a resume.
    """
    for sub in distributed_optimizers:
        for group in sub.optimizer.param_groups:
            for param in group["params"]:
                state = sub.optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")) and group.get("step") is not None:
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype,
                                                 device=state["step"].device)


def _bucket_states(param_state: dict):
    """The per-bucket lists of `DistributedOptimizer.get_parameter_state_dp_reshardable()`."""
    for key, by_dtype in param_state.items():
        if isinstance(key, int):
            for buckets in by_dtype.values():
                yield from buckets
