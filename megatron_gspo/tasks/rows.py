"""Dataset files row by row: `.jsonl` (one JSON object per line, UTF-8) and `.parquet` (needs
pyarrow). Every malformed input is one `DataError` naming the file and the line or row."""

from __future__ import annotations

import json
import os
from typing import Iterator

from megatron_gspo.errors import DataError
from moe.platform.checks import MissingDependency

_SUFFIXES = (".jsonl", ".parquet")


def read_rows(path: str, what: str = "data.train_files") -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of a .jsonl or .parquet file; where = 'path:line' / 'path row i'."""
    if not os.path.isfile(path) and (os.path.isdir(path) or any(c in path for c in ",*?")):
        raise DataError(f"{path} ({what}): one entry is one file, with no directories or "
                        f"globs; list the files, e.g. {what}=[a.jsonl,b.jsonl]")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path} ({what})")
    if path.endswith(".parquet"):
        yield from _parquet_rows(path)
        return
    if not path.endswith(".jsonl"):
        raise DataError(f"{path}: unsupported file type ({what}); expected one of {_SUFFIXES}")
    with open(path, "rb") as f:  # decoded line by line: a bad byte's error names its line
        for lineno, raw in enumerate(f, start=1):
            try:  # a leading BOM (Windows editors) is dropped
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start + 1}); "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                what = e.msg.removesuffix(" at")  # "Unterminated string starting at"
                raise DataError(f"{path}:{lineno}: not valid JSON ({what} at column "
                                f"{e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: a row must be a JSON object, got "
                                f"{type(row).__name__}")
            yield f"{path}:{lineno}", row


def _parquet_rows(path: str) -> Iterator[tuple[str, dict]]:
    try:  # optional dependency (pyarrow): only .parquet files need it
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingDependency(f"reading {path} needs pyarrow: pip install pyarrow (or convert "
                                "the file to .jsonl)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid / ArrowIOError
        raise DataError(f"{path}: not a readable parquet file ({' '.join(str(e).split())})") \
            from None
    for i, row in enumerate(rows):
        yield f"{path} row {i}", row
