"""Write JSONL files for tests: dataset rows and a run dir's metrics.jsonl."""

from __future__ import annotations

import json
import os


def write_jsonl(path, rows, blank_line_at=None) -> str:
    """One JSON object per line (a str row is written as is); a blank line before row
    `blank_line_at`. Creates the parent folder; returns the path as a str."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for k, row in enumerate(rows):
            if k == blank_line_at:
                f.write("\n")
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def write_metrics(run_dir, rows) -> str:
    """`run_dir/metrics.jsonl` holding `rows`, as a run writes it; returns run_dir as a str."""
    write_jsonl(os.path.join(run_dir, "metrics.jsonl"), rows)
    return str(run_dir)


def step_rows(run_dir) -> list[dict]:
    """`run_dir/metrics.jsonl`'s rows of the trained steps (step > 0): without step 0's row of
    the initial policy's evals (the test split's is there whenever the run has one)."""
    from megatron_gspo.run.metrics import read_jsonl

    return [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["step"] > 0]
