"""Accuracy bands: a cold start that lands in the same place on any machine.

Cold-start SFT of a tiny model on a toy task crosses a sharp rise in held-out accuracy, and
where a fixed step count stops inside that rise differs between CPUs: floating-point results
depend on the kernels torch picks for the CPU (not measured here; plausibly vector width / AMX),
and small differences grow over hundreds of Adam steps. The same 600-step recipe gave 0.164 on
the project's AMD EPYC and 0.656 on a user's Intel Xeon (AVX-512/AMX), so every RL number
measured from it described one checkpoint.

- `sft.target_accuracy = [low, high]`: SFT evaluates every `sft.eval_every` steps and stops at
  the first eval inside the band (`SFTBand`); `sft.steps` becomes a budget. Exhausting it, or
  an eval that jumps from below `low` to above `high`, is an `AccuracyBandError` (one line
  naming the accuracies; the checkpoint is saved first). We raise on a jump rather than stop
  above the band: the band is the recipe's guarantee. The shipped recipe
  (experiments/ablation/sft.yaml) evaluates every 10 steps with a decaying lr; the steepest
  rise reported (0.09 at step 400 to 0.66 at step 600) is about 0.03 per 10 steps,
  and one eval of 256 prompts has a standard error of about 0.03, far less than the band's
  width of 0.2.
- `train.start_accuracy = [low, high]`: RL refuses to start when its iteration-0 eval of the
  initial policy (run for this check even with train.eval_every 0) is outside the band
  (`check_start_accuracy`), before any RL step.

The band, not the step count, is what a recipe promises on another machine: the step at which
SFT enters it may differ. Accuracies are greedy, averaged over data-parallel ranks, on the
run's validation split (`task.n_val`, `data.val_files` / `data.val_fraction`): the band chooses
the cold start, so it must not read the test split that reports the results (a noisy rising
curve stopped at its first high point regresses on the split that chose it). A run without a
validation split reads the test split, as before that split existed, with a warning.

`cold_start(sft_dir)` / `cold_start_line` name the cold start an experiment began from: the
SFT run's fingerprint (run.json) and checkpoint step, its band record and its test accuracy.
"""

from __future__ import annotations

import os

from megatron_gspo.config.schema import RunConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.run.metrics import read_jsonl
from megatron_gspo.run.record import read_record

ACC = "eval/accuracy"


class AccuracyBandError(ConfigError):
    """A run's held-out accuracy is not where its accuracy band says (one line; exit 2)."""


def in_band(accuracy: float, band) -> bool:
    return band[0] <= accuracy <= band[1]


def fmt_band(band) -> str:
    return f"[{band[0]:g}, {band[1]:g}]"


def check_start_accuracy(cfg: RunConfig, metrics: dict) -> None:
    """RL's hook after the iteration-0 eval: AccuracyBandError when `train.start_accuracy` is
    set and `metrics["eval/accuracy"]` (the initial policy's) is outside it."""
    band = cfg.train.start_accuracy
    if band is None or in_band(metrics[ACC], band):
        return
    source = f"init_checkpoint={cfg.init_checkpoint}" if cfg.init_checkpoint else \
        "the initial policy (no init_checkpoint)"
    raise AccuracyBandError(
        f"train.start_accuracy={fmt_band(band)}: {source} has held-out accuracy "
        f"{metrics[ACC]:.4f}, outside the band; refusing to start RL (make the cold start with "
        f"sft.target_accuracy={fmt_band(band)}, or change the band)")


