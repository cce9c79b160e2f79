"""What a run reads besides its config, fingerprinted: data files, the split, tokenizer, template,
plugin code.

    run.json  {"job": ..., "fingerprint": ..., "config": {...},
               "inputs": {"data file a.jsonl": sha256, "train / eval split": sha256,
                          "tokenizer": sha256, "tokenizer encoding": sha256,
                          "chat template": sha256, "plugin my_loss.py": sha256,
                          "plugins": sha256}}

A config names its data files and tokenizer folder by path; what is in them may change between a
run and its resume (rows shuffled or appended, token ids renumbered, another chat template) and
the resume would go on silently: with `data.test_fraction` the held-out split is redrawn from
training rows, and the embeddings belong to other ids. `input_fingerprints` is recorded at a
run's first start (`rundir.record_run`); `changed_inputs` names what differs on a later start,
which `rundir.check_inputs` refuses (resume=force continues and says so).

What is hashed: each data file's bytes; the split as the ordered train, test and validation examples (prompt,
target, ground truth and source row); a Hugging Face tokenizer's vocabulary (every token's id),
merges, added and special tokens and eos / pad / bos / stop ids; the tokenizer's encoding: what
`PROBE_TEXTS` become (ids, and the text those ids decode to) and the canonical JSON (sorted keys)
of its files' settings besides the vocabulary, merges and template (normalizer, pre-tokenizer,
post-processor, decoder, model options such as byte fallback, tokenizer_config.json's keys), so a
normalizer added to a copied tokenizer.json is a changed input; the chat template; the bytes of
every source file of the config's plugins (`megatron_gspo.run.plugins.plugin_files`: a module's
file, each .py file of a package folder, named relative to where the module is found, so a moved
plugin keeps its name) and, as "plugins", the list of those names. The character tokenizer is
code, not a file: it is not recorded. A record written before the encoding was fingerprinted (no
"tokenizer encoding" beside its "tokenizer"), or before plugin code was (no "plugins"), resumes
without it.
"""

from __future__ import annotations

import hashlib
import json
import os

from megatron_gspo.run.plugins import plugin_files


ENCODING = "tokenizer encoding"
PLUGINS = "plugins"
"""The key of the plugin files' names (each file's own key: "plugin NAME")."""


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def split_sha256(train_set, test_set, val_set=()) -> str:
    """The train / test (and validation) examples in order (what the split and the shuffle made
    of the rows). The test split hashes as "eval", its name before the validation split
    existed, and an empty validation split not at all: a run recorded then fingerprints alike."""
    sha = hashlib.sha256()
    splits = (("train", train_set), ("eval", test_set)) + ((("val", val_set),) if val_set else ())
    for name, examples in splits:
        sha.update(f"{name} {len(examples)}\n".encode())
        for ex in examples:
            sha.update(repr((ex.prompt, ex.answer, ex.meta)).encode("utf-8") + b"\n")
    return sha.hexdigest()


