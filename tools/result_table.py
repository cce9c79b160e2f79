"""Markdown result tables from runs' metrics.jsonl (`python -m tools.plot_run --table`).

Usage:
    python -m tools.plot_run runs/ablation/*_s* --group-by-prefix --table
    python -m tools.plot_run RUN... --group-by-prefix --table --stat eval/accuracy:final \\
        --stat reward/mean:last10% --readme experiments/ablation/README.md --marker main

One column per arm (seeds grouped by `--group-by-prefix`, as for the figures), one row per
`KEY:REDUCER[=LABEL]` statistic (the label defaults to `KEY:REDUCER`), each cell the mean ± sample standard deviation (ddof 1) over the arm's
seeds of the reducer applied to each seed's logged values (in step order; "nan"/"inf" and
absent values skipped; a cell is "-" when no seed has the key). Reducers:

    start      the first logged value (eval/accuracy: the iteration-0 eval, RL's start accuracy)
    final      the last logged value             best     the largest
    mean       the mean of all values            firstP%  / lastP%: mean of the first / last
                                                 P% of the values (at least one)

The start accuracy (eval/accuracy:start) is always a row, first unless listed. Above the table, one line
names the machine (/proc/cpuinfo's `model name`), the UTC date and the torch and megatron-core
versions, since numbers of a tiny model on a CPU are one machine's. With `--readme`, the table
replaces what lies between `<!-- table:MARKER:begin -->` and `<!-- table:MARKER:end -->` (with
no `--marker`: `<!-- table:begin -->` / `<!-- table:end -->`), so no number there is hand-typed.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import math
import platform
import re
import sys
from importlib.metadata import PackageNotFoundError, version

import numpy as np

START = "eval/accuracy:start"
REDUCER_RE = re.compile(r"^(start|final|best|mean|(first|last)(\d+(?:\.\d+)?)%)$")


def reduce_values(values: list[float], reducer: str) -> float:
    """One seed's statistic of its values in step order (non-empty)."""
    m = REDUCER_RE.match(reducer)
    if not m:
        raise ValueError(f"unknown reducer {reducer!r}: expected start, final, best, mean, "
                         "firstP% or lastP%")
    if reducer in ("start", "final"):
        return values[0] if reducer == "start" else values[-1]
    if reducer in ("best", "mean"):
        return float(np.max(values) if reducer == "best" else np.mean(values))
    n = max(1, math.ceil(float(m.group(3)) / 100 * len(values)))
    return float(np.mean(values[:n] if m.group(2) == "first" else values[-n:]))


def parse_stat(spec: str) -> tuple[str, str, str]:
    """`KEY:REDUCER[=LABEL]` -> (key, reducer, label; default the spec in backticks);
    ValueError naming the spec when malformed."""
    stat, _, label = spec.partition("=")
    key, sep, reducer = stat.rpartition(":")
    if not sep or not key:
        raise ValueError(f"--stat {spec!r}: expected KEY:REDUCER[=LABEL], e.g. "
                         "eval/accuracy:final")
    try:
        reduce_values([0.0], reducer)
    except ValueError as e:
        raise ValueError(f"--stat {spec!r}: {e}") from None
    return key, reducer, label or f"`{stat}`"


def cell(run: dict, key: str, reducer: str) -> tuple[float, float | None, int] | None:
    """(mean, std or None with one seed, seeds that have `key`) over `run`'s seeds; None when
    no seed has it."""
    per_seed = [reduce_values([s[key][t] for t in sorted(s[key])], reducer)
                for s in run["seeds"] if s.get(key)]
    if not per_seed:
        return None
    std = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else None
    return float(np.mean(per_seed)), std, len(per_seed)


def fmt_cell(c, digits: int = 3) -> str:
    if c is None:
        return "-"
    mean, std, _ = c
    return f"{mean:.{digits}g}" + ("" if std is None else f" ± {std:.2g}")


def cpu_name(default: str) -> str:
    """The CPU's model name from /proc/cpuinfo, else `default` (also the benchmarks' label)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        default)
    except OSError:
        return default


def machine_line(date: str | None = None) -> str:
    """CPU model, UTC date, torch and megatron-core versions, as one Markdown line."""
    cpu = cpu_name(platform.processor() or platform.machine())
    versions = []
    for pkg in ("torch", "megatron-core"):
        try:
            versions.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            versions.append(f"{pkg} not installed")
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"Measured on {cpu}, {date}, {', '.join(versions)}."


def format_table(runs: list[dict], stats=(), header: str | None = None) -> str:
    """The Markdown table (header line first) of `stats` (`KEY:REDUCER` strings) per arm."""
    parsed = [parse_stat(s) for s in stats]
    if not any(p[:2] == ("eval/accuracy", "start") for p in parsed):
        parsed.insert(0, parse_stat(START))
    seeds = sorted({len(r["seeds"]) for r in runs})
    spread = "One run per column (no seed spread)" if seeds == [1] else \
        f"Mean ± sample standard deviation over seeds (seeds per arm: {', '.join(map(str, seeds))})"
    lines = [header if header is not None else machine_line(),
             f"{spread}; `KEY:REDUCER` as in `tools/result_table.py`.", "",
             "| | " + " | ".join(r["label"] for r in runs) + " |",
             "| --- |" + " --- |" * len(runs)]
    for key, reducer, label in parsed:
        lines.append(f"| {label} | " + " | ".join(fmt_cell(cell(r, key, reducer))
                                                  for r in runs) + " |")
    return "\n".join(lines)


def replace_between_markers(text: str, table: str, marker: str = "") -> str:
    """`text` with the lines between the begin / end markers replaced by `table`; ValueError
    naming the marker when either is missing or they are out of order."""
    name = f"table:{marker}:" if marker else "table:"
    begin, end = f"<!-- {name}begin -->", f"<!-- {name}end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"no {begin} ... {end} pair (in that order) to replace")
    return text[:i + len(begin)] + "\n" + table + "\n" + text[j:]


def write_into(path: str, table: str, marker: str = "") -> None:
    """Replace the marked table in file `path` (ValueError naming the file when unmarked)."""
    with open(path) as f:
        text = f.read()
    try:
        text = replace_between_markers(text, table, marker)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote the table into {path}")


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def add_readme_args(parser, marker: str) -> None:
    """`--readme PATH` and `--marker NAME` (default `marker`): a tool that also writes its
    report between PATH's `<!-- table:NAME:begin/end -->` markers."""
    parser.add_argument("--readme", default=None, metavar="PATH",
                        help="also write the report between PATH's <!-- table:MARKER:begin/end "
                             "--> markers (tools/result_table.py)")
    parser.add_argument("--marker", default=marker, help="with --readme: the markers' name")


@contextlib.contextmanager
def output_into(readme: str | None, marker: str):
    """Print as usual; with `readme`, also write everything printed inside the block, headed by
    `machine_line()`, as a code block between the file's `table:MARKER` markers (a tool's whole
    report, so a README quotes it without hand copying)."""
    if readme is None:
        yield
        return
    buffer = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, buffer)):
        yield
    write_into(readme, f"{machine_line()}\n\n```\n{buffer.getvalue().strip()}\n```", marker)
