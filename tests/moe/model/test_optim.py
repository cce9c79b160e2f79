"""megatron-core's optimizer on the policy: bf16 with fp32 masters, clipping, NaN skip, fp16 loss
scaling, the lr schedule (1 process; DP=2 sharding is in test_parallel)."""

import math

import pytest
import torch

from moe.model.policy import MoEPolicy
from moe.model.presets import get_preset
from moe.model.settings import OptimSettings, ParallelLayout

LR = 1e-4


def build(dtype=torch.bfloat16, optim=OptimSettings(lr=LR), preset="tiny"):
    p = get_preset(preset)
    return MoEPolicy.build(p, ParallelLayout(), real_vocab=p.vocab_size, seed=5, dtype=dtype,
                           optim=optim)


def fixed_batch(vocab: int, B: int = 4, T: int = 16):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (B, T), generator=g), torch.ones(B, T, dtype=torch.bool)


def lm_loss(policy, tokens_BT, valid_BT):
    return -policy.token_logprobs(tokens_BT, valid_BT)[:, 1:].mean()


def train(policy, steps: int):
    """`steps` updates on one fixed batch; returns the losses before each update."""
    tokens_BT, valid_BT = fixed_batch(policy.preset.vocab_size)
    losses = []
    for _ in range(steps):
        policy.zero_grad()
        loss = lm_loss(policy, tokens_BT, valid_BT)
        losses.append(loss.item())
        policy.backward(loss)
        assert policy.step()[0]
    return losses


def bf16_adamw_step(policy, opt) -> None:
    """The old code path (fixed to run): torch AdamW directly on the bf16 weights."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([policy.model])
    for p in policy.model.module.parameters():
        p.grad = p.main_grad.to(p.dtype)
    opt.step()


def moved_fraction(params: dict, init: dict, big: float) -> float:
    """Fraction of the weights with |initial value| >= `big` that differ from it."""
    moved = total = 0
    for n, p in params.items():
        mask = init[n].abs() >= big
        moved += int((p.detach().float() != init[n])[mask].sum())
        total += int(mask.sum())
    return moved / total


def test_bf16_masters_learn_where_a_pure_bf16_update_rounds_away(single_process):
    """At |w| >= 2**-5 bf16 values are 2**-12 apart: an Adam update of ~lr = 1e-4 is under half
    of that, so torch AdamW on bf16 weights leaves them where they are; the fp32 masters
    accumulate the updates and the bf16 weights (their rounding) follow."""
    policy = build()
    masters = policy.optimizer.master_params()
    bf16 = dict(policy.model.module.named_parameters())
    assert {p.dtype for p in bf16.values()} == {torch.bfloat16}  # norm weights included
    assert {p.dtype for p in masters} == {torch.float32} and len(masters) == len(bf16)
    assert all(p.main_param.dtype == torch.float32 for p in bf16.values())
    init = {n: p.detach().float().clone() for n, p in bf16.items()}

    losses = train(policy, 20)
    assert losses[-1] < losses[0] - 0.05, losses  # measured: 4.147 -> 4.005
    for p in bf16.values():
        assert torch.equal(p.detach(), p.main_param.to(torch.bfloat16))
    master_moved = moved_fraction({n: p.main_param for n, p in bf16.items()}, init, 2 ** -5)
    model_moved = moved_fraction(bf16, init, 2 ** -5)

    pure = build(optim=None)  # same init (seed), same batch, same lr
    opt = torch.optim.AdamW(pure.model.module.parameters(), lr=LR, weight_decay=0.0)
    tokens_BT, valid_BT = fixed_batch(pure.preset.vocab_size)
    for _ in range(20):
        pure.zero_grad()
        lm_loss(pure, tokens_BT, valid_BT).backward()
        bf16_adamw_step(pure, opt)
    pure_moved = moved_fraction({n: p for n, p in pure.model.module.named_parameters()
                                 if n in bf16}, init, 2 ** -5)
    # measured over 5007 such weights: masters 0.98, bf16 model 0.97, pure bf16 AdamW 0.01
    assert master_moved > 0.9 and model_moved > 0.9 and pure_moved < 0.03, \
        (master_moved, model_moved, pure_moved)


def test_bf16_updates_follow_fp32_training(single_process):
    """bf16 training with fp32 masters tracks fp32 training (same init, batch, lr): the total
    update of the masters points the way fp32's does."""
    ref, half = build(torch.float32, OptimSettings(lr=1e-3)), build(optim=OptimSettings(lr=1e-3))
    init = {n: p.detach().float().clone() for n, p in ref.model.module.named_parameters()}
    ref_losses, half_losses = train(ref, 5), train(half, 5)
    assert half_losses == pytest.approx(ref_losses, abs=0.005)
    delta_ref = torch.cat([(p.detach() - init[n]).flatten()
                           for n, p in ref.model.module.named_parameters()])
    delta_half = torch.cat([(getattr(p, "main_param", p).detach() - init[n]).flatten()
                            for n, p in half.model.module.named_parameters()])
    cosine = float(torch.nn.functional.cosine_similarity(delta_ref, delta_half, dim=0))
    assert cosine > 0.9, cosine  # measured 0.994; losses agree to 4e-4


