"""One run lifetime for every job: resume -> start eval and accuracy band -> steps (log, save on
cadence or signal) -> finish.

A job (`megatron_gspo.jobs`: GSPO / GRPO RL, cold-start SFT) plugs in through `Job`: its
`Schedule` (how many steps; when to evaluate, save, print), its state (a dataclass every
checkpoint carries), its accuracy `Band`, one step (`iteration`) and one eval. `RunLoop` owns
everything around them, the same code for both jobs (OLMo-core's split of a trainer that owns
the loop and a train module that owns the step):

1. resume: building the loop restores the newest good checkpoint's policy, RNG and job state
   (`megatron_gspo.run.resume`); without one the run starts at step 0.
2. a run with nothing left to do (every step done, or stopped inside its band) says so.
3. a fresh run evaluates its initial policy (`Schedule.start_eval`, on the validation split)
   and asks the band: RL refuses a start outside `train.start_accuracy` before any step (and
   forgets the record of the refused start), SFT stops at once if already inside
   `sft.target_accuracy`; then the test split's first eval (`Job.test`). Step 0's row has both.
4. each step's row is logged at the job's optimizer step, with its eval where due (averaged over
   data-parallel ranks) and the band's verdict on it, and the test split's last eval at the
   run's last step (the schedule's last, or where the band stops it); weights gone non-finite
   stop the run before a save; then a progress line, and a checkpoint every `save_every`
   steps, at the last one and at a signal (SIGTERM, Ctrl-C, SIGHUP:
   `megatron_gspo.run.preempt`), after which `Preempted` (exit 128 + the signal) unless that
   was the last step.
5. finish: the band's last word (SFT's budget spent below its band is an error, its checkpoint
   saved first); the run dir is released however the run ends.

The test split is read at the first and the last step only, and nothing chooses on it: the band
reads `Job.evaluate`'s `eval/accuracy` (the validation split).

Each checkpoint's `extra` is the job state's `to_checkpoint()` plus two keys of the loop's:
`eval`, the saved step's row (the name SFT checkpoints have always used), and `band`, the band's
record once the run stopped inside it. A job's `restore` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from megatron_gspo.errors import ConfigError
from megatron_gspo.dist import all_ranks, reduce_metrics
from megatron_gspo.run.metrics import format_progress
from megatron_gspo.run.preempt import Preempted, Preemption
from megatron_gspo.run.resume import save_state, try_resume
from megatron_gspo.run.rundir import forget_run

ACC = "eval/accuracy"


@dataclass(frozen=True)
class Schedule:
    """A job's steps, and after which step n (1-based) the loop evaluates, saves and prints a
    progress line: every `*_every` steps (0: never by count) and, with `*_last`, after the
    last step too."""

    total: int
    """Steps in the run (`train.steps` rollout batches, `sft.steps` SFT steps)."""
    steps_key: str
    """The config key of `total`, for messages."""
    unit: str
    """One step in messages ("rollout batch")."""
    units: str
    """Several steps in messages ("rollout batches")."""
    start_eval: bool = True
    """Evaluate the initial policy (step 0) of a fresh run, and ask the band about it."""
    eval_every: int = 0
    eval_last: bool = False
    save_every: int = 0
    save_last: bool = False
    progress_every: int = 0
    progress_last: bool = False
    progress_keys: tuple[str, ...] = ()
    """The metrics of a progress line (`megatron_gspo.run.metrics.format_progress`)."""

    def _due(self, every: int, last: bool, n: int) -> bool:
        return bool(every) and n % every == 0 or last and n == self.total

    def eval_due(self, n: int) -> bool:
        return self._due(self.eval_every, self.eval_last, n)

    def save_due(self, n: int) -> bool:
        return self._due(self.save_every, self.save_last, n)

    def progress_due(self, n: int) -> bool:
        return self._due(self.progress_every, self.progress_last, n)


class JobState(Protocol):
    """A job's counters and streams besides the weights: a dataclass that checkpoints carry."""

    @property
    def done(self) -> int:
        """Steps of `Schedule.total` done."""

    @property
    def log_step(self) -> int:
        """Optimizer steps done: the metrics' step of the row that ends the latest step."""

    def to_checkpoint(self) -> dict:
        """What a checkpoint keeps of the state (`Job.restore` reads it back)."""


