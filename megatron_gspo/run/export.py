"""`megatron-gspo export --run-dir R --to-hf OUT`: a run's latest weights as a Hugging Face model.

Reads the run's dist checkpoint into a 1-process model (`moe.model.dist_ckpt.full_params`: whatever
TP/EP layout the run used, so the export does not depend on it) and the run's model config
from rank 0's file, after importing the run's plugins (its config's `plugins`, or `--plugin`
instead: a Hugging Face family a plugin registers exports like a built-in one).
A run started from `model.hf_path` exports that architecture with the source folder's
config.json keys (token ids, ...), its tokenizer files, chat template and generation config; a
toy run exports its preset as a `qwen3_moe` config. The tokenizer written is the one the run
trained with: `data.tokenizer_path`'s files when set (over the source folder's), else the source
folder's; the character tokenizer has no Hugging Face files, so none are written.
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads the result (tests/moe/hf/test_hf.py).
OUT must be new or empty: nothing is overwritten.

Atomic: everything is written into the sibling `OUT.partial` (fsync'ed), which is renamed to OUT
only when complete, so an export killed or failing part-way (disk full at the weights or the
tokenizer: one line, the OSError) leaves no OUT that transformers would load with weights or a
tokenizer missing or cut short. A failure removes
`OUT.partial`; a re-run removes the one a killed export left (it holds `PARTIAL_MARKER`), saying
so. Every file gets the user's umask.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_gspo.files import fsync_path
from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.run.plugins import load_plugins
from megatron_gspo.tasks.tokenizer import load_tokenizer
from moe.model import dist_ckpt
from moe.hf.config import hf_config_dict, preset_from_hf_config, read_hf_config
from moe.hf.weights import export_hf
from moe.model.presets import get_preset

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_SKIP = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
PARTIAL_MARKER = ".megatron-gspo-export-partial"
"""In `OUT.partial` while an export writes it: what a re-run may remove as an export's leftovers."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "vocab.txt", "chat_template.jinja", "chat_template.json")


def _copy_tokenizer_files(src: str, out: str, only: tuple | None = None) -> list[str]:
    """Every top-level file of the source folder except weights and config (tokenizer files,
    chat template, generation config, license, README), or only the names in `only`."""
    copied = []
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and name not in _SKIP and not name.endswith(_WEIGHT_SUFFIXES) \
                and (only is None or name in only):
            shutil.copy2(path, os.path.join(out, name))
            copied.append(name)
    return copied


def _run_tokenizer(run_dir: str, config: dict, hf_path: str | None) -> str | None:
    """The folder of the tokenizer the run trained with (data.tokenizer_path, else hf_path);
    a data.tokenizer_path gone since (or relative to another working directory) falls back to
    hf_path's, with a warning."""
    path = (config.get("data") or {}).get("tokenizer_path")
    if path and not os.path.isdir(path):
        what = f"the tokenizer of {hf_path}" if hf_path else "no tokenizer"
        print(f"megatron-gspo: warning: {run_dir} trained with data.tokenizer_path={path}, "
              f"which does not exist here: exporting {what} (export from the folder the run "
              "started in to include it)", file=sys.stderr)
        return hf_path
    return path or hf_path


def _source(run_dir: str, model_cfg: dict, hf_path: str | None, tok_path: str | None) -> tuple:
    """(config.json dict or None, preset, vocabulary size or None) of the run's model: the
    source folder's (its config.json's vocab_size, or the run's tokenizer's size when tokens
    were added past it: the run trained rows for them), else the toy preset."""
    if hf_path:
        if not os.path.isdir(hf_path) and hf_path == model_cfg.get("hf_path"):
            raise FileNotFoundError(f"{run_dir} started from model.hf_path={hf_path}, which "
                                    "does not exist now: pass --hf-path with its new place")
        base = read_hf_config(hf_path)
        try:
            vocab = max(base["vocab_size"], load_tokenizer(tok_path).vocab_size)
        except (FileNotFoundError, ValueError):  # no usable tokenizer there (the run had its own)
            vocab = base["vocab_size"]
        return base, preset_from_hf_config(base, hf_path), vocab
    preset = get_preset(model_cfg["preset"]).with_overrides(model_cfg.get("preset_overrides")
                                                            or {})
    if model_cfg.get("num_layers"):  # model.num_layers: the preset at that depth
        preset = dataclasses.replace(preset, num_layers=model_cfg["num_layers"])
    return None, preset, None


