"""The built-in instruments (`megatron_gspo.jobs.instruments`), each a registry name of the
config's `instruments:` list; the default list holds them all, in this order:

- `flips`: per-layer expert flips of each measured optimizer step (`train.flip_every`), the
  drift from pi_old and the router margins, from one "after" forward
  (`megatron_gspo.algo.flips.FlipSchedule`, `algo.margins`);
- `routing_log_ratio`: the routing share of the loss's token log-ratio on the measured steps
  from a rollout batch's second (`jobs.rl_metrics.routing_log_ratio`, one no-grad forward);
- `route_sensitivity`: `moe/route_sensitivity/...` every `train.route_sensitivity_every`
  rollout batches, at pi_old's weights (`algo.sensitivity`);
- `expert_load`: the load per expert and layer of pi_old's routing (`algo.expert_load`), its
  `moe/expert_load/...` keys and a row per rollout batch in run_dir/expert_load.jsonl;
- `throughput`: `perf/...` tokens per second of sampling and training;
- `collapse_alerts`: `alert/{reward,entropy}_collapse` (`train.collapse_reward_drop`,
  `train.collapse_entropy_floor`), and an ALERT line.

None changes what is trained: a run without any of them takes the same steps (their forwards
are no-grad and draw from generators of their own). Their settings stay `train:` keys.
"""

from __future__ import annotations

from contextlib import contextmanager

from megatron_gspo.algo.expert_load import cache_copies, expert_load, load_metrics
from megatron_gspo.algo.flips import FlipSchedule
from megatron_gspo.jobs.instruments import Instrument, Step, register_instrument
from megatron_gspo.jobs.rl_metrics import route_sensitivity_row, routing_log_ratio, throughput
from megatron_gspo.run.metrics import EXPERT_LOAD_FILE, MetricsLogger


@register_instrument("flips")
class Flips(Instrument):
    """`moe/flip_rate/...`, `moe/drift_vs_old/...`, `moe/router_margin/...` and the rest of
    `FlipSchedule`'s keys, every `train.flip_every` optimizer steps."""

    def __init__(self, trainer):
        super().__init__(trainer)
        cfg = trainer.cfg
        # pi_old's routing is the live one at its weights, except under R3 (the sampler's)
        self.schedule = FlipSchedule(cfg.train.flip_every, cfg.train.routing_replay != "r3",
                                     margin_small=cfg.train.router_margin_small)
        self.flips = None

    @contextmanager
    def forwards(self, step: Step):
        self.flips = self.schedule.start(self.trainer.policy, step.mb, step.index,
                                         step.next_mb, step.first)
        with self.flips.watch():
            yield self.flips.forward

    def on_step(self, step: Step) -> dict:
        return self.schedule.finish(self.flips, step.stepped)


@register_instrument("routing_log_ratio")
class RoutingLogRatio(Instrument):
    """`policy/routing_log_ratio/...` on the steps `flips` measures, from a rollout batch's
    second minibatch (at the first the weights are pi_old's), when the forwards were finite."""

    def before_update(self, step: Step) -> dict:
        cfg = self.trainer.cfg
        every = cfg.train.flip_every
        if not every or step.index % every or step.first or not step.done.finite:
            return {}
        return routing_log_ratio(self.trainer.policy, step.mb, step.done.logp_BT, cfg)


@register_instrument("route_sensitivity")
class RouteSensitivity(Instrument):
    """`moe/route_sensitivity/...` and `time/sensitivity`, every
    `train.route_sensitivity_every` rollout batches."""

    def on_rollout(self, batch, iteration: int) -> dict:
        t = self.trainer
        return route_sensitivity_row(t.cfg, t.policy, batch.rollout, iteration,
                                     t.rt.info.dp_rank, t.timer)


@register_instrument("expert_load")
class ExpertLoad(Instrument):
    """`moe/expert_load/layer_XX/{max_over_mean,cv}` of pi_old's routing of the rollout batch
    (the live routing at pi_old's weights; under R3 the sampler's, which every step replays),
    over its real tokens on every rank, and the counts themselves in `EXPERT_LOAD_FILE` (main
    rank): one row per rollout batch at the step of its last row, `load` a list per layer of
    activations per expert, `tokens` the tokens counted (each counts K activations). A resumed
    run drops the rows after its checkpoint; a run starting afresh moves an earlier attempt's
    rows to expert_load.prev<k>.jsonl, as metrics.jsonl's."""

    def __init__(self, trainer):
        super().__init__(trainer)
        cfg, rt = trainer.cfg, trainer.rt
        self.file = MetricsLogger(cfg.run_dir, enabled=rt.info.is_main, file=EXPERT_LOAD_FILE,
                                  lists=True)
        if trainer.state.opt_step:  # resumed
            self.file.drop_after(trainer.state.opt_step)
        else:
            self.file.set_aside()
        self.load_LE = None

    def on_rollout(self, batch, iteration: int) -> dict:
        cache = batch.old_routing
        copies = cache_copies(cache, batch.valid_BT, self.trainer.cfg.model.tp)
        self.load_LE = expert_load(cache, copies)
        return load_metrics(self.load_LE)

    def on_iteration(self, batch, row: dict) -> dict:
        load_LE, topk = self.load_LE, batch.old_routing.topk
        self.file.log(self.trainer.state.opt_step,
                      {"tokens": round(float(load_LE[0].sum()) / topk),
                       "load": [[round(x) for x in layer] for layer in load_LE.tolist()]})
        return {}

    def close(self) -> None:
        self.file.close()


@register_instrument("throughput")
class Throughput(Instrument):
    """`perf/{rollout,train}_tokens_per_s`, `perf/overlap_frac` of the rollout batch."""

    def on_iteration(self, batch, row: dict) -> dict:
        return throughput(batch.rollout, self.trainer.timer)


@register_instrument("collapse_alerts")
class CollapseAlerts(Instrument):
    """Flag a reward crash (its EMA below its best by `train.collapse_reward_drop`) or an
    entropy collapse (`policy/entropy` below `train.collapse_entropy_floor`); the EMA lives in
    the trainer's state, which checkpoints carry."""

    def on_iteration(self, batch, row: dict) -> dict:
        t = self.trainer
        r, state, train = row["reward/mean"], t.state, t.cfg.train
        ema = r if state.reward_ema is None else 0.7 * state.reward_ema + 0.3 * r
        best = max(ema, state.best_reward_ema or ema)
        state.reward_ema, state.best_reward_ema = ema, best
        reward_crash = best > 0.05 and ema < best * (1 - train.collapse_reward_drop)
        entropy_crash = row.get("policy/entropy", 1.0) < train.collapse_entropy_floor
        if (reward_crash or entropy_crash) and t.rt.info.is_main:
            print(f"ALERT collapse: reward_ema={ema:.3f} (best {best:.3f}) "
                  f"entropy={row.get('policy/entropy', float('nan')):.3f}", flush=True)
        return {"alert/reward_collapse": float(reward_crash),
                "alert/entropy_collapse": float(entropy_crash)}