def test_bf16_clipping_scales_master_grads_to_the_clip(single_process):
    policy = build(optim=OptimSettings(lr=LR, grad_clip=0.05))
    tokens_BT, valid_BT = fixed_batch(policy.preset.vocab_size)
    policy.zero_grad()
    policy.backward(lm_loss(policy, tokens_BT, valid_BT))
    stepped, grad_norm = policy.step()
    assert stepped and grad_norm > 0.5  # far above the clip
    clipped = math.sqrt(sum(float(p.grad.double().pow(2).sum())
                            for p in policy.optimizer.master_params()))
    assert clipped == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize("clip,scaled", [(0.05, True), (1e6, False), (0.0, False)])
def test_clipping_pass_runs_only_where_it_scales(single_process, monkeypatch, clip, scaled):
    """megatron's clip function walks every grad even when it does not scale (clip above the
    norm): `PolicyOptimizer.step` calls it only below its coefficient; grads unscaled above
    and with clipping off (grad_clip 0)."""
    from megatron.core.optimizer import clip_grads

    # built first: the first optimizer of the process patches megatron's clip function for
    # CPU (moe.platform.compat), and the wrapper's undo must restore the patched one
    policy = build(dtype=torch.float32, optim=OptimSettings(lr=LR, grad_clip=clip))
    calls = []
    clip_fn = clip_grads.clip_grad_by_total_norm_fp32
    monkeypatch.setattr(clip_grads, "clip_grad_by_total_norm_fp32",
                        lambda *a, **k: calls.append(1) or clip_fn(*a, **k))
    tokens_BT, valid_BT = fixed_batch(policy.preset.vocab_size)
    policy.zero_grad()
    policy.backward(lm_loss(policy, tokens_BT, valid_BT))
    monkeypatch.setattr(policy.optimizer.optimizer, "step_with_ready_grads", lambda: True)
    stepped, grad_norm = policy.step()  # grads reduced and clipped, Adam not applied
    norm_after = math.sqrt(sum(float(p.grad.double().pow(2).sum())
                               for p in policy.optimizer.master_params()))
    assert stepped and 0.05 < grad_norm < 1e6
    assert bool(calls) is scaled
    assert norm_after == pytest.approx(0.05 if scaled else grad_norm, rel=1e-6)


def test_bf16_nan_grad_skips_the_update_and_the_schedule(single_process):
    policy = build(optim=OptimSettings(lr=LR, warmup_steps=4))
    train(policy, 1)
    masters = [p.detach().clone() for p in policy.optimizer.master_params()]
    weights = [p.detach().clone() for p in policy.model.module.parameters()]
    tokens_BT, valid_BT = fixed_batch(policy.preset.vocab_size)
    policy.zero_grad()
    policy.backward(lm_loss(policy, tokens_BT, valid_BT) * float("nan"))
    stepped, grad_norm = policy.step()
    assert not stepped and math.isnan(grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(masters, policy.optimizer.master_params()))
    assert all(torch.equal(a, b) for a, b in zip(weights, policy.model.module.parameters()))
    assert policy.optimizer.updates == 1
    train(policy, 1)
    assert policy.optimizer.updates == 2 and policy.lr == pytest.approx(LR * 2 / 4)


