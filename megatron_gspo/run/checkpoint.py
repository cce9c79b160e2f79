"""Sharded-by-rank checkpoints with atomic writes.

Layout under a checkpoint root (run_dir/checkpoints):

    root/step_000010/rank_00000.pt   one torch.save'd dict per rank
    root/step_000010/rank_00001.pt
    root/latest                      text "10": the newest *complete* step

Nothing already written is ever lost or half-written: every file is written to a temporary
file in the same directory, fsync'ed, then `os.replace`d into place (atomic on POSIX), and
`latest` moves only after every rank has saved (`mark_latest`, called by one rank after a
barrier). A crash mid-save leaves at most a `.tmp` file and a step dir that `latest` does not
point to, so resume and `load_checkpoint` still see the previous complete step.

Verified: each shard's sha256 and size are written beside it (`rank_XXXXX.pt.sha256`) and
checked before it is loaded, so a truncated or overwritten file is a `CheckpointError` naming the
file instead of silently wrong tensors; so is a shard whose checksum is missing (a step with
incomplete checksums is incomplete: resume falls back past it, export refuses it). `mark_latest` also marks the step dir `complete`;
`resume_candidates` lists the complete steps newest first, for a resume that falls back past a
corrupt latest step, or past a `latest` that is missing, empty or names a step dir that is gone.
A write that fails (disk full) raises `CheckpointError` with the OSError and leaves the previous
checkpoint as it was. Files get the user's umask (mkstemp would give 0600).

Files are our own, so they are loaded with `torch.load(weights_only=False)` (they hold Python
objects: RNG states, config dicts, counters).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil

import numpy as np
import torch

from megatron_gspo.errors import CheckpointError
from megatron_gspo.files import fsync_path, write_atomically

LATEST_FILE = "latest"
COMPLETE_FILE = "complete"
CHECKSUM_SUFFIX = ".sha256"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def rank_file(step_dir_path: str, rank: int) -> str:
    return os.path.join(step_dir_path, f"rank_{rank:05d}.pt")


def _check_index(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}={value!r}: expected an int >= 0")
    return int(value)


class _HashingWriter:
    """File wrapper that hashes what is written and keeps the first OSError it raised (torch's
    zip writer may report a failed write as its own RuntimeError)."""

    def __init__(self, f):
        self.f, self.sha, self.size, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha.update(memoryview(data)[:n] if n is not None else data)
        self.size += len(data) if n is None else n
        return len(data) if n is None else n

    def flush(self) -> None:
        self.f.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def atomic_write(path: str, write) -> tuple[str, int]:
    """`write(file)` into a tmp file next to `path`, fsync, then os.replace
    (`megatron_gspo.files.write_atomically`); returns the sha256 and size of what was written.
    A failed write raises CheckpointError naming `path` and leaves no tmp file."""
    out = None

    def hashed(f) -> None:
        nonlocal out
        out = _HashingWriter(f)
        write(out)

    try:
        write_atomically(path, hashed)
    except BaseException as e:
        cause = out.error if out is not None and out.error is not None else e
        if isinstance(cause, OSError):
            raise CheckpointError(f"cannot write {path}: {cause.strerror or cause}; files "
                                  "already written are unchanged") from cause
        raise
    return out.sha.hexdigest(), out.size


def _write_checksum(path: str, sha: str, size: int) -> None:
    text = json.dumps({"sha256": sha, "size": size})
    atomic_write(path + CHECKSUM_SUFFIX, lambda f: f.write(text.encode()))


def write_checksum(path: str) -> None:
    """Write the sha256 / size sidecar of a file someone else wrote (e.g. a dist_checkpointing
    shard), so `verify_file` checks it like a rank file."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    _write_checksum(path, sha.hexdigest(), os.path.getsize(path))