class Band(Protocol):
    """An accuracy band over the run's evals (`megatron_gspo.jobs.band`)."""

    def update(self, step: int, accuracy: float) -> bool:
        """After the eval of step `step` (0: the initial policy): True when the run stops
        here, inside the band; a ConfigError (one line) when the accuracy is outside it."""

    def record(self) -> dict:
        """Metrics marking where the run stopped inside the band ({} before it did); logged
        with that step's row and saved with its checkpoint: a run that holds one is done."""

    def summary(self) -> str:
        """Where the run stopped inside the band, in words (once `record()` is not empty)."""

    def finish(self) -> None:
        """After the run's last step: a ConfigError when the band needed entering."""


class Job(Protocol):
    """What a job gives the run loop: its schedule, its state, its band, a step and an eval."""

    schedule: Schedule
    state: JobState
    band: Band

    def iteration(self) -> dict:
        """Run step `state.done + 1` and count it in `state`; returns the metrics of the row
        that ends it, averaged over ranks (rows inside a step, RL's minibatches, it logs
        itself)."""

    def evaluate(self) -> dict:
        """Validation metrics of the policy now, with `eval/accuracy` (this rank's)."""

    def test(self) -> dict:
        """Test-split metrics of the policy now (`test/...`; {} without a test split)."""

    def restore(self, extra: dict) -> None:
        """Take up the state a checkpoint saved: `state.to_checkpoint()` and the loop's
        `eval` and `band` keys (older checkpoints of the job included)."""