def test_fp16_overflow_is_skipped_and_the_loss_scale_backs_off(single_process):
    policy = build(torch.float16, OptimSettings(lr=LR, initial_loss_scale=2.0 ** 10))
    scaler = policy.optimizer.optimizer.chained_optimizers[0].grad_scaler
    assert float(policy.optimizer.scale_loss(torch.tensor(1.0))) == 2.0 ** 10
    tokens_BT, valid_BT = fixed_batch(policy.preset.vocab_size)
    weights = [p.detach().clone() for p in policy.model.module.parameters()]
    for _ in range(2):  # megatron's hysteresis: the 2nd overflow in a row halves the scale
        policy.zero_grad()
        policy.backward(lm_loss(policy, tokens_BT, valid_BT) * 1e6)  # overflows fp16 grads
        assert policy.step() == (False, pytest.approx(float("nan"), nan_ok=True))
    assert float(scaler.scale) == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(weights, policy.model.module.parameters()))
    losses = train(policy, 3)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("style,want", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]),
    ("cosine", [0.5, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]),
])
def test_lr_schedule_warmup_then_decay_to_the_floor(single_process, style, want):
    """Update k runs at the schedule's step k: warmup 2, decay reaching min_lr at update 6."""
    min_lr = 0.1 * LR
    policy = build(torch.float32, OptimSettings(lr=LR, min_lr=min_lr, warmup_steps=2,
                                                lr_decay_style=style, lr_decay_steps=6))
    assert policy.lr == pytest.approx(LR * want[0])  # before any update: the first one's
    lrs = []
    for _ in range(6):
        policy.zero_grad()  # zero grads: the schedule alone is under test
        assert policy.step()[0]
        lrs.append(policy.lr)
        assert all(g["lr"] == policy.lr for g in policy.optimizer.optimizer.param_groups)
    floor = [w if k < 2 else min_lr + w * (LR - min_lr) for k, w in enumerate(want)]
    expected = [LR * w for w in want[:2]] + floor[2:]
    assert lrs == pytest.approx(expected, rel=1e-9)


def test_decay_needs_steps_past_the_warmup(single_process):
    with pytest.raises(ValueError, match="lr_decay_steps=2 must exceed warmup_steps=2"):
        build(torch.float32, OptimSettings(lr=LR, warmup_steps=2, lr_decay_style="cosine",
                                           lr_decay_steps=2))
    with pytest.raises(ValueError, match="min_lr=0.1: must be <= lr"):
        OptimSettings(lr=LR, min_lr=0.1)
    assert OptimSettings(lr=LR, min_lr=LR).min_lr == LR  # a floor equal to the peak is valid


