"""Router-logit noise on the top-k *selection*: a knob for routing volatility.

Shape legend: N routed tokens of one forward (megatron's sequence-first [T*B] rows), E experts,
K top-k, L MoE layers.

The GSPO paper (arXiv 2507.18071, sec. 5.3) attributes GRPO's failure on MoE models to expert
volatility: ~10% of the experts a token activates change after one gradient step, so the token
ratio pi_theta / pi_old compares two different sub-networks and becomes noise. A small CPU model
flips far fewer experts per step (experiments/ablation: 0.18%). `router_noise(policy, std, gen)`
recreates the volatility on purpose: inside it, every router picks its top-k experts from
`logits + std * z` (z ~ N(0, 1), drawn from `gen`, one draw per router call), while the gate
weights of the picked experts are still computed from the clean logits (softmax over the K
selected clean logits, or the clean all-expert softmax for pre-softmax routers, whose "logits"
are recovered as log-probs). So the noise changes *which* experts run and nothing else.

With `fixed=True` the noise is instead a fixed function of each router's scores (`fixed_draws`):
the same input always picks the same experts, as an engine whose kernels compute slightly
other router logits would (`rollout.decoders.router_noise=fixed`, the sampler's side).

Under Routing Replay (megatron's REPLAY_FORWARD / REPLAY_BACKWARD actions) the selection is
forced, so the noise has no effect at all: by construction the knob adds exactly the part of the
ratio's noise that replay removes. Under RECORD the noisy selection is what gets recorded (the
routing the forward really used). Departure: megatron's own `moe_input_jitter_eps` multiplies
the router *input* by uniform noise in every training-mode forward (the sampler and the pi_old
forward too, and the gate weights move with it), so it cannot be confined to the loss's forward.

With activation recompute that re-runs the routers in the backward (`Recompute.routing`), the
noisy selection of each forward is queued on `policy.backward_replays`, so the recompute routes
as the forward did (like `moe.routing.replay.replay_routing`).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moe.routing.replay import _routers


def fresh_draws(generator: torch.Generator):
    """z ~ N(0, 1), a new draw for every router call (the `router_noise` default)."""
    return lambda base_NE: torch.randn(base_NE.shape, generator=generator,
                                       device=generator.device).to(base_NE.device)


def fixed_draws(generator: torch.Generator, num_experts: int):
    """z a fixed function of the router's own scores: the centred, unit-RMS logits times a
    Gaussian [E, E] matrix drawn once from `generator` (entries N(0, 1/E)), so each entry of z
    has unit variance, the same input always gets the same z, and different tokens get
    different z: a router that computes slightly other logits from the same input, as an
    engine's kernels in another precision do, rather than a coin flipped at every call."""
    mix_EE = torch.randn(num_experts, num_experts, generator=generator,
                         device=generator.device) / num_experts ** 0.5

    def draw(base_NE: torch.Tensor) -> torch.Tensor:
        c_NE = base_NE - base_NE.mean(-1, keepdim=True)
        c_NE = c_NE / c_NE.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
        return c_NE @ mix_EE.to(base_NE.device)
    return draw


def _noisy_topk(router, std: float, draw, scores_are_probs: bool,
                chosen: list, scores, topk, num_groups=None, group_topk=None,
                default_compute_topk=None):
    """`RouterReplay.get_replay_topk` with a noisy selection (see the module docstring)."""
    action = router.router_replay_action
    if action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        return RouterReplay.get_replay_topk(router, scores, topk, num_groups, group_topk,
                                            default_compute_topk)
    with torch.no_grad():
        base_NE = scores.float()
        if scores_are_probs:  # top-k of log p + z == top-k of logits + z
            base_NE = base_NE.clamp_min(torch.finfo(torch.float32).tiny).log()
        _, ids_NK = default_compute_topk(base_NE + std * draw(base_NE), topk,
                                         num_groups=num_groups, group_topk=group_topk)
    if action == RouterReplayAction.RECORD:
        router.record_indices(ids_NK)
    chosen.append(ids_NK)
    return scores.gather(1, ids_NK), ids_NK


@contextlib.contextmanager
def router_noise(policy, std: float, generator: torch.Generator | None, fixed: bool = False):
    """Noisy top-k selection (Gaussian `std` on the router logits) in the forwards inside.

    A no-op when `std` is 0. `generator` (any device; draws are moved to the router's) makes the
    noise reproducible: seed it per optimizer step for a resumable run. `fixed`: z is a fixed
    function of each router's input (`fixed_draws`, one matrix per layer drawn from `generator`
    on entry) instead of a fresh draw per call (`fresh_draws`).
    """
    if not std:
        yield
        return
    if std < 0 or generator is None:
        raise ValueError(f"router noise std={std!r} must be >= 0 and needs a generator")
    routers = _routers(policy)
    scores_are_probs = not policy.preset.norm_topk_prob
    chosen_L: list[list[torch.Tensor]] = [[] for _ in routers]
    for r, chosen in zip(routers, chosen_L):
        draw = fixed_draws(generator, policy.preset.num_experts) if fixed else \
            fresh_draws(generator)
        r.get_replay_topk = partial(_noisy_topk, r, float(std), draw, scores_are_probs, chosen)
    try:
        yield
    finally:
        for r in routers:
            del r.get_replay_topk  # back to the class's method
    if policy.recompute.routing and torch.is_grad_enabled():
        calls = min(len(c) for c in chosen_L)
        policy.backward_replays.extend([c[i] for c in chosen_L] for i in range(calls))
