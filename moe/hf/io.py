"""Safetensors folders: read tensors or slices of them (recorded), write sharded with an index.

`SafetensorsReader` opens every file lazily with `safe_open` and reads through `get_slice`, so a
row or column range costs only its bytes (the file is memory-mapped); every read is appended to
`reads` as (name, dim, start, stop, numel) so tests can check that a rank reads only its shard.
A folder may hold one `model.safetensors`, or shards with or without a
`model.safetensors.index.json`.

`write_safetensors` writes Hugging Face's layout: `model.safetensors` when everything fits in one
shard, else `model-0000i-of-0000n.safetensors` plus the index (`metadata.total_size`,
`weight_map`). The shards get the user's umask like every other file (safetensors writes 0600).
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch

INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    """Read tensors, or slices along one dim, from a local safetensors folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.reads: list[tuple[str, int | None, int | None, int | None, int]] = []
        self._handles: dict[str, object] = {}
        index = os.path.join(folder, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = dict(json.load(f)["weight_map"])
        else:
            files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"{folder}: no *.safetensors files (only safetensors "
                                        "checkpoints are read)")
            self.file_of = {}
            for file in files:
                for name in self._open(os.path.basename(file)).keys():
                    self.file_of[name] = os.path.basename(file)

    def _open(self, file: str):
        from safetensors import safe_open  # optional dependency ([hf] extra): HF checkpoints only

        if file not in self._handles:
            path = os.path.join(self.folder, file)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} (listed in {INDEX}) does not exist")
            try:
                self._handles[file] = safe_open(path, framework="pt", device="cpu")
            except Exception as e:  # SafetensorError: a truncated or corrupt file
                raise ValueError(f"{path}: not a readable safetensors file ({e}); re-download "
                                 "or re-save it") from None
        return self._handles[file]

    def names(self) -> set[str]:
        return set(self.file_of)

    def _slice(self, name: str):
        if name not in self.file_of:
            raise KeyError(f"{self.folder}: checkpoint has no tensor {name!r}")
        handle = self._open(self.file_of[name])  # its own one-line errors (missing, corrupt)
        try:
            return handle.get_slice(name)
        except Exception as e:  # SafetensorError: the index names a file without this tensor
            raise ValueError(f"{os.path.join(self.folder, self.file_of[name])}: {e} ({INDEX} "
                             "lists it there)") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> torch.Tensor:
        """The whole tensor (dim None), or indices [start, stop) along `dim` (0 or 1)."""
        sl = self._slice(name)
        if dim is None:
            tensor = sl[:]
        elif dim == 0:
            tensor = sl[start:stop]
        elif dim == 1:
            tensor = sl[:, start:stop]
        else:
            raise ValueError(f"{name}: slicing along dim {dim} is not supported")
        self.reads.append((name, dim, start, stop, tensor.numel()))
        return tensor

    def close(self) -> None:
        self._handles.clear()


def _save_file(save_file, shard: dict, path: str) -> None:
    """safetensors' `save_file`; a write the OS refused (a full disk) as the OSError it is:
    safetensors raises its own SafetensorError ('... I/O error: No space left on device (os
    error 28)'), which is no OSError."""
    try:
        save_file(shard, path, metadata={"format": "pt"})
    except Exception as e:  # SafetensorError (safetensors' one error type)
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None


def write_safetensors(tensors: dict[str, torch.Tensor], folder: str,
                      max_shard_bytes: int = 5 * 1024**3) -> list[str]:
    """Write `tensors` as Hugging Face safetensors shards (+ index when > 1); file names back."""
    from safetensors.torch import save_file  # optional dependency ([hf] extra): HF export only

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    os.makedirs(folder, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name].contiguous()
        size += nbytes
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    mask = os.umask(0)
    os.umask(mask)
    for file, shard in zip(files, shards):
        _save_file(save_file, shard, os.path.join(folder, file))
        os.chmod(os.path.join(folder, file), 0o666 & ~mask)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(files, shards)
                                for name in shard}}
        with open(os.path.join(folder, INDEX), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return files
