"""Tokenizers behind one protocol: the toy character vocabulary and any local Hugging Face one.

    tok = load_tokenizer(None)                       # CharTokenizer (toy tasks)
    tok = load_tokenizer("/models/Qwen3-30B-A3B")    # tokenizer.json + tokenizer_config.json

What the library reads (`Tokenizer`): `encode`, `decode`, `vocab_size` (the real size; the model's
embedding is padded beyond it and the padded logits are masked), `pad_id`, `eos_id`, `bos_id`
(prepended to every prompt when not None; Qwen has none), `stop_ids` (sampling stops a row on any
of them: EOS and the chat template's end-of-turn token), `special_texts` (the special tokens'
texts, longest first, which `encode` reads as those tokens: `data.special_tokens_in_text`) and
`apply_chat_template(messages)`,
which returns the prompt text with the generation prompt appended, or None when the tokenizer
has no template (base models, the toy vocabulary).

Nothing is downloaded: `load_tokenizer` takes a local folder only, and a hub name is an error
saying so.
"""

from __future__ import annotations

import json
import os
from typing import Protocol, Sequence

from jinja2 import TemplateError  # installed with torch (and transformers)

from megatron_gspo.errors import ConfigError
from moe.platform.checks import MissingDependency
from moe.hf.config import check_local_folder  # noqa: F401 (one hub-name error for both)

_SPECIALS = ("<pad>", "<bos>", "<eos>")
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_CHARS = "0123456789+-*=,:>() acs"


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None
    stop_ids: frozenset
    special_texts: tuple

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str | None: ...


class CharTokenizer:
    """Fixed character vocabulary: <pad>=0, <bos>=1, <eos>=2, then `_CHARS` (26 ids in all)."""

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.stop_ids = frozenset({self.eos_id})
        self.special_texts = ()  # '<eos>' in text is characters ('<' is not in the vocabulary)
        self.chars = _CHARS
        self.vocab_size = len(_SPECIALS) + len(_CHARS)
        self._id_of = {ch: i + len(_SPECIALS) for i, ch in enumerate(_CHARS)}

    def encode(self, text: str) -> list[int]:
        ids = []
        for pos, ch in enumerate(text):
            if ch not in self._id_of:
                raise ValueError(f"unknown character {ch!r} at position {pos} in {text!r}; "
                                 f"the vocabulary is {_CHARS!r}")
            ids.append(self._id_of[ch])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Characters up to the first <eos>; <pad> and <bos> are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
            out.append(_CHARS[i - len(_SPECIALS)])
        return "".join(out)

    def apply_chat_template(self, messages: list[dict]) -> str | None:
        return None


class HFTokenizer:
    """A local Hugging Face tokenizer folder (transformers' fast tokenizer, no network).

    EOS is the config's `eos_token`; the stop set adds the chat template's end-of-turn token
    (`<|im_end|>` for Qwen) and `generation_config.json`'s eos ids when present. The pad id is
    `pad_token` (else EOS). Decoding stops at the first stop id and skips special tokens.
    """

    def __init__(self, path: str) -> None:
        try:  # optional dependency ([hf] extra) and a heavy import: only tokenizer folders need it
            from transformers import AutoTokenizer
        except ImportError:
            raise MissingDependency(f"tokenizer folder {path} needs transformers: pip install -e "
                                    "'.[hf]'") from None

        check_local_folder(path, "tokenizer")
        if not any(os.path.isfile(os.path.join(path, f)) for f in _VOCAB_FILES):
            # transformers would build an empty tokenizer of the config's class (1 token)
            raise FileNotFoundError(f"{path}: no tokenizer files ({', '.join(_VOCAB_FILES)}); "
                                    "copy the model's tokenizer there or set "
                                    "data.tokenizer_path")
        self.path = path
        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (ValueError, OSError) as e:  # e.g. a truncated download: JSONDecodeError
            raise ConfigError(f"{path}: cannot load the tokenizer from its tokenizer.json / "
                              f"tokenizer_config.json ({' '.join(str(e).split())[:200]})") \
                from None
        if self.hf.eos_token_id is None:
            raise ValueError(f"{path}: tokenizer has no eos_token (set it in "
                             "tokenizer_config.json)")
        self.eos_id = int(self.hf.eos_token_id)
        self.pad_id = int(self.hf.pad_token_id if self.hf.pad_token_id is not None
                          else self.eos_id)
        self.bos_id = None if self.hf.bos_token_id is None else int(self.hf.bos_token_id)
        self.vocab_size = len(self.hf)
        stops = {self.eos_id} | set(_generation_eos_ids(path))
        end_of_turn = self.hf.convert_tokens_to_ids("<|im_end|>") \
            if "<|im_end|>" in self.hf.get_vocab() else None
        if end_of_turn is not None and self.hf.chat_template:
            stops.add(int(end_of_turn))
        self.stop_ids = frozenset(stops)
        special = {t.content for t in self.hf.added_tokens_decoder.values() if t.special}
        self.special_texts = tuple(sorted(special | set(self.hf.all_special_tokens),
                                          key=lambda t: (-len(t), t)))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        for n, i in enumerate(ids):
            if i in self.stop_ids:
                ids = ids[:n]
                break
        return self.hf.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str | None:
        """ValueError when the template rejects the messages (its raise_exception, e.g. 'System
        role not supported' or roles that do not alternate)."""
        if not self.hf.chat_template:
            return None
        try:
            return self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        except TemplateError as e:
            raise ValueError(f"the chat template of {self.path} refused the messages: "
                             f"{e}") from None


def _generation_eos_ids(path: str) -> list[int]:
    gen = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen):
        return []
    with open(gen) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_tokenizer(path: str | None) -> Tokenizer:
    """CharTokenizer for None, else the Hugging Face tokenizer in local folder `path`."""
    return CharTokenizer() if path is None else HFTokenizer(path)
