"""Metrics: one JSON line per logged step in run_dir/metrics.jsonl (+ optional wandb mirror).

    logger = MetricsLogger(run_dir, config_to_dict(cfg), wandb_mode="disabled")
    logger.log(step, {"reward/mean": 0.41, "policy/clip_frac/token": 0.012})

Each line is {"step": int, "time": unix seconds, **metrics}, appended with unbuffered writes: a
write that fails (disk full) truncates the file back to its last whole row and raises
a `UserError`, one line naming the file and the OS reason (the CLI exits 2). A resumed run calls
`drop_after(step)` first, so the rows of steps it will redo are not logged twice; rows it cannot
read are moved to `metrics.unreadable.txt` with their line numbers, and it says which. Keys follow `group/name[/stat]`.
Tensors and numpy scalars become Python numbers; non-finite floats are written as the strings
"nan", "inf", "-inf" (JSON has no NaN, and null would hide a blow-up). The file is opened in
append mode, so a resumed run keeps earlier lines. Only rank 0 logs: construct with
enabled=False elsewhere and every method is a no-op.

`MetricsLogger(..., file=EXPERT_LOAD_FILE, lists=True)` writes another file of such rows, whose
values may also be lists of numbers. `read_jsonl` reads the rows back, `read_metrics` as one
{step: value} series per key; `Timer` collects wall-clock section durations as `time/<section>`
metrics.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import socket
import sys
import time
from typing import Callable, Iterator, Sequence
from urllib.parse import urlparse

from megatron_gspo.errors import UserError
from megatron_gspo.run.checkpoint import atomic_write
from moe.platform.checks import MissingDependency

METRICS_FILE = "metrics.jsonl"
EXPERT_LOAD_FILE = "expert_load.jsonl"
"""Beside metrics.jsonl, in its format: the `expert_load` instrument's row per rollout batch,
{"step", "time", "tokens", "load": activations per expert, a list per MoE layer}
(`megatron_gspo.jobs.rl_instruments.ExpertLoad`)."""
UNREADABLE_FILE = "metrics.unreadable.txt"
"""Beside metrics.jsonl: rows a resume found unreadable, kept as they were with their line."""
WANDB_MODES = ("offline", "online", "disabled")


def _to_json_value(key: str, v, lists: bool = False):
    """A JSON-safe scalar: numbers stay numbers, non-finite floats become strings; with
    `lists`, a list (of lists) of them, element by element (`EXPERT_LOAD_FILE`'s rows)."""
    if lists and isinstance(v, (list, tuple)):
        return [_to_json_value(key, x, lists) for x in v]
    if hasattr(v, "item") and callable(v.item):  # torch tensor / numpy scalar or 1-elem array
        numel = getattr(v, "numel", None)
        size = numel() if callable(numel) else getattr(v, "size", 1)
        if size != 1:
            raise ValueError(f"metric {key!r}: expected a scalar, got {size} elements")
        v = v.item()
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        v = float(v)
        if math.isnan(v):
            return "nan"
        return v if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, str):
        return v
    raise ValueError(f"metric {key!r}: expected a number, got {type(v).__name__} {v!r}")


def _import_wandb(mode: str):
    try:
        import wandb  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise MissingDependency(f"wandb.mode={mode} needs the wandb package: pip install -e "
                                ".[wandb] (or set wandb.mode=disabled)") from None
    return wandb