@pytest.mark.parametrize("distributed", [False, True])
def test_policy_state_dict_round_trip_continues_exactly(single_process, distributed):
    """The model's and `moe.model.optim`'s state dicts (same layout, in memory; what `moe.model.dist_ckpt`
    saves) carry masters, moments, Adam steps and the schedule: a fresh policy loaded from them
    takes the very same next update."""
    import io

    settings = OptimSettings(lr=1e-3, warmup_steps=3, distributed=distributed)
    policy, fresh = build(optim=settings), build(optim=settings)
    train(policy, 2)
    buffer = io.BytesIO()
    torch.save({"model": policy.model.module.state_dict(),
                "optimizer": policy.optimizer.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    fresh.model.module.load_state_dict(state["model"])
    fresh.optimizer.load_state_dict(state["optimizer"])
    assert fresh.optimizer.updates == 2 and fresh.lr == policy.lr  # the last update's lr
    train(policy, 1)
    train(fresh, 1)
    for a, b in zip(policy.optimizer.master_params(), fresh.optimizer.master_params()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_kernels_on_cpu_match_the_single_tensor_updates(single_process, dtype):
    """moe.model.optim.use_adam_kernel: torch's AdamW fused (the default) or multi-tensor (it would
    pick the single-tensor loop for CPU params): foreach bitwise the same weights after 3
    updates, fused equal to rounding; a loaded checkpoint's flags follow the settings."""
    fused, slow = build(dtype, preset="qwen3-moe-tiny"), build(dtype, preset="qwen3-moe-tiny")
    foreach = build(dtype, preset="qwen3-moe-tiny",
                    optim=OptimSettings(lr=LR, adam_kernel="foreach"))

    def groups(policy):
        return [g for sub in policy.optimizer.optimizer.chained_optimizers
                for g in sub.optimizer.param_groups]

    assert groups(fused) and all(g["fused"] and not g["foreach"] for g in groups(fused))
    assert all(g["foreach"] and not g["fused"] for g in groups(foreach))
    for g in groups(slow):
        g["foreach"] = g["fused"] = None  # torch's default: the single-tensor loop on CPU
    losses = [train(p, 3) for p in (fused, foreach, slow)]
    assert losses[1] == losses[2]
    assert all(math.isclose(a, c, rel_tol=1e-5) for a, c in zip(losses[0], losses[2]))
    for (name, a), b, c in zip(fused.model.module.named_parameters(),
                               foreach.model.module.parameters(), slow.model.module.parameters()):
        assert torch.equal(b, c), name
        torch.testing.assert_close(a, c, atol=1e-5 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-4, msg=lambda m: f"{name}: {m}")
    fused.optimizer.load_state_dict(foreach.optimizer.state_dict())  # saved foreach -> fused
    assert all(g["fused"] and not g["foreach"] for g in groups(fused))
    train(fused, 1)  # the fused kernel accepts the loaded step tensors (moved: a no-op on CPU)


@pytest.mark.parametrize("field,bad,ok", [
    ("lr", -1e-4, 0.0), ("min_lr", -1e-6, 0.0), ("weight_decay", -0.1, 0.0), ("eps", -1e-8, 0.0),
    ("grad_clip", -1.0, 0.0), ("warmup_steps", -1, 0), ("lr_decay_steps", -1, 0),
    ("beta1", 1.0, 0.0), ("beta2", -0.1, 0.0), ("loss_scale", 0.0, 1e-3),
    ("initial_loss_scale", 0.5, 1.0), ("lr_decay_style", "step", "cosine"),
    ("adam_kernel", "single", "foreach")])
def test_settings_check_each_field_at_its_edge(field, bad, ok):
    """Each field's range: a value at its edge is accepted, one past it raises naming the
    field (0 is valid for lr, clip (off), eps, decay and the step counts)."""
    assert getattr(OptimSettings(**{field: ok}), field) == ok
    with pytest.raises(ValueError, match=f"^{field}="):
        OptimSettings(**{field: bad})


def test_adam_settings_and_weight_decay_reach_the_update(single_process):
    """betas and eps reach every Adam param group; with zero grads one update is weight decay
    alone: 2-D weights scale by 1 - lr * weight_decay, 1-D ones (norm weights) stay."""
    lr, wd = 0.1, 0.5
    policy = build(torch.float32, OptimSettings(lr=lr, weight_decay=wd, beta1=0.8, beta2=0.95,
                                                eps=1e-6))
    before = {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}
    policy.zero_grad()
    assert policy.step()[0]
    for sub in policy.optimizer.optimizer.chained_optimizers:
        assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6
                   for g in sub.optimizer.param_groups)
    for n, p in policy.model.module.named_parameters():
        want = before[n] if p.dim() == 1 else before[n] * (1 - lr * wd)
        torch.testing.assert_close(p.detach(), want, atol=0, rtol=1e-6, msg=n)


def test_fp16_constant_loss_scale(single_process):
    """`loss_scale` set: megatron's constant scaler with that scale, not the dynamic one."""
    policy = build(torch.float16, OptimSettings(lr=LR, loss_scale=8.0))
    assert float(policy.optimizer.scale_loss(torch.tensor(1.0))) == 8.0


def test_the_optimizer_and_ddp_agree_on_distributed(single_process):
    """A distributed optimizer over a DDP wrapper built without its buffers (or the reverse)
    is refused up front."""
    from moe.model.optim import PolicyOptimizer

    policy = build(torch.float32, optim=None)
    with pytest.raises(ValueError, match="distributed=True but the DDP wrapper was built with "
                                         "use_distributed_optimizer=False"):
        PolicyOptimizer(policy.model, OptimSettings(lr=LR, distributed=True))


@pytest.mark.parametrize("mult", [1.0, 10.0])
def test_router_lr_mult_scales_the_routers_update_only(single_process, mult):
    """`router_lr_mult`: Adam's first update moves each weight by about its lr (|m / sqrt(v)|
    = 1), so the routers move `mult` times as far as the rest, which keep lr; at 1 there is no
    group of their own."""
    policy = build(torch.float32, OptimSettings(lr=LR, router_lr_mult=mult))
    before = {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}
    train(policy, 1)
    moved = {n: float((p.detach() - before[n]).abs().max())
             for n, p in policy.model.module.named_parameters()}
    routers = [n for n in moved if n.endswith(".mlp.router.weight")]
    assert len(routers) == policy.preset.num_layers
    for n, step in moved.items():
        want = LR * mult if n in routers else LR
        assert want * 0.9 < step < want * 1.1, (n, step)
    lrs = sorted(g["max_lr"] for g in policy.optimizer.optimizer.param_groups if g["params"])
    assert lrs[-1] == LR * mult and (mult == 1 or lrs.count(LR * mult) == 1)
