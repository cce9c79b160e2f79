"""How fast a job goes and when it ends: the tail of its progress lines.

    [ 40/200] reward/mean=0.41 eval/accuracy=0.3 | 2.31 s/step, 1,234 tokens/s, ETA 0:06:09
    [eval 2/4] 1.20 s/batch, 3,410 tokens/s, ETA 0:00:02

`Pace` measures both: the time per step and the tokens per second since the previous line (what
the run does now), and the ETA from the mean time per step since this start (the evals and
saves between steps included, so a run with periodic evals is not promised too early). A
resumed run measures from its resume. Tokens are those of every rank (the job counts its rank's,
`tokens_over_ranks` adds the data-parallel replicas'), so tokens/s is the run's, not a rank's.

Plain lines rather than a redrawn bar (tqdm, rich): runs log to files and torchrun interleaves
its ranks' output, where a bar's carriage returns become noise. Nothing here is written to
metrics.jsonl: the rows keep their keys (`time/...` and `perf/...` there are the job's own).
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from megatron_gspo.dist import reduce_metrics


def format_duration(seconds: float) -> str:
    """H:MM:SS (hours unbounded), e.g. 0:06:09, 27:00:00."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def tokens_over_ranks(tokens: float, dp: int) -> float:
    """This rank's token count summed over the data-parallel replicas (the mean over every
    rank times `dp`: the TP ranks of a replica count the same tokens). Collective: every rank
    must call it."""
    return reduce_metrics({"tokens": float(tokens)})["tokens"] * dp


class Pace:
    """Step time, tokens/s and ETA of a job of `total` steps, `done` of them before this start;
    `clock` is the time source (tests pass their own)."""

    def __init__(self, total: int, done: int = 0, unit: str = "step",
                 clock: Callable[[], float] = time.perf_counter):
        self.total, self.unit, self._clock = total, unit, clock
        self._start = self._last = clock()
        self._start_done = self._last_done = done

    def summary(self, done: int, tokens: float) -> str:
        """'2.31 s/step, 1,234 tokens/s, ETA 0:06:09' after step `done`; `tokens`: those of the
        steps since the previous summary (0: tokens/s left out)."""
        now = self._clock()
        steps, seconds = done - self._last_done, now - self._last
        per_step = seconds / steps if steps > 0 else float("nan")
        parts = [f"{per_step:.2f} s/{self.unit}"]
        if tokens > 0 and seconds > 0:
            parts.append(f"{tokens / seconds:,.0f} tokens/s")
        if done > self._start_done:
            mean = (now - self._start) / (done - self._start_done)
            parts.append(f"ETA {format_duration(mean * (self.total - done))}")
        self._last, self._last_done = now, done
        return ", ".join(parts)


class ChunkProgress:
    """A progress line per chunk of an eval (`megatron_gspo.rollout.generate.evaluate`'s
    `progress`): called with (0, total, 0) before the first chunk and (k, total, tokens) after
    chunk k. Collective (tokens are summed over ranks): every rank calls it; the main rank
    prints, on stderr: `megatron-gspo eval`'s stdout is its JSON result."""

    def __init__(self, label: str, is_main: bool, dp: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.label, self.is_main, self.dp, self._clock = label, is_main, dp, clock
        self.pace: Pace | None = None

    def __call__(self, done: int, total: int, tokens: int) -> None:
        if done == 0 or self.pace is None:
            self.pace = Pace(total, unit="batch", clock=self._clock)
            if done == 0:
                return
        tokens = tokens_over_ranks(tokens, self.dp)
        if self.is_main:
            print(f"[{self.label} {done}/{total}] {self.pace.summary(done, tokens)}",
                  file=sys.stderr, flush=True)