class MetricsLogger:
    """Append-only JSONL metrics log for one run, optionally mirrored to wandb."""

    def __init__(self, run_dir: str, config_dict: dict | None = None,
                 wandb_mode: str = "disabled", project: str = "megatron-gspo",
                 name: str | None = None, enabled: bool = True, file: str = METRICS_FILE,
                 lists: bool = False):
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"wandb_mode={wandb_mode!r}: expected one of {WANDB_MODES}")
        self.enabled = enabled
        self.path = os.path.join(run_dir, file)
        self.lists = lists  # values may be lists of numbers (not metrics.jsonl's: wandb's)
        self._file = None
        self._wandb_run = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if os.path.lexists(self.path) and not os.path.isfile(self.path):
            what = "a folder" if os.path.isdir(self.path) else "not a regular file"
            raise UserError(f"{self.path} is {what}, where the run logs its metrics: move it "
                            "away")
        needs_newline = os.path.exists(self.path) and os.path.getsize(self.path) > 0 \
            and not _ends_with_newline(self.path)
        self._open()
        if needs_newline:  # a crash mid-line: keep it, but start ours on a fresh line
            self._append(b"\n", "a line break")
        if wandb_mode != "disabled":
            wandb = _import_wandb(wandb_mode)
            if wandb_mode == "online":
                wandb_mode = _online_or_offline()
            self._wandb_run = wandb.init(project=project, name=name, mode=wandb_mode,
                                         dir=run_dir, config=config_dict or {})

    def drop_after(self, step: int) -> int:
        """Remove rows with a step above `step` (logged after the checkpoint a run resumes
        from); returns how many rows left the file. Rows that cannot be read (cut off, or
        without a step) are moved to `UNREADABLE_FILE` ("metrics.jsonl:<line>: <text>",
        appended) with a warning naming their lines. The file is rewritten atomically."""
        if not self.enabled or not os.path.getsize(self.path):
            return 0
        with open(self.path, encoding="utf-8") as f:
            rows = [(i, ln) for i, ln in enumerate(f.read().splitlines(), 1) if ln.strip()]
        unreadable = [(i, ln) for i, ln in rows if _row_step(ln) is None]
        kept = [ln for _, ln in rows if (s := _row_step(ln)) is not None and s <= step]
        if unreadable:
            self._keep_aside(unreadable)
        if len(kept) < len(rows):
            self._file.close()
            text = "".join(ln + "\n" for ln in kept)
            atomic_write(self.path, lambda f: f.write(text.encode("utf-8")))
            self._open()
        return len(rows) - len(kept)

    def _keep_aside(self, rows: list[tuple[int, str]]) -> None:
        """Append `rows` (line number, text) to `UNREADABLE_FILE` and say so."""
        aside = os.path.join(os.path.dirname(self.path), UNREADABLE_FILE)
        before = b""
        if os.path.isfile(aside):
            with open(aside, "rb") as f:
                before = f.read()
        name = os.path.basename(self.path)
        text = "".join(f"{name}:{i}: {ln}\n" for i, ln in rows).encode("utf-8")
        atomic_write(aside, lambda f: f.write(before + text))
        lines = ", ".join(str(i) for i, _ in rows)
        print(f"WARNING: {self.path}: line{'s' if len(rows) > 1 else ''} {lines} cannot be "
              f"read (cut off, or no step): moved to {aside}", flush=True)

    def set_aside(self) -> str | None:
        """Move the rows of an earlier attempt that saved no checkpoint (a run restarting from
        step 0) to `metrics.prev<k>.jsonl` and start an empty file: its steps are not logged
        twice and nothing is lost. Returns the new name (None when there was nothing)."""
        if not self.enabled or not os.path.getsize(self.path):
            return None
        stem, ext = os.path.splitext(self.path)
        k = 1
        while os.path.exists(f"{stem}.prev{k}{ext}"):
            k += 1
        self._file.close()
        os.replace(self.path, f"{stem}.prev{k}{ext}")
        self._open()
        return f"{stem}.prev{k}{ext}"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append {"step", "time", **metrics} as one flushed line (and to wandb if on)."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.path} is closed")
        record = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if not isinstance(key, str) or key in record:
                raise ValueError(f"metric key {key!r}: must be a str other than 'step'/'time'")
            record[key] = _to_json_value(key, value, self.lists)
        self._append((json.dumps(record, allow_nan=False) + "\n").encode("utf-8"),
                     f"the row of step {int(step)}")
        if self._wandb_run is not None:
            numeric = {k: float(v) if isinstance(v, str) else v
                       for k, v in record.items() if k not in ("step", "time")
                       and (not isinstance(v, str) or v in ("nan", "inf", "-inf"))}
            self._wandb_run.log(numeric, step=int(step))

    def _open(self) -> None:
        self._file = open(self.path, "ab", buffering=0)  # every write reaches the OS at once

    def _append(self, data: bytes, what: str) -> None:
        """Append `data` whole, or truncate back to the size before and raise UserError."""
        start = os.fstat(self._file.fileno()).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[self._file.write(view):]
        except OSError as e:
            try:
                os.ftruncate(self._file.fileno(), start)  # no cut-off row
            except OSError:
                pass
            raise UserError(f"cannot append to {self.path}: {e.strerror or e}; {what} is not "
                               "logged, the rows before it and the checkpoints are unchanged") \
                from None

    def close(self) -> None:
        """Close the file and finish wandb; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _row_step(line: str) -> float | None:
    """The step of a row; None for a row that cannot be read (cut off, or without a step)."""
    try:
        step = json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _online_or_offline(timeout_s: float = 3.0) -> str:
    """"online" when wandb's server answers a TCP connect within `timeout_s`, else "offline"
    with a warning: wandb's own online start would retry for minutes and abort the run."""
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
        return "online"
    except OSError as e:
        print(f"WARNING: wandb server {url} unreachable ({e.strerror or e}); logging offline "
              "(upload later with `wandb sync`)", file=sys.stderr, flush=True)
        return "offline"


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_jsonl(path: str) -> list[dict]:
    """All records of a JSONL file, values as written ("nan"/"inf" stay strings). Blank lines
    are skipped, and so is a malformed *last* line (a crash mid-write); any other malformed
    line raises ValueError naming path:line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):
                break
            raise ValueError(f"malformed JSON at {path}:{i}: {e}") from None
    return records


def _number(v) -> float | None:
    """A finite float, or None for missing/"nan"/"inf"/non-numeric values."""
    if isinstance(v, bool):
        return None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return None
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def read_metrics(path: str) -> dict[str, dict[int, float]]:
    """Read one metrics.jsonl (`read_jsonl`: a malformed final line, a crash mid-write, is
    skipped) into {key: {step: value}}, the series `tools.plot_run` and the experiments' reports
    draw: missing, "nan" / "inf" and non-numeric values are left out, and so are records
    without a numeric `step`."""
    out: dict[str, dict[int, float]] = {}
    for i, rec in enumerate(read_jsonl(path), 1):
        if not isinstance(rec, dict):
            raise ValueError(f"expected a JSON object as record {i} of {path}, "
                             f"got {type(rec).__name__}")
        step = _number(rec.get("step"))
        if step is None:
            continue
        for k, v in rec.items():
            x = _number(v)
            if k != "step" and x is not None:
                out.setdefault(k, {})[int(step)] = x
    return out


class Timer:
    """Wall-clock stopwatch; repeated sections accumulate until `reset()`.

        timer = Timer()
        with timer("rollout"): ...
        timer.as_metrics()  # {"time/rollout": seconds}

    If CUDA is already initialised it synchronises at both ends of a section, so GPU work
    launched inside is counted (`cuda_sync=False` to skip).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, cuda_sync: bool = True):
        self._clock = clock
        self._cuda_sync = cuda_sync
        self._totals: dict[str, float] = {}

    def _sync(self) -> None:
        torch = sys.modules.get("torch")  # never import torch just to time
        if self._cuda_sync and torch is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"timer section name must be a non-empty str, got {name!r}")
        self._sync()
        t0 = self._clock()
        try:
            yield
        finally:
            self._sync()
            self._totals[name] = self._totals.get(name, 0.0) + (self._clock() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` timed elsewhere (another thread's) in section `name`."""
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def as_metrics(self) -> dict[str, float]:
        return {f"time/{name}": seconds for name, seconds in self._totals.items()}

    def reset(self) -> None:
        self._totals.clear()


def _fmt(v) -> str:
    if isinstance(v, bool) or isinstance(v, numbers.Integral):
        return str(int(v))
    if hasattr(v, "item") and callable(v.item):
        v = v.item()
    if isinstance(v, numbers.Real):
        return f"{float(v):.4g}"
    return str(v)


def format_progress(step: int, total: int, metrics: dict, keys: Sequence[str]) -> str:
    """One compact line, e.g. "[  3/20] reward/mean=0.41 policy/clip_frac/token=0.012"; keys
    missing from `metrics` are left out."""
    width = max(3, len(str(total)))
    parts = [f"[{step:>{width}}/{total}]"]
    parts += [f"{k}={_fmt(metrics[k])}" for k in keys if k in metrics]
    return " ".join(parts)
