"""Rollout batches sampled beside the trainer (megatron_gspo.rollout.overlap), with a fake
sampler: which weights sample which batch, the bound on what waits, a sampler that falls behind,
fails or is stopped. The trainer-level runs are in tests/megatron_gspo/jobs/test_rl_staleness.py."""

import threading
import time

import pytest
import torch

from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.rollout.overlap import StaleRollouts, staleness_metrics


class Fake:
    """A `Beside` sampler over a counter of weights: `publish` takes the trainer's `weights`
    (its version), `sample` records which version sampled which batch, and how many batches
    were waiting or being sampled at that moment."""

    def __init__(self, trainer: dict, fail_at: set | None = None, recover_error=None,
                 delay_s: float = 0.0):
        self.trainer, self.fail_at, self.recover_error = trainer, set(fail_at or ()), recover_error
        self.delay_s, self.held = delay_s, None
        self.sampled, self.publishes, self.recovered, self.closed = [], [], [], False

    def publish(self) -> dict:
        self.held = self.trainer["version"]
        self.publishes.append(self.held)
        return {"time/weight_sync": 1.0, "rollout/pushed": float(self.held)}

    def sample(self, j: int, stale: StaleRollouts) -> tuple[RolloutBatch, dict]:
        held = self.held
        time.sleep(self.delay_s)  # an engine slower than the trainer
        if j in self.fail_at:
            self.fail_at.discard(j)
            raise ConnectionError(f"engine lost while sampling batch {j}")
        if self.held != held:  # it holds one version: none may be published while it samples
            raise AssertionError(f"version {self.held} published while batch {j} was sampled")
        self.sampled.append((j, held, len(stale.pending)))
        return batch_of(j), {"filter/rounds": 1.0}

    def recover(self, error: Exception) -> None:
        self.recovered.append(str(error))
        if self.recover_error is not None:
            raise self.recover_error

    def close(self) -> None:
        self.closed = True


def batch_of(j: int, rows: int = 2) -> RolloutBatch:
    t = torch.zeros(rows, 3)
    return RolloutBatch(t.long(), t.bool(), t.bool(), t, torch.zeros(rows),
                        torch.zeros(rows, dtype=torch.long), [str(j)] * rows, [j] * rows)


def stale_rollouts(fake: Fake, k: int, total: int, lines: list | None = None) -> StaleRollouts:
    box = {}
    stale = StaleRollouts(lambda j, sampler: sampler.sample(j, box["stale"]), fake, k, total,
                          finish=lambda batch: setattr(batch, "rewards_B", batch.rewards_B + 1),
                          say=(lines if lines is not None else []).append)
    box["stale"] = stale
    return stale


def train(stale: StaleRollouts, trainer: dict, first: int, last: int) -> list[tuple]:
    """Take batches first..last, each trained (the weights' version + 1) after it is taken;
    returns (batch, version that sampled it, staleness) of each. Every take reports the last
    publish's metrics, its time as 0 when it published nothing."""
    out = []
    for it in range(first, last + 1):
        assert trainer["version"] == it
        n = len(stale.beside.publishes)
        batch, metrics, seconds = stale.take(it)
        assert batch.examples[0] == it and bool((batch.rewards_B == 1).all())  # scored here
        assert metrics["filter/rounds"] == 1.0 and seconds >= 0
        assert metrics["time/weight_sync"] == float(len(stale.beside.publishes) > n)
        assert metrics["rollout/pushed"] == stale.beside.publishes[-1]
        out.append((it, int(batch.version_B[0]),
                    staleness_metrics(batch, it)["rollout/staleness/max"]))
        trainer["version"] += 1
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batch_j_is_sampled_by_version_j_minus_k_and_at_most_k_more_wait(k):
    """Batch j by weights of version max(0, j - k), published once per taken batch; while one
    is sampled at most k others are waiting or being sampled (it included: k + 1)."""
    trainer = {"version": 0}
    fake = Fake(trainer)
    stale = stale_rollouts(fake, k, total=8)
    got = train(stale, trainer, 0, 7)
    stale.close()
    assert got == [(j, max(0, j - k), min(j, k)) for j in range(8)]
    assert fake.publishes == list(range(8 - k))  # no weights published that sample nothing
    assert max(n for _, _, n in fake.sampled) <= k + 1
    assert [j for j, _, _ in fake.sampled] == list(range(8)) and fake.closed