class StartBand:
    """`train.start_accuracy` as RL's band in the run loop (`megatron_gspo.run.loop.Band`):
    the eval of the initial policy (step 0) must be inside it (`check_start_accuracy`); RL never
    stops inside a band, and its later evals are not checked."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def update(self, step: int, accuracy: float) -> bool:
        if step == 0:
            check_start_accuracy(self.cfg, {ACC: accuracy})
        return False

    def record(self) -> dict:
        return {}

    def summary(self) -> str:
        return ""

    def finish(self) -> None:
        return None


class SFTBand:
    """`sft.target_accuracy`'s stopping rule over SFT's evals, in step order.

    `update(step, accuracy)` returns True when SFT should stop here (the accuracy entered the
    band) and raises AccuracyBandError when it jumped past the band; `exhausted()` is the error
    for a budget spent below the band, which `finish()` raises. `record()` is what the final
    checkpoint / metrics keep; `resume` takes up a resumed run's. SFT's band in the run loop
    (`megatron_gspo.run.loop.Band`).
    """

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.band = cfg.sft.target_accuracy
        self.last: tuple[int, float] | None = None  # (step, accuracy) of the latest eval
        self.entered: int | None = None

    def update(self, step: int, accuracy: float) -> bool:
        previous, self.last = self.last, (step, accuracy)
        if self.band is None:
            return False
        if accuracy > self.band[1] and step == 0:
            raise AccuracyBandError(
                f"sft.target_accuracy={fmt_band(self.band)}: the policy before SFT already has "
                f"held-out accuracy {accuracy:.4f}, above the band")
        if accuracy > self.band[1]:
            before = f"from {previous[1]:.4f} at step {previous[0]} " if previous else ""
            raise AccuracyBandError(
                f"sft.target_accuracy={fmt_band(self.band)}: held-out accuracy jumped "
                f"{before}to {accuracy:.4f} at step {step}, past the band (checkpoint saved in "
                f"{self.cfg.run_dir}); start a new run_dir with a smaller sft.eval_every "
                f"(now {self.cfg.sft.eval_every}) or sft.lr (now {self.cfg.sft.lr:g})")
        if accuracy >= self.band[0]:
            self.entered = step
            return True
        return False

    def exhausted(self) -> AccuracyBandError:
        last = "" if self.last is None else \
            f"held-out accuracy {self.last[1]:.4f} at step {self.last[0]}; "
        return AccuracyBandError(
            f"sft.target_accuracy={fmt_band(self.band)}: not reached in sft.steps="
            f"{self.cfg.sft.steps} ({last}checkpoint saved in {self.cfg.run_dir}); raise "
            "sft.steps and run the same command to go on")

    def finish(self) -> None:
        """At the end of sft.steps: `exhausted()` when a band was set (SFT stops on entering
        it, so reaching the end means it was not)."""
        if self.band is not None:
            raise self.exhausted()

    def record(self) -> dict:
        """{"sft/start_accuracy": the checkpoint's accuracy, where RL starts, "sft/band_step":
        the step it entered the band}; {} before it did."""
        if self.entered is None:
            return {}
        return {"sft/start_accuracy": self.last[1], "sft/band_step": float(self.entered)}

    def summary(self) -> str:
        """Where SFT entered the band, in words (once it did)."""
        return (f"SFT entered sft.target_accuracy={fmt_band(self.band)} at step {self.entered}: "
                f"held-out accuracy {self.last[1]:.4f}")

    def resume(self, step: int, row: dict, record: dict) -> None:
        """Take up a resumed run at step `step`: its `record()` if it had stopped inside the
        band, else the eval in the saved step's row (the previous eval a jump is named from)."""
        if record:
            self.entered = int(record["sft/band_step"])
            self.last = (self.entered, record["sft/start_accuracy"])
        elif ACC in row:
            self.last = (step, row[ACC])


def cold_start(sft_dir: str) -> dict:
    """What RL from SFT run `sft_dir` begins with, read from the run dir: `fingerprint`
    (run.json's hash of the run's semantic config, `megatron_gspo.run.rundir`; None before the
    run was recorded), `step` (the checkpoint step `init_checkpoint` loads: the newest complete
    one; None without), `validation` (whether the run had a validation split, so its band chose
    on it; False: on the test split; None without a record), and from metrics.jsonl `band_step`
    and `start_accuracy` (the band record; None without) and `test_accuracy` (the test split's
    greedy accuracy at `step`, None where not logged)."""
    rows, record = _rows(sft_dir), read_record(sft_dir) or {}
    try:
        step = ckpt.newest_step(os.path.join(sft_dir, "checkpoints"))
    except (OSError, ValueError):  # no checkpoints / a garbled `latest`: no step to name
        step = None
    band = [r for r in rows if "sft/band_step" in r]
    test = [r["test/accuracy"] for r in rows if r["step"] == step and "test/accuracy" in r]
    return {"run_dir": sft_dir, "fingerprint": record.get("fingerprint"), "step": step,
            "validation": _had_validation(record["config"]) if record else None,
            "band_step": int(band[-1]["sft/band_step"]) if band else None,
            "start_accuracy": band[-1]["sft/start_accuracy"] if band else None,
            "test_accuracy": test[-1] if test else None}


def _had_validation(config: dict) -> bool:
    """Whether a recorded semantic config (run.json's) had a validation split."""
    return bool(config.get("task.n_val") or config.get("data.val_files")
                or config.get("data.val_fraction"))


def _rows(sft_dir: str) -> list[dict]:
    path = os.path.join(sft_dir, "metrics.jsonl")
    return read_jsonl(path) if os.path.isfile(path) else []


def cold_start_line(sft_dir: str) -> str:
    """One line on where an SFT run stopped (`cold_start`): the run's fingerprint and the
    checkpoint step RL starts from, in brackets where known (and that its band chose on the
    test split, for a run without a validation split), then its start accuracy and the step it
    entered sft.target_accuracy, and its test accuracy there where logged."""
    cold = cold_start(sft_dir)
    known = [f"run {cold['fingerprint'][:12]}" if cold["fingerprint"] else "",
             f"checkpoint step {cold['step']}" if cold["step"] is not None else "",
             "band on the test split" if cold["validation"] is False else ""]
    where = f"cold start {sft_dir}" + (f" [{', '.join(k for k in known if k)}]"
                                       if any(known) else "")
    if cold["band_step"] is not None:
        test = "" if cold["test_accuracy"] is None else \
            f"; test accuracy {cold['test_accuracy']:.4f}"
        return (f"{where}: start accuracy {cold['start_accuracy']:.4f}, entered the band at SFT "
                f"step {cold['band_step']}{test}")
    evals = [r for r in _rows(sft_dir) if "eval/accuracy" in r]
    last = f"accuracy {evals[-1]['eval/accuracy']:.4f} at step {evals[-1]['step']}" \
        if evals else "no eval logged"
    return f"{where}: no band record ({last})"
