"""Hugging Face safetensors -> this rank's megatron shard, and full megatron params -> safetensors.

Loading (`load_hf_weights`) walks `moe.model.sharding.shard_plan`, the same "which part of which full
tensor does this rank hold" that `load_full_params` uses, and reads only that part:
- experts: the whole tensors of this EP rank's experts only (expert TP is 1), each fused by
  mbridge into its row of the layer's stacked weight (`moe.model.experts`);
- fused TP-split params (QKV, a shared expert's [gate; up]): rank r's r-th row chunk of every
  Hugging Face part (its query groups' q/k/v rows, its gate rows and up rows), fused by mbridge;
- other TP-split params: rank r's chunk along the partition dim (columns of o_proj and of the
  shared expert's down_proj; rows of the embedding and lm_head);
- everything else (norms, router, the shared expert gate) whole.
Vocabulary rows past the checkpoint's `vocab_size` (megatron's padding) are zeros; the policy
masks their logits. A checkpoint tensor the model has no place for, or one larger or (outside the
vocabulary rows) smaller than the model's whole tensor along the dim read, is an error, so a
config.json that disagrees with its weights cannot load silently.

Exporting (`export_hf`) takes the full parameter dict (`gather_full_params`, or a checkpoint's
`full_params`), which does not depend on the layout it was gathered from, and writes the Hugging
Face tensors with the vocabulary padding cut off.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from moe.hf.config import read_hf_config
from moe.hf.io import SafetensorsReader, write_safetensors
from moe.hf.mapping import HFMapping, is_expert_stack, local_to_te
from moe.model.sharding import Shard, shard_plan

_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _read_part(reader: SafetensorsReader, hf_name: str, shard: Shard, param: torch.Tensor,
               fused: bool, vocab: bool) -> torch.Tensor:
    """This rank's part of one Hugging Face tensor (see module docstring)."""
    shape = reader.shape(hf_name)
    if fused:  # each part of a fused tensor is split like the whole: row chunk r
        if shard.dim is None:
            return reader.read(hf_name)
        if shard.dim != 0 or shape[0] % shard.parts:
            raise ValueError(f"{hf_name}: {shape[0]} rows cannot be split {shard.parts} ways")
        rows = shape[0] // shard.parts
        return reader.read(hf_name, 0, shard.rank * rows, (shard.rank + 1) * rows)
    dim = 0 if shard.dim is None else shard.dim
    size = param.shape[dim]
    full = size * (shard.parts if shard.dim is not None else 1)  # the model's whole extent
    if shape[dim] > full or (shape[dim] < full and not (vocab and dim == 0)):
        raise ValueError(f"{hf_name}: checkpoint shape {shape} is too "
                         f"{'large' if shape[dim] > full else 'small'} for the model (needs "
                         f"{full} along dim {dim})")
    start = shard.rank * size if shard.dim is not None else 0
    stop = min(start + size, shape[dim])
    if shard.dim is None and stop - start == shape[dim]:
        tensor = reader.read(hf_name)
    elif stop > start:
        tensor = reader.read(hf_name, dim, start, stop)
    else:  # a rank whose vocabulary rows are all padding
        tensor = torch.zeros(*[0 if d == dim else s for d, s in enumerate(shape)])
    pad = size - tensor.shape[dim]
    if pad:
        tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 1 - dim) + (0, pad))
    return tensor


def _check_coverage(model, mapping: HFMapping, reader: SafetensorsReader, ep: int) -> None:
    """Every checkpoint tensor has a place in the model (on some EP rank)."""
    wanted, params = set(), dict(model.named_parameters())
    te = local_to_te(params)
    for name, param in params.items():
        experts = range(param.shape[0] * ep) if is_expert_stack(name) else ()
        wanted.update(mapping.hf_names(te[name], experts))
    if getattr(model, "share_embeddings_and_output_weights", False):
        wanted.add("lm_head.weight")  # tied: a saved lm_head is the embedding again
    extra = sorted(reader.names() - wanted)
    if extra:
        raise ValueError(f"{reader.folder}: {len(extra)} checkpoint tensors have no place in the "
                         f"model built from its config.json, e.g. {extra[:4]}")


@torch.no_grad()
def load_hf_weights(model, path: str, reader: SafetensorsReader | None = None
                    ) -> SafetensorsReader:
    """Load local Hugging Face folder `path` into this rank's shard of `model` (any TP/EP).

    Needs megatron's parallel state (`moe.platform.parallel.init_parallel`). Returns the reader, whose
    `reads` list what this rank read.
    """
    inner = getattr(model, "module", model)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    params = dict(inner.named_parameters())
    mapping = HFMapping(read_hf_config(path), next(iter(params.values())).dtype)
    reader = reader or SafetensorsReader(path)
    _check_coverage(inner, mapping, reader, ep)
    plan = shard_plan(inner, tp_rank, tp, ep_rank, ep)
    te = local_to_te(plan)
    for name, shard in plan.items():
        if not shard.experts:
            _load_param(reader, mapping, name, te[name], shard, params[name])
            continue
        whole, E = Shard(None, 0, 1), params[name].shape[0]  # each expert read whole
        for j in range(E):
            _load_param(reader, mapping, f"{name}[{j}]", f"{te[name]}{ep_rank * E + j}", whole,
                        params[name][j])
    return reader


def _load_param(reader: SafetensorsReader, mapping: HFMapping, name: str, te_name: str,
                shard: Shard, param: torch.Tensor) -> None:
    """Read and fuse megatron tensor `te_name`'s Hugging Face parts into `param` (this rank's
    part of it, `shard`); `name` names it in errors."""
    hf_names = mapping.hf_names(te_name)
    parts = [_read_part(reader, n, shard, param, len(hf_names) > 1, name in _VOCAB)
             for n in hf_names]
    try:
        value = mapping.to_mcore(te_name, parts)
    except RuntimeError as e:  # a view / cat of parts whose shapes do not fit together
        raise ValueError(f"{name} <- {hf_names} with shapes {[tuple(p.shape) for p in parts]}"
                         f": {str(e).splitlines()[0]} (config.json and weights disagree?)"
                         ) from None
    if value.shape != param.shape:
        raise ValueError(f"{name} <- {hf_names}: got shape {tuple(value.shape)}, the model "
                         f"holds {tuple(param.shape)} (config.json and weights disagree?)")
    param.copy_(value)


def hf_tensors(full: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of a full megatron parameter dict (vocab cut to the config's)."""
    dtype = next(iter(full.values())).dtype
    mapping = HFMapping(hf_config, dtype)
    te = local_to_te(full)
    out = {}
    for name, tensor in full.items():
        for hf_name, part in mapping.to_hf(te[name], tensor):
            if name in _VOCAB:
                part = part[:hf_config["vocab_size"]]
            out[hf_name] = part.contiguous().clone()
    return out


def export_hf(full: dict[str, torch.Tensor], out_dir: str, hf_config: dict,
              max_shard_bytes: int = 5 * 1024**3) -> list[str]:
    """Write config.json and sharded safetensors of `full` to `out_dir`; file names back."""
    tensors = hf_tensors(full, hf_config)
    config = dict(hf_config, dtype=_DTYPE_NAMES.get(next(iter(full.values())).dtype, "float32"))
    files = write_safetensors(tensors, out_dir, max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return files + ["config.json"]