class RunLoop:
    """`job`'s run lifetime on runtime `rt` (`megatron_gspo.run.setup.Runtime`). Building it
    resumes run_dir's newest good checkpoint into the policy and `job.state`; `run()` does the
    rest and releases the run dir however it ends. `preemption`: the signal handler's context
    (`Preemption`, which tests replace)."""

    def __init__(self, rt, job: Job, preemption: Callable[[], Preemption] | None = None):
        self.rt, self.job = rt, job
        self.preemption = preemption or Preemption
        extra = try_resume(rt)
        self.resumed = extra or {}
        if extra is not None:
            job.restore(extra)

    def run(self) -> dict:
        """Run to the end of the schedule (or into the band); returns the last row. A signal
        saves and raises `Preempted`; a band that refuses the run raises its ConfigError."""
        try:
            return self._run()
        finally:
            self.rt.close()

    def _run(self) -> dict:
        """Nothing to do, or the start eval, then the steps under the signal handlers, then
        the band's last word."""
        job = self.job
        done = self._nothing_to_do()
        if done is not None:
            return done
        row = self._start()
        if job.band.record():
            return row
        with self.preemption() as stop:
            while job.state.done < job.schedule.total:
                row = self._step()
                if job.band.record():
                    return row
                self._save_or_stop(stop.requested(), row)
        job.band.finish()
        return row

    def _nothing_to_do(self) -> dict | None:
        """A run stopped inside its band (returns its saved row and record), or with every
        step done (returns {}; the band has its last word: SFT short of its band is still
        refused), says so; None for a run with steps to go."""
        job, sched, run_dir = self.job, self.job.schedule, self.rt.cfg.run_dir
        if job.band.record():
            self._say(f"{run_dir}: {job.band.summary()}; nothing to do")
            return {**self.resumed.get("eval", {}), **job.band.record()}
        if job.state.done < sched.total:
            return None
        self._say(f"{run_dir} already finished {job.state.done} of {sched.steps_key}="
                  f"{sched.total} {sched.units}; nothing to do (raise {sched.steps_key} to "
                  "continue it)")
        job.band.finish()
        return {}

    def _start(self) -> dict:
        """A fresh run's step 0: the eval of its initial policy (where the schedule has one)
        and the band's verdict on it, then the test split's first eval; logged at step 0 (if
        anything was evaluated). {} when the run resumed."""
        if self.job.state.done:
            return {}
        row = self._evaluate() if self.job.schedule.start_eval else {}
        stop = bool(row) and self._verdict(0, row)
        row.update(self._test())
        if stop:
            self._stop_in_band(0, row)
        elif row:
            self._log(row)
        return row

    def _step(self) -> dict:
        """One step of the job: its row, with its eval where due, the test split's last eval
        at the run's last step, logged (and saved with the band's record where the band stops
        the run), the weights checked, a progress line where due; returns the row."""
        job, sched = self.job, self.job.schedule
        row = job.iteration()
        n = job.state.done
        stop = False
        if sched.eval_due(n):
            row.update(self._evaluate())
            stop = self._verdict(n, row)
        if stop or n == sched.total:
            row.update(self._test())
        if stop:
            self._stop_in_band(n, row)
            return row
        self._log(row)
        self._check_weights(n)
        if self.rt.info.is_main and sched.progress_due(n):
            print(format_progress(n, sched.total, row, sched.progress_keys), flush=True)
        return row

    def _verdict(self, n: int, row: dict) -> bool:
        """The band's verdict on step n's eval: True where the run stops inside it. Outside:
        the row is logged and the step saved (step 0: a refused start saves nothing, and
        forgets the run's record if this start wrote it, so a corrected re-run is a first
        start), then the band's error."""
        try:
            return self.job.band.update(n, row[ACC])
        except ConfigError:
            self._log(row)
            if n:
                self._save(n, row)
            elif self.rt.first_start:  # not the record of a run finished before (save_every 0)
                forget_run(self.rt.cfg.run_dir, self.rt.job)
            raise

    def _stop_in_band(self, n: int, row: dict) -> None:
        """Step n's row, with the band's record, logged and saved: the run stops here."""
        band = self.job.band
        row.update(band.record())
        self._log(row)
        self._save(n, row)
        self._say(f"{band.summary()}; saved in {self.rt.cfg.run_dir}")

    def _save_or_stop(self, signum: int, row: dict) -> None:
        """Save step n where the schedule says or a signal came (every rank agrees on it);
        after a signal, `Preempted` unless n was the last step (then the run is done)."""
        n, sched = self.job.state.done, self.job.schedule
        if sched.save_due(n) or signum:
            self._save(n, row)
        if signum and n < sched.total:
            raise Preempted(signum, f"stopped at {sched.unit} {n} of {sched.total}; checkpoint "
                            f"saved in {self.rt.cfg.run_dir}; run the same command to resume")

    def _save(self, n: int, row: dict) -> None:
        record = self.job.band.record()
        extra = {**self.job.state.to_checkpoint(), "eval": row}
        save_state(self.rt, n, {**extra, "band": record} if record else extra)

    def _check_weights(self, n: int) -> None:
        """FloatingPointError once an update has left a weight NaN / inf (every rank agrees),
        before anything is saved: the checkpoints already written stay the last good ones."""
        params = self.rt.policy.model.module.parameters()
        finite = torch.stack([p.isfinite().all() for p in params])
        if not all_ranks(bool(finite.all())):  # one device sync, not one per parameter
            raise FloatingPointError(
                f"the policy's weights are not finite after {self.job.schedule.unit} {n} "
                f"(optimizer step {self.job.state.log_step}; lr too high?); not saved: "
                f"checkpoints in {self.rt.cfg.run_dir} are untouched")

    def _evaluate(self) -> dict:
        return reduce_metrics(self.job.evaluate())

    def _test(self) -> dict:
        return reduce_metrics(self.job.test())

    def _log(self, row: dict) -> None:
        self.rt.logger.log(self.job.state.log_step, row)

    def _say(self, line: str) -> None:
        if self.rt.info.is_main:
            print(line, flush=True)
