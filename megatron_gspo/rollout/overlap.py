"""Rollout batches sampled beside the trainer, at most `rollout.max_staleness` versions old.

Shape legend: B sequences.

Versions: the weights the trainer holds at the start of rollout batch v (v batches trained) are
version v. With k = `rollout.max_staleness` > 0, `StaleRollouts` has batch j sampled by version
max(first, j - k), `first` being the batch this start began at (0, or the one a resume continues
from): at the start of batch v the trainer publishes its weights to the sampler (`Beside.publish`:
a copy in this process, or a push to engine servers) and one background thread samples batch
v + k while the trainer trains on batch v. So batch j is exactly min(k, j - first) versions old
however long anything takes: the wall clock decides how long the trainer waits for a batch, not
which weights sampled it, and a seed's run is the same on any machine. (AReaL, arXiv 2505.24298,
bounds staleness by k; here the bound is met exactly, so a run at k measures k.)

The sampler holds one version at a time, as an engine does: before publishing version v the
trainer waits for the batches of older versions still being sampled. So at most k sampled
batches wait and one more is being sampled (memory stays bounded), and k >= 2 overlaps no more
than k = 1: one batch's sampling with one batch's training.

Rewards are scored when the trainer takes a batch (`finish`, on its thread, where a reward's
time limit works); the thread samples only.

Faults: a batch whose sampling failed (an engine server lost: `EngineLost`) makes the thread
sample nothing more until the trainer, at its next take, asks the sampler to recover
(`Beside.recover`: restart and re-push, or one line) and samples the batches from the failed
one on again, by its weights of now (their staleness then below k, as recorded). An engine that
falls behind makes the trainer wait, never train on an older batch; a hung one is lost after
its timeout (`rollout.vllm.request_timeout_s`). `close` drops the batches sampled ahead and says
so in one line: a resume samples them again, by its checkpoint's weights, so no batch is
trained twice and none is skipped, but the first k after a resume are fresher than they would
have been.

Departure from AReaL: no partial rollouts (a response never spans a weight push: each batch is
sampled whole by one version, and R3 replays that version's routes).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Protocol

import torch

from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.rollout.sampler import Samples, SamplingParams


class Beside(Protocol):
    """A sampler over weights of its own that the trainer publishes (a backend whose
    `Backend.beside` says it can; its run sampler's `beside(make_policy)` builds one)."""

    def publish(self) -> dict:
        """Trainer's thread, nothing being sampled: take the policy's weights as they are now;
        returns metrics (`time/weight_sync`, ...)."""

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Samples:
        """The producer's thread: samples by the weights published last, never reading the
        policy's."""

    def recover(self, error: Exception) -> None:
        """Trainer's thread, after `sample` raised `error`: make sampling possible again (an
        engine restarted, weights to push again), or raise (one line)."""

    def close(self) -> None:
        """Release what it holds of its own (the run's sampler closes a shared engine)."""


Produce = Callable[[int, Beside], tuple[RolloutBatch, dict]]
"""`produce(j, sampler)`: rollout batch j sampled by `sampler` (unscored), with its metrics."""


class Skipped(RuntimeError):
    """A batch not sampled because an earlier one failed."""


class StaleRollouts:
    """Rollout batches sampled ahead by `beside` in one background thread (module docstring).
    `produce` samples batch j (in that thread), `finish(batch)` completes it on the trainer's
    thread (rewards), `total` batches at most, `say` prints a line (the main rank's)."""

    def __init__(self, produce: Produce, beside: Beside, k: int, total: int,
                 finish: Callable[[RolloutBatch], None] = lambda batch: None,
                 say: Callable[[str], None] = print):
        if k < 1:
            raise ValueError(f"max_staleness={k}: StaleRollouts samples ahead (k >= 1)")
        self.produce, self.beside, self.k, self.total = produce, beside, k, total
        self.finish, self.say = finish, say
        self.pending: dict[int, tuple[int, Future]] = {}  # batch -> (version, its sampling)
        self.next: int | None = None  # the next batch to submit
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False  # a batch failed: the thread skips the rest until recovered
        self.thread: threading.Thread | None = None
        self.published: dict = {}  # the last publish's metrics

    # ------------------------------------------------------------------ trainer's thread
    def take(self, it: int) -> tuple[RolloutBatch, dict, float]:
        """Batch `it`: publishes version `it` and submits batch it + k where due, waits for
        batch `it`, scores it (`finish`). Returns it (its `version_B` set), the metrics of its
        sampling and of the publish, and the seconds its sampling took."""
        if self.next is None:
            self.next = it
        if it not in self.pending and it < self.next:
            raise RuntimeError(f"rollout batch {it} was taken already (or never sampled)")
        # a take that publishes nothing: the last publish's counters, 0 seconds of it
        published = {k: 0.0 if k.startswith("time/") else v for k, v in self.published.items()}
        while True:
            failed = self._settle() if self._due(it) else None
            if failed is None:
                published = self._publish_and_submit(it) or published
                failed = self._failed(it)
            if failed is None:
                break
            self._recover(failed)
        version, future = self.pending.pop(it)
        batch, metrics, seconds = future.result()
        batch.version_B = torch.full((len(batch),), version, dtype=torch.long)
        self.finish(batch)
        return batch, {**metrics, **published}, seconds

    def idle(self) -> None:
        """Wait until nothing is being sampled (before the trainer uses the run's sampler
        itself: an eval on the same engine); a failure surfaces at the next `take`."""
        for _, future in list(self.pending.values()):
            future.exception()

    def close(self) -> None:
        """Stop the thread (after the batch it samples) and drop what was sampled ahead, in one
        line."""
        self.broken = True
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None
        if self.pending:
            ahead = sorted(self.pending)
            versions = sorted({v for v, _ in self.pending.values()})
            self.say(f"rollout.max_staleness={self.k}: dropped rollout batch(es) "
                     f"{_span(ahead)}, sampled ahead by weights of version {_span(versions)}; "
                     "a resume samples them again by its checkpoint's weights")
            self.pending.clear()
        self.beside.close()

    def _due(self, it: int) -> bool:
        return self.next <= min(it + self.k, self.total - 1)

    def _publish_and_submit(self, it: int) -> dict:
        """Publish version `it` and submit the batches it samples (it + k, or first..first + k
        at the start), if any are due; returns the publish's metrics."""
        if not self._due(it):
            return {}
        metrics = self.published = self.beside.publish()
        for j in range(self.next, min(it + self.k, self.total - 1) + 1):
            future = Future()
            self.pending[j] = (it, future)
            self._start()
            self.jobs.put((j, future))
        self.next = min(it + self.k, self.total - 1) + 1
        return metrics

    def _settle(self) -> int | None:
        """Wait for every batch submitted; the first that failed, or None."""
        failed = [j for j, (_, f) in sorted(self.pending.items())
                  if f.exception() is not None]
        return failed[0] if failed else None

    def _failed(self, j: int) -> int | None:
        """Wait for batch j; j if it failed (then for every batch submitted), else None."""
        return None if self.pending[j][1].exception() is None else self._settle()

    def _recover(self, failed: int) -> None:
        """Batch `failed` raised: the sampler recovers (or raises its line), and the batches
        from it on are submitted again (at the next publish)."""
        error = self.pending[failed][1].exception()
        self.beside.recover(error)
        again = sorted(j for j in self.pending if j >= failed)
        for j in again:
            del self.pending[j]
        self.next, self.broken = failed, False
        self.say(f"rollout.max_staleness={self.k}: sampling rollout batch {failed} failed "
                 f"({error}); the sampler recovered: rollout batch(es) {_span(again)} are "
                 "sampled again by the weights of now")

    # ------------------------------------------------------------------ the producer's thread
    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="rollouts", daemon=True)
            self.thread.start()

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            j, future = job
            if self.broken:
                future.set_exception(Skipped(f"rollout batch {j}: an earlier one failed"))
                continue
            t0 = time.perf_counter()
            try:
                batch, metrics = self.produce(j, self.beside)
            except Exception as e:  # the trainer's thread hears it when it takes a batch
                self.broken = True
                future.set_exception(e)
                continue
            future.set_result((batch, metrics, time.perf_counter() - t0))


def _span(values: list[int]) -> str:
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def staleness_metrics(batch: RolloutBatch, iteration: int) -> dict[str, float]:
    """`rollout/staleness/{mean,max}`: versions between the weights that sampled each row and
    those it trains (0 without `version_B`: sampled by the trainer's weights of now)."""
    if batch.version_B is None:
        return {"rollout/staleness/mean": 0.0, "rollout/staleness/max": 0.0}
    stale_B = (iteration - batch.version_B).double()
    return {"rollout/staleness/mean": float(stale_B.mean()),
            "rollout/staleness/max": float(stale_B.max())}
