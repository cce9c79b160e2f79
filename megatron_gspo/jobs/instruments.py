"""Instruments: what the RL trainer measures besides what it trains, called at fixed points of
a rollout batch and returning metrics for its rows.

    @register_instrument("reward_range")
    class RewardRange(Instrument):
        def on_rollout(self, batch, iteration):
            return {"reward/range": float(batch.rollout.rewards_B.max()
                                          - batch.rollout.rewards_B.min())}

The config's `instruments:` list names the ones a run builds, in order (default: the built-in
set, `megatron_gspo.config.schema.DEFAULT_INSTRUMENTS`); a plugin registers its own, and a name
already registered is refused naming both definitions. Each is built once per trainer as
`factory(trainer)` (a class is a factory): it reads what it needs of the trainer (`cfg`,
`policy`, `rt`, `state`, `timer`) and keeps its own state. The hooks, in the order one rollout
batch calls them (`megatron_gspo.jobs.rl.Trainer.iteration`; all no-ops in `Instrument`):

1. `on_rollout(batch, iteration)`: once pi_old's pass is done, at pi_old's weights, before any
   optimizer step of the batch; `batch` is the whole rollout batch as a `jobs.rl.Minibatch`
   (tokens, masks, rewards, pi_old's log-probs and routing). Its metrics go into the batch's
   last row.
2. per optimizer step (`Step`): `forwards(step)`, a context around the step's forwards and
   backwards yielding a per-forward context factory `record(rows)` (or None);
   `before_update(step)`, forwards done (`step.done`), weights not yet stepped;
   `on_step(step)`, after the optimizer step (`step.stepped`). Their metrics go into the
   step's row.
3. `on_iteration(batch, row)`: the batch's last row so far (timings, every earlier
   instrument's metrics); its metrics join that row.
4. `on_eval(metrics)`: after each eval of the validation split, with its metrics; its own join
   them. `close()`: once the run ends, however it ends.

Every rank builds and calls the same instruments in the same order, so an instrument may run
collectives (a sum over ranks) in any hook. OLMo-core's trainer callbacks are the model; here a
hook returns its metrics rather than recording them on the trainer.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from megatron_gspo.errors import ConfigError
from moe.platform.checks import refuse_duplicate


@dataclass
class Step:
    """One optimizer step as instruments see it."""

    index: int
    """The optimizer step (the trainer state's `opt_step` before it is counted)."""
    mb: Any
    """Its minibatch (`megatron_gspo.jobs.rl.Minibatch`)."""
    next_mb: Any = None
    """The rollout batch's next minibatch, or None after the last."""
    first: bool = False
    """No optimizer step since pi_old's pass (the rollout batch's first minibatch)."""
    done: Any = None
    """What the forwards left (`megatron_gspo.jobs.rl_step.Accumulated`), from
    `before_update` on."""
    stepped: bool = False
    """The optimizer stepped (False: skipped for a non-finite loss or grad norm), in
    `on_step`."""


class Instrument:
    """Base class of an instrument: every hook does nothing; override those you need."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_rollout(self, batch, iteration: int) -> dict:
        return {}

    @contextmanager
    def forwards(self, step: Step):
        yield None

    def before_update(self, step: Step) -> dict:
        return {}

    def on_step(self, step: Step) -> dict:
        return {}

    def on_iteration(self, batch, row: dict) -> dict:
        return {}

    def on_eval(self, metrics: dict) -> dict:
        return {}

    def close(self) -> None:
        pass


INSTRUMENTS: dict[str, Callable[[Any], Instrument]] = {}
"""name -> its factory (`factory(trainer)`, a class or a function)."""


def register_instrument(name: str):
    """Decorator adding an instrument factory under `name` (an `instruments:` entry); a name
    already registered (a built-in one too) is refused naming both definitions."""
    def deco(factory):
        if name in INSTRUMENTS:
            refuse_duplicate("instrument", name, INSTRUMENTS[name], factory)
        INSTRUMENTS[name] = factory
        return factory
    return deco


def check_instruments(names) -> None:
    """ConfigError (one line) for a name no instrument is registered under, or one given
    twice."""
    for name in names:
        if name not in INSTRUMENTS:
            raise ConfigError(f"instruments: {name!r} is not a registered instrument; valid: "
                              f"{sorted(INSTRUMENTS)}")
        if list(names).count(name) > 1:
            raise ConfigError(f"instruments: {name!r} is given twice")


class Instruments:
    """The run's instruments, called in the config's order; each hook merges their metrics."""

    def __init__(self, names, trainer):
        check_instruments(names)
        self.items = [INSTRUMENTS[name](trainer) for name in names]

    def on_rollout(self, batch, iteration: int) -> dict:
        return self._merged(lambda i: i.on_rollout(batch, iteration))

    @contextmanager
    def forwards(self, step: Step):
        """Every instrument's `forwards(step)` entered; yields `record(rows)`, the context
        each forward of the step runs in first (every instrument's, entered in order)."""
        with ExitStack() as stack:
            records = [r for r in (stack.enter_context(i.forwards(step)) for i in self.items)
                       if r is not None]

            @contextmanager
            def record(rows):
                with ExitStack() as inner:
                    for r in records:
                        inner.enter_context(r(rows))
                    yield
            yield record if records else (lambda rows: nullcontext())

    def before_update(self, step: Step) -> dict:
        return self._merged(lambda i: i.before_update(step))

    def on_step(self, step: Step) -> dict:
        return self._merged(lambda i: i.on_step(step))

    def on_iteration(self, batch, row: dict) -> dict:
        """Each instrument sees the row with the metrics of those before it."""
        out = {}
        for item in self.items:
            out.update(item.on_iteration(batch, {**row, **out}))
        return out

    def on_eval(self, metrics: dict) -> dict:
        return self._merged(lambda i: i.on_eval(metrics))

    def close(self) -> None:
        for item in self.items:
            item.close()

    def _merged(self, hook) -> dict:
        out = {}
        for item in self.items:
            out.update(hook(item))
        return out