def export_run(run_dir: str, out: str, hf_path: str | None = None,
               max_shard_bytes: int = 5 * 1024**3, plugins=()) -> dict:
    """Export `run_dir`'s latest checkpoint (or a step dir) to Hugging Face folder `out`.

    `hf_path` overrides the run's model.hf_path (the source folder moved); `plugins` are
    imported instead of the run's own (its config's `plugins`: a Hugging Face family it
    registers is the export's). Returns a summary.
    """
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        # never overwrite: the source folder's weights, or a previous export's shards that
        # transformers would load in place of the new ones (model.safetensors beats an index)
        raise FileExistsError(f"--to-hf {out!r} exists and is not an empty folder; export into "
                              "a new or empty one")
    full, config, preset, model_cfg, hf_path, tok_path = _read_run(run_dir, hf_path, plugins)
    with _staging(out) as tmp:
        files = export_hf(full, tmp, config, max_shard_bytes=max_shard_bytes)
        copied = _copy_tokenizer_files(hf_path, tmp) if hf_path else []
        if tok_path and tok_path != hf_path:  # the run's own tokenizer replaces the source's
            copied = sorted(set(copied) | set(_copy_tokenizer_files(tok_path, tmp,
                                                                    _TOKENIZER_FILES)))
    return {"out": out, "files": files + copied,
            "tokenizer": any(name in _TOKENIZER_FILES for name in copied),
            "model_type": preset.hf_model_type}


def _read_run(run_dir: str, hf_path: str | None, plugins=()) -> tuple:
    """(full parameters, config.json dict, preset, the run's model config, source folder,
    tokenizer folder) of `run_dir`'s latest checkpoint, once `plugins` (else the run's own) are
    imported."""
    root = os.path.join(run_dir, "checkpoints")
    root = root if os.path.isdir(root) else run_dir
    if not os.path.isdir(root):
        raise FileNotFoundError(f"run dir {run_dir!r} does not exist")
    state = ckpt.load_checkpoint(root, rank=0)
    step_dir = root if os.path.isfile(ckpt.rank_file(root, 0)) \
        else ckpt.step_dir(root, ckpt.latest_step(root))
    load_plugins(list(plugins) or state["config"].get("plugins") or [])
    model_cfg = state["config"]["model"]
    hf_path = hf_path or model_cfg.get("hf_path")
    tok_path = _run_tokenizer(run_dir, state["config"], hf_path)
    base, preset, vocab = _source(run_dir, model_cfg, hf_path, tok_path)
    if dist_ckpt.is_dist_checkpoint(os.path.join(step_dir, "dist")):  # any layout
        ckpt.verify_dir(os.path.join(step_dir, "dist"))  # every shard's sha256, as a resume
        try:
            full = dist_ckpt.full_params(os.path.join(step_dir, "dist"), preset)
        except (Exception, CheckpointException) as e:  # shapes of another model (--hf-path)
            if (line := dist_ckpt.mismatch_line(e)) is None:  # out of memory, I/O, ...
                raise
            raise ValueError(f"{run_dir}: its checkpoint is not the model of "
                             f"{hf_path or model_cfg['preset']}: {line}") from None
    else:
        raise ValueError(f"{run_dir}: {step_dir} has no dist/ checkpoint (not written by "
                         "megatron-gspo, or by a version before dist checkpoints)")
    dtype = _DTYPES.get(model_cfg.get("dtype"))  # a 16-bit run's weights are 16-bit values
    if dtype is not None:  # that the 1-process model read back as float32: lossless
        full = {name: tensor.to(getattr(torch, dtype)) for name, tensor in full.items()}
    rows = full["embedding.word_embeddings.weight"].shape[0]
    vocab = vocab or rows
    preset = dataclasses.replace(preset, vocab_size=rows)
    if vocab > rows:
        raise ValueError(f"{hf_path}: config.json / tokenizer vocab_size={vocab} exceeds the "
                         f"checkpoint's {rows} embedding rows (a different model?)")
    return full, hf_config_dict(preset, vocab, base=base), preset, model_cfg, hf_path, tok_path


@contextlib.contextmanager
def _staging(out: str):
    """Yield the empty sibling `out.partial` to write into; rename it to `out` once the block
    ends (files and folder fsync'ed), or remove it if the block fails."""
    tmp = out.rstrip("/") + ".partial"
    if os.path.lexists(tmp):
        if not os.path.isfile(os.path.join(tmp, PARTIAL_MARKER)):
            raise FileExistsError(f"{tmp!r} exists and was not left by an export; move it away "
                                  f"to export into {out!r}")
        print(f"megatron-gspo: removing {tmp}, left by an export that did not finish",
              file=sys.stderr, flush=True)
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        open(os.path.join(tmp, PARTIAL_MARKER), "w").close()
        yield tmp
        for name in os.listdir(tmp):
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
        os.replace(tmp, out)  # onto a missing or empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.remove(os.path.join(out, PARTIAL_MARKER))
    fsync_path(os.path.dirname(os.path.abspath(out)))
