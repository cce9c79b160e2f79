"""`megatron-gspo plan`'s packed column: a rank's forwards sized at real lengths.

With `train.pack` (`megatron_gspo.algo.packing`, `moe.model.packed`) a forward runs its rows'
real tokens, not every row at its full length; how many depends on the responses, which only a
run knows. Given a mean response length (`--mean-response-tokens`, or `response/length/mean` of
a run dir's metrics.jsonl: `mean_response_of`), the plan sizes each phase at rows of the prompt
bound plus that mean (`RowSizes`), beside the full-length bound: the no-grad and train forwards
as many such rows as fill their token budget (a bin holds at most max(budget, full row): a row
longer than the budget alone), the routing caches at real lengths (whole sequences on every TP
rank, `moe.routing.tokens`), and the step time on the real tokens (`plan_time.step_time`).
A mean is not a bound: the full-length column stays the bound the exit status reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatron_gspo.errors import ConfigError


@dataclass(frozen=True)
class Column:
    """The per-GPU rows of a plan sized another way (packed), aligned with `Plan.rows`."""

    values: tuple[float, ...]
    persistent: float
    phases: dict

    @property
    def peak(self) -> float:
        return self.persistent + max(self.phases.values())


@dataclass(frozen=True)
class RowSizes:
    """How the plan sizes the forwards over a rank's rows: every row at its full length `T`
    (`new` of them response positions), the bound; or packed (`real`: the mean real tokens of
    a row), each forward's rows' real tokens, binned within its budget."""

    T: int
    new: int
    real: float | None = None

    def forward(self, rows: int, budget: int) -> tuple[float, float, float]:
        """(rows, positions per row, scored positions per row) of the largest forward of
        `rows` rows within `budget` tokens (0: all of them); packed, rows of `real` tokens as
        many as fill the budget (a bin holds at most max(budget, T): a row longer than the
        budget alone)."""
        T, new, real = self.T, self.new, self.real
        if real is None:
            return (rows if not budget else min(rows, max(1, budget // T))), T, new
        tokens = rows * real if not budget else min(rows * real, max(budget, T))
        return tokens / real, real, real - (T - new)

    def routed(self, rows: int, tp_sp: int, packs: bool) -> float:
        """Tokens of `rows` rows a rank's routing caches hold: a padded run's, its sequence
        shard (`tp_sp` shards); a packing run's (`packs`), whole sequences on every TP rank
        (`moe.routing.tokens`), at full or real length."""
        return rows * (self.real or self.T) / (1 if packs else tp_sp)


def packed_sizes(T: int, new: int, mean_response: float) -> RowSizes:
    """Rows of the prompt bound plus `mean_response` real tokens (at most `new`)."""
    return RowSizes(T, new, T - new + min(mean_response, new))


def packed_lines(plan, cfg, mean_response: float | None) -> list[str]:
    """What the packed column assumes (nothing without it)."""
    if mean_response is None:
        return []
    if not cfg.train.pack:
        return [f"packed: none (train.pack=false: every forward pads its rows; the mean "
                f"response {mean_response:g} is not used)"]
    f = plan.facts
    real = packed_sizes(f["T"], f["new"], mean_response).real
    return [f"packed (train.pack): rows of {real:,.0f} real tokens on average ({f['T'] - f['new']}"
            f" prompt + a mean response of {min(mean_response, f['new']):g}); each forward's "
            f"rows binned within its token budget (train.micro_max_tokens="
            f"{cfg.train.micro_max_tokens}, train.logprob_max_tokens="
            f"{cfg.train.logprob_max_tokens}; 0: all rows)"]


def packed_assumption(real: float) -> str:
    return (f"packed column: the pi_old and train FLOPs of the real tokens only (rows of "
            f"{real:,.0f} on average, attention at that context), the rollout as at full length "
            "(decoding runs until the longest response ends); each forward's memory at as many "
            "mean rows as fill its token budget (at most max(budget, a full row)), the routing "
            "caches at real lengths (whole sequences on every TP rank); a mean, not a bound")


def mean_response_of(run_dir: str) -> float:
    """The mean of `response/length/mean` over a run dir's metrics.jsonl rows; ConfigError (one
    line) when there is none."""
    # function-level: the metrics reader is the run room's, needed for this option only
    from megatron_gspo.run.metrics import read_jsonl

    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        values = [r["response/length/mean"] for r in read_jsonl(path)
                  if isinstance(r.get("response/length/mean"), (int, float))]
    except (OSError, ValueError) as e:
        raise ConfigError(f"--run-dir {run_dir}: cannot read {path}: {e}") from None
    if not values:
        raise ConfigError(f"--run-dir {run_dir}: {path} has no response/length/mean")
    return sum(values) / len(values)