def test_a_sampler_slower_than_the_trainer_makes_it_wait_never_train_older_batches():
    """An engine that falls behind: the same versions as a fast one (the trainer waits)."""
    trainer = {"version": 0}
    stale = stale_rollouts(Fake(trainer, delay_s=0.02), 1, total=5)
    assert train(stale, trainer, 0, 4) == [(0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 2, 1), (4, 3, 1)]
    stale.close()


def test_a_resumed_start_samples_its_first_batches_by_the_resumed_weights():
    """Started at batch 5 (a resume): batches 5 and 6 by version 5, then one version old."""
    trainer = {"version": 5}
    stale = stale_rollouts(Fake(trainer), 2, total=9)
    assert train(stale, trainer, 5, 8) == [(5, 5, 0), (6, 5, 1), (7, 5, 2), (8, 6, 2)]
    stale.close()


def test_a_failed_batch_is_recovered_and_sampled_again_by_the_weights_of_now():
    """The sampler fails on batch 2 (sampled during batch 1's training): the next take asks
    it to recover, says so in one line, and samples batch 2 again by version 2 (staleness 0,
    as recorded); nothing is trained twice or skipped."""
    trainer, lines = {"version": 0}, []
    fake = Fake(trainer, fail_at={2})
    stale = stale_rollouts(fake, 1, total=5, lines=lines)
    assert train(stale, trainer, 0, 4) == [(0, 0, 0), (1, 0, 1), (2, 2, 0), (3, 2, 1), (4, 3, 1)]
    stale.close()
    assert fake.recovered == ["engine lost while sampling batch 2"]
    assert lines == ["rollout.max_staleness=1: sampling rollout batch 2 failed (engine lost "
                     "while sampling batch 2); the sampler recovered: rollout batch(es) 2 are "
                     "sampled again by the weights of now"]


def test_batches_after_a_failed_one_are_not_sampled_until_it_recovered():
    """k = 2, batch 0 fails: batches 1 and 2 (submitted with it) are skipped, not sampled by
    the failed engine, and all three are sampled again by version 0 after the recovery."""
    trainer = {"version": 0}
    fake = Fake(trainer, fail_at={0})
    stale = stale_rollouts(fake, 2, total=4)
    assert train(stale, trainer, 0, 3) == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 2)]
    stale.close()
    assert [j for j, _, _ in fake.sampled] == [0, 1, 2, 3] and len(fake.recovered) == 1


def test_a_sampler_that_cannot_recover_stops_the_run_with_its_own_line():
    trainer = {"version": 0}
    fake = Fake(trainer, fail_at={1}, recover_error=RuntimeError("no restarts left"))
    stale = stale_rollouts(fake, 1, total=4)
    stale.take(0)
    trainer["version"] = 1
    with pytest.raises(RuntimeError, match="^no restarts left$"):
        stale.take(1)
    stale.close()
    assert fake.closed and not stale.thread


def test_close_drops_what_was_sampled_ahead_in_one_line_and_ends_the_thread():
    trainer, lines = {"version": 0}, []
    stale = stale_rollouts(Fake(trainer), 2, total=10, lines=lines)
    train(stale, trainer, 0, 1)
    thread = stale.thread
    stale.idle()
    stale.close()
    assert not thread.is_alive() and not stale.pending
    assert lines == ["rollout.max_staleness=2: dropped rollout batch(es) 2-3, sampled ahead by "
                     "weights of version 0-1; a resume samples them again by its checkpoint's "
                     "weights"]


def test_idle_waits_until_nothing_is_being_sampled():
    """Before the trainer uses the run's sampler itself (an eval on the same engine)."""
    trainer, release = {"version": 0}, threading.Event()
    fake = Fake(trainer)
    real = fake.sample
    fake.sample = lambda j, stale: (release.wait(), real(j, stale))[1]
    stale = stale_rollouts(fake, 1, total=3)
    threading.Timer(0.05, release.set).start()
    stale.take(0)  # waits for batch 0 only
    stale.idle()
    assert all(f.done() for _, f in stale.pending.values()) and len(fake.sampled) == 2
    stale.close()


def test_staleness_without_versions_is_zero():
    assert staleness_metrics(batch_of(0), 3) == {"rollout/staleness/mean": 0.0,
                                                 "rollout/staleness/max": 0.0}