def _merges(hf) -> list:
    """A fast BPE tokenizer's merges as [left, right] pairs (tokenizers writes them as "a b"
    strings or as pairs, depending on its version), else []."""
    if not getattr(hf, "is_fast", False):
        return []
    model = json.loads(hf.backend_tokenizer.to_str()).get("model") or {}
    return [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges", [])]


def tokenizer_sha256(tokenizer) -> tuple[str, str] | None:
    """(tokenizer, chat template) fingerprints of a Hugging Face tokenizer; None for the
    character tokenizer. The tokenizer's is its contents, not its file's serialisation (which
    differs between `tokenizers` versions): every token's id, the merges, the added tokens and
    whether they are special, and the eos / pad / bos / stop ids."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return None
    vocab = sorted(hf.get_vocab().items(), key=lambda item: (item[1], item[0]))
    added = sorted((i, t.content, bool(t.special)) for i, t in hf.added_tokens_decoder.items())
    ids = [tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id, sorted(tokenizer.stop_ids)]
    body = json.dumps([vocab, _merges(hf), added, ids])
    return _sha(body), _sha(hf.chat_template or "")


PROBE_TEXTS = (
    "Maya has 10 apples.",
    "  Hello\tWORLD,\n\nhow ARE you?  ",
    "École naïve café; e\u0301 vs \u00e9; Straße; İstanbul",
    "ﬁ ① Ｆｕｌｌ ½ ² ™ Å",
    "日本語のテキスト, 中文, 한국어, русский, العربية",
    "emoji 🙂👍🏽 and symbols ∑∫√ ≤ → \u200b\u00a0|",
    "1234567890 3.14159 -42 +7 1,000,000 2024-01-31",
    "x = f(y) * 2; if (a && b) { return c[0]; } // done",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> </s> [INST]",
)
"""Texts whose ids (and those ids' decoding) stand for what the tokenizer makes of text: case,
whitespace, Unicode normalization forms, scripts and bytes outside an English vocabulary, digits,
code, special tokens' texts."""
_SETTINGS_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")
_HASHED_ELSEWHERE = {"tokenizer.json": ("added_tokens",),
                     "tokenizer_config.json": ("chat_template", "added_tokens_decoder")}
"""Keys fingerprinted as contents by `tokenizer_sha256` (another serialisation of the same
tokens must not count) or as the chat template: left out of the settings' JSON."""


def _settings(folder: str) -> dict:
    """{file: its JSON without the vocabulary, merges, added tokens and chat template} of a
    tokenizer folder's settings files, and the sha256 of a sentencepiece model."""
    out = {}
    for name in _SETTINGS_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict):
                data = {k: v for k, v in data.items() if k not in _HASHED_ELSEWHERE.get(name, ())}
                if isinstance(data.get("model"), dict):
                    data["model"] = {k: v for k, v in data["model"].items()
                                     if k not in ("vocab", "merges")}
            out[name] = data
    if os.path.isfile(os.path.join(folder, "tokenizer.model")):
        out["tokenizer.model"] = file_sha256(os.path.join(folder, "tokenizer.model"))
    return out


def encoding_sha256(tokenizer) -> str:
    """The fingerprint of what text becomes which ids (module docstring): `PROBE_TEXTS` as ids
    with and without the special tokens the tokenizer adds, their decoding, and the settings
    files' canonical JSON."""
    hf = tokenizer.hf
    probes = [[hf.encode(text, add_special_tokens=False), hf.encode(text),
               hf.decode(hf.encode(text, add_special_tokens=False))] for text in PROBE_TEXTS]
    folder = getattr(tokenizer, "path", None)
    settings = _settings(folder) if folder and os.path.isdir(folder) else {}
    return _sha(json.dumps([probes, settings], sort_keys=True, ensure_ascii=False))


def input_fingerprints(cfg, tokenizer, train_set, test_set, val_set=()) -> dict[str, str]:
    """{what: sha256} of everything the run reads besides its config (module docstring)."""
    out = {}
    if cfg.task.name == "dataset":
        for path in [*cfg.data.train_files, *cfg.data.test_files, *cfg.data.val_files]:
            out[f"data file {path}"] = file_sha256(path)
    out["train / eval split"] = split_sha256(train_set, test_set, val_set)
    tok = tokenizer_sha256(tokenizer)
    if tok is not None:
        out["tokenizer"], out["chat template"] = tok
        out[ENCODING] = encoding_sha256(tokenizer)
    files = plugin_files(cfg.plugins)
    out.update((f"plugin {name}", file_sha256(path)) for name, path in files.items())
    out[PLUGINS] = _sha(json.dumps(sorted(files)))
    return out


def _from_before(what: str, recorded: dict) -> bool:
    """Whether `what` was not fingerprinted when `recorded` was written: the encoding beside a
    recorded tokenizer, plugin code in a record without PLUGINS."""
    if what == ENCODING:
        return ENCODING not in recorded and "tokenizer" in recorded
    return what.startswith("plugin ") and PLUGINS not in recorded


def changed_inputs(recorded: dict, now: dict) -> list[str]:
    """One phrase per input that differs between a run's record and this start (what a record
    was written before fingerprinting is not compared; PLUGINS only marks that the plugin files
    were, each named by its own key)."""
    out = []
    for what in sorted(set(recorded) | set(now)):
        old, new = recorded.get(what), now.get(what)
        if what == PLUGINS or _from_before(what, recorded):
            continue
        if old is None:
            out.append(f"{what} (not read when the run started)")
        elif new is None:
            out.append(f"{what} (no longer read)")
        elif old != new:
            out.append(f"{what} (sha256 {old[:12]} -> {new[:12]})")
    return out
