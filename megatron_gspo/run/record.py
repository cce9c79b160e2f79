"""Reading a run's record: `run_dir/run.json` (written by `megatron_gspo.run.rundir.record_run`)
and the plugins its saved config names.

    run.json  {"job": "train", "fingerprint": "...", "config": {...}, "inputs": {...}, ...}

Every reader of the record goes through `read_record`: a record that cannot be read (cut off,
not JSON, `{}`, a folder) is one line naming the file and what to do (a RunDirError, exit 2),
never a traceback, and never taken for a run dir without a record (which a start would found
anew on its own config).
"""

from __future__ import annotations

import json
import os

from megatron_gspo.config.yamlfile import load_yaml
from megatron_gspo.errors import ConfigError, RunDirError

RUN_FILE = "run.json"
_KEYS = ("job", "fingerprint", "config")
"""What every record holds (`record_run` writes them first)."""


def read_record(run_dir: str) -> dict | None:
    """`run_dir`'s record, None when it has none; RunDirError naming the file when it cannot be
    read or lacks what every record holds."""
    path = os.path.join(run_dir, RUN_FILE)
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        missing = [k for k in _KEYS if k not in record] if isinstance(record, dict) else _KEYS
        why = f"it holds no {', '.join(map(repr, missing))}" if missing else ""
    except (OSError, ValueError) as e:  # a folder, a dangling link, cut-off JSON, not UTF-8
        why = getattr(e, "strerror", None) or " ".join(str(e).split())
    if why:
        raise RunDirError(f"run_dir={run_dir}: {path} is not a readable run record ({why}); it "
                          "holds the config and inputs the run started with: restore it, or move "
                          "it away and start with resume=force to record this start's config")
    return record


def recorded_plugins(run_dir: str, job: str) -> list[str]:
    """The `plugins` of the config `run_dir`'s run of `job` saved at its first start
    (`{job}_config.yaml`); [] without a record of that job or a saved config."""
    record = read_record(run_dir)
    path = os.path.join(run_dir, f"{job}_config.yaml") if record and record["job"] == job else ""
    if not os.path.isfile(path):
        return []
    saved = load_yaml(path)
    plugins = (saved.get("plugins") if isinstance(saved, dict) else None) or []
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{path}: plugins={plugins!r}: expected a list of module names or "
                          "paths")
    return plugins