def verify_file(path: str) -> None:
    """CheckpointError unless `path` matches the sha256 and size written beside it. A file
    without its checksum is not trusted either: its step is incomplete (every shard this
    version writes has one)."""
    sidecar = path + CHECKSUM_SUFFIX
    if not os.path.isfile(sidecar):
        raise CheckpointError(f"checkpoint file {path} has no checksum beside it ({sidecar} is "
                              "missing): its step is incomplete")
    try:
        with open(sidecar) as f:
            want = json.load(f)
        want["size"], want["sha256"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checksum file {sidecar} is corrupt") from None
    size = os.path.getsize(path)
    if size != want["size"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or overwritten: {size} "
                              f"bytes, {want['size']} were written")
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    if sha.hexdigest() != want["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its sha256 differs from the "
                              "one written with it")


def verify_dir(directory: str, rank: int = 0, world_size: int = 1) -> None:
    """`verify_file` for this rank's share (every `world_size`-th) of the files in `directory`,
    whatever layout wrote them: a resume with fewer ranks checks the shards of the ranks it no
    longer has too. A file whose checksum is there but which is gone, and a file without its
    checksum, are a CheckpointError (`.tmp` files, a killed write's, are not shards)."""
    listed = os.listdir(directory) if os.path.isdir(directory) else []
    names = sorted({n[:-len(CHECKSUM_SUFFIX)] if n.endswith(CHECKSUM_SUFFIX) else n
                    for n in listed if not n.endswith(".tmp")
                    and os.path.isfile(os.path.join(directory, n))})
    for name in names[rank::world_size]:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing (its checksum is there)")
        verify_file(path)


def save_checkpoint(root: str, step: int, state: dict, rank: int = 0) -> str:
    """Atomically write this rank's `state` to root/step_XXXXXX/rank_XXXXX.pt; returns the
    step dir. Does not move `latest` (see `mark_latest`)."""
    step, rank = _check_index("step", step), _check_index("rank", rank)
    if not isinstance(state, dict):
        raise ValueError(f"state: expected a dict, got {type(state).__name__}")
    d = step_dir(root, step)
    os.makedirs(d, exist_ok=True)
    path = rank_file(d, rank)
    sha, size = atomic_write(path, lambda f: torch.save(state, f))
    _write_checksum(path, sha, size)
    return d


def mark_latest(root: str, step: int) -> None:
    """Atomically point root/latest at `step`; call once every rank has saved it."""
    step = _check_index("step", step)
    d = step_dir(root, step)
    if not os.path.isfile(rank_file(d, 0)):
        raise FileNotFoundError(f"cannot mark step {step} latest: {rank_file(d, 0)} does not "
                                f"exist; {root} holds {_listing(root)}")
    atomic_write(os.path.join(d, COMPLETE_FILE), lambda f: f.write(b"1\n"))
    atomic_write(os.path.join(root, LATEST_FILE), lambda f: f.write(f"{step}\n".encode()))


def _read_latest(root: str) -> int | None:
    """The number in root/latest; None when the file is missing or empty (a hand edit, a copy
    cut short). ValueError for any other text: which step to resume is then the user's."""
    path = os.path.join(root, LATEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{path}: expected a step number, got {text!r}")
    return int(text)


def latest_step(root: str) -> int | None:
    """The step root/latest points to; None when there is no `latest` (no complete save)."""
    step = _read_latest(root)
    if step is not None and not os.path.isdir(step_dir(root, step)):
        path = os.path.join(root, LATEST_FILE)
        raise FileNotFoundError(f"{path} points to step {step}, but {step_dir(root, step)} "
                                f"does not exist; {root} holds {_listing(root)}")
    return step


def complete_steps(root: str) -> list[int]:
    """The step dirs under root marked complete (every rank saved them), newest first."""
    if not os.path.isdir(root):
        return []
    steps = [int(m.group(1)) for n in os.listdir(root) if (m := _STEP_RE.match(n))]
    return sorted((s for s in steps if os.path.isfile(os.path.join(step_dir(root, s),
                                                                   COMPLETE_FILE))),
                  reverse=True)


def latest_problem(root: str) -> str:
    """Why root/latest cannot name the step to resume while complete steps exist (it is
    missing, empty, or names a step dir that is gone), or "" when it can (or nothing is there).
    ValueError for a `latest` holding something other than a step number."""
    step = _read_latest(root)
    if step is not None and os.path.isdir(step_dir(root, step)) or not complete_steps(root):
        return ""
    path = os.path.join(root, LATEST_FILE)
    if step is not None:
        return f"{path} points to step {step}, whose dir {step_dir(root, step)} is gone"
    return f"{path} is {'empty' if os.path.isfile(path) else 'missing'}"


def _listing(path: str) -> str:
    if not os.path.isdir(path):
        return "nothing (no such directory)"
    names = sorted(n for n in os.listdir(path) if not n.endswith(".tmp"))
    return "[" + ", ".join(names) + "]" if names else "nothing (empty directory)"


def step_of(path: str) -> int | None:
    """The step of a step dir `.../step_XXXXXX` (None for another path)."""
    m = _STEP_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def _is_step_dir(path: str) -> bool:
    return bool(_STEP_RE.match(os.path.basename(os.path.normpath(path))))


def load_checkpoint(root_or_step_dir: str, rank: int = 0, step: int | None = None,
                    map_location="cpu") -> dict:
    """This rank's state from a step dir, or from a root (its `latest`, or `step` if given)."""
    rank = _check_index("rank", rank)
    path = root_or_step_dir
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path} does not exist; its parent holds "
                                f"{_listing(os.path.dirname(os.path.abspath(path)))}")
    if _is_step_dir(path):
        if step is not None:
            raise ValueError(f"step={step} given with a step dir {path}; pass the root instead")
        d = path
    else:
        if step is None:
            step = latest_step(path)
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {path} (no '{LATEST_FILE}' "
                                    f"marker); it holds {_listing(path)}")
        d = step_dir(path, _check_index("step", step))
    f = rank_file(d, rank)
    if not os.path.isfile(f):
        where = d if os.path.isdir(d) else os.path.dirname(d)
        raise FileNotFoundError(f"checkpoint file {f} does not exist; {where} holds "
                                f"{_listing(where)}")
    verify_file(f)
    try:
        return torch.load(f, map_location=map_location, weights_only=False)
    except Exception as e:  # unreadable zip / pickle: name the file in one line
        raise CheckpointError(f"checkpoint file {f} cannot be read: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def resume_candidates(root: str) -> list[int]:
    """Steps to resume from, newest first: `latest`, then older steps marked complete. When
    `latest` is missing, empty or names a step dir that is gone (`latest_problem`): every
    complete step, so a run never restarts from step 0 over complete steps."""
    latest = _read_latest(root)
    complete = complete_steps(root)
    if latest is None or not os.path.isdir(step_dir(root, latest)):
        return complete
    return [latest] + [s for s in complete if s < latest]


def newest_step(root: str) -> int | None:
    """The first of `resume_candidates` (None when root holds no complete step)."""
    candidates = resume_candidates(root)
    return candidates[0] if candidates else None


def prune_steps(root: str, keep: int) -> list[int]:
    """Delete the step dirs older than the newest `keep` resume candidates (`latest` and the
    complete steps before it; half-written ones among them go too); returns the deleted steps.
    keep <= 0 keeps everything."""
    kept = resume_candidates(root)[:keep] if keep > 0 else []
    if not kept:
        return []
    steps = sorted(int(m.group(1)) for n in os.listdir(root) if (m := _STEP_RE.match(n)))
    gone = [s for s in steps if s < kept[-1]]
    for s in gone:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return gone


def rng_state() -> dict:
    """Python `random`, numpy global, torch CPU and (when available) every CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(d: dict) -> None:
    """Restore what `rng_state` returned. CUDA states are restored for the devices both the
    saving and this process have (a different GPU count is not an error)."""
    missing = [k for k in ("python", "numpy", "torch") if k not in d]
    if missing:
        raise ValueError(f"rng state lacks {missing}; keys present: {sorted(d)}")
    random.setstate(d["python"])
    np.random.set_state(d["numpy"])
    torch.set_rng_state(d["torch"].cpu())
    if "cuda" in d and torch.cuda.is_available():
        for i, s in enumerate(d["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)
