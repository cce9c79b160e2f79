"""Datasets from your own files: prompts + ground truths in JSONL or parquet, as a task.

    task, train_set, val_set, test_set = build_task(cfg, tokenizer, model_max_len=256)

`task.name=dataset` reads `data.train_files` (and `data.test_files`, `data.val_files`) row by
row. Two schemas:

  verl   {"data_source": "openai/gsm8k",
          "prompt": [{"role": "user", "content": "Natalia sold ..."}],
          "reward_model": {"style": "rule", "ground_truth": "72"},
          "extra_info": {"answer": "Natalia sold 48/2 = 24 clips in May. ... #### 72"}}
         (verl's examples/data_preprocess/gsm8k.py writes this; `prompt` may also be a string)
  plain  {"question": "Natalia sold ...", "answer": "Natalia sold 48/2 = 24 ... #### 72"}

Field names are dotted paths (`data.prompt_key`, `data.answer_key`, `data.sft_key`). Each row
becomes an `Example(prompt, answer, meta)`: `prompt` is the text the policy sees (the chat
template applied with its generation prompt, or `data.template` with {prompt} replaced),
`answer` the SFT target (`data.sft_key`, default the answer field) and
`meta = (ground_truth, data_source, "file:line")`, what the reward reads. Rows are shuffled with
`data.seed`, then `data.test_fraction` of them is held out for test unless `data.test_files` are
given, and `data.val_fraction` for validation unless `data.val_files` are (`dataset_splits`).

Files are read row by row by `megatron_gspo.tasks.rows`. Errors name the file, the row (JSONL:
line number; parquet: row index) and the field: a missing
file or field, a wrong type, an empty dataset, a prompt longer than `data.max_prompt_tokens`
(or, with `data.skip_overlong_prompts`, that prompt is skipped and counted), a ground truth the
reward can never score (a float or a list under `exact`: `check_ground_truths`).

The reward is `DatasetTask.reward`: the registry's `reward.name` (default `math`) on the row's
ground truth, `reward.format_weight` for a wrong answer in the right format. Departures from
verl: one reward for every row (verl dispatches on data_source); the prompt text is rendered
once at load time, not per batch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_gspo.errors import ConfigError, DataError
from megatron_gspo.tasks.rewards import (GROUND_TRUTHS, check_math_available, get_format_check,
                                         get_reward)
from megatron_gspo.tasks.rows import read_rows
from megatron_gspo.tasks.toy import Example, make_splits, make_task

_DEFAULT_KEYS = {"verl": ("prompt", "reward_model.ground_truth", "data_source"),
                 "plain": ("question", "answer", None)}


@dataclass(frozen=True)
class DatasetTask:
    """Examples come from files; the reward is `reward_name` from `megatron_gspo.tasks.rewards`."""

    reward_name: str = "math"
    reward_timeout_s: float = 5.0
    """Per-answer time limit used by `rewards.compute_rewards` (0 = none)."""
    reward_batch_timeout_s: float | None = None
    """Time limit of one batch's scoring (`rewards.compute_rewards`; None = none)."""
    format_weight: float = 0.0
    """Reward of a wrong answer that passes the reward's format check."""
    name: ClassVar[str] = "dataset"

    def __post_init__(self) -> None:
        get_reward(self.reward_name)  # KeyError listing the valid names
        if self.reward_name == "math":
            check_math_available()

    def sample(self, rng: random.Random) -> Example:
        raise TypeError("a dataset task's examples come from its files (data.train_files)")

    def reward(self, example: Example, completion: str) -> float:
        correct = get_reward(self.reward_name)(completion, example.meta[0])
        if self.format_weight and correct < 1.0 and self.format_ok(completion):
            return max(correct, self.format_weight)
        return correct

    def format_ok(self, completion: str) -> bool:
        return get_format_check(self.reward_name)(completion)


# ----------------------------------------------------------------------------- reading rows


def get_field(row: dict, key: str, where: str, config_key: str):
    """Value at dotted `key` of a row; DataError naming where, the field and the config key."""
    value: Any = row
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if isinstance(value, dict) and value.get(part, "") is None:  # JSON null
            raise DataError(f"{where}: missing field {key!r} ({config_key}); "
                            f"{'.'.join(parts[:depth + 1])} is null")
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            at = ".".join(parts[:depth]) or "the row"
            raise DataError(f"{where}: missing field {key!r} ({config_key}); {at} has {have}")
        value = value[part]
    return value


# ----------------------------------------------------------------------------- one row


def _messages(value, where: str, key: str) -> list[dict]:
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise DataError(f"{where}: field {key!r} must be a string or a non-empty list of "
                        f"{{role, content}} messages, got {str(value)[:80]!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def render_prompt(messages: list[dict], tokenizer, template: str | None, where: str) -> str:
    """The prompt text: the tokenizer's chat template (generation prompt on) or `template`."""
    if template is not None:
        return template.replace("{prompt}", "\n\n".join(m["content"] for m in messages))
    try:
        text = tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise DataError(f"{where}: {e} (roles {[m['role'] for m in messages]}); fix the rows or "
                        "set data.template") from None
    if text is None:
        raise DataError(f"{where}: data.template is null (use the tokenizer's chat template) but "
                        f"the tokenizer ({type(tokenizer).__name__}) has none; set data.template,"
                        " e.g. data.template='\"Question: {prompt}\\nAnswer:\"'")
    # Templates that write the BOS text themselves (Llama 3): the sampler prepends bos_id already.
    bos_text = getattr(getattr(tokenizer, "hf", None), "bos_token", None)
    if tokenizer.bos_id is not None and bos_text and text.startswith(bos_text):
        text = text[len(bos_text):]
    return text


def freeze(value):
    """A hashable copy of a JSON value (dicts become sorted (key, value) tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def _ground_truth(value, where: str, key: str):
    if isinstance(value, bool) or not isinstance(value, (str, int, float, dict, list)) \
            or (isinstance(value, str) and not value.strip()) \
            or (isinstance(value, float) and not math.isfinite(value)):  # JSON NaN / Infinity
        raise DataError(f"{where}: field {key!r} (the ground truth) must be a non-empty string, "
                        f"a finite number or a JSON object, got {value!r}")
    return value.strip() if isinstance(value, str) else freeze(value)


def _sft_target(row: dict, where: str, key: str):
    value = get_field(row, key, where, "data.sft_key")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {key!r} (data.sft_key, the SFT target) must be a string "
                        f"or a number, got {type(value).__name__} {str(value)[:60]!r}")
    return value


def _answer_key(data) -> str:
    """The field of a row holding its ground truth (`data.answer_key`, else the format's)."""
    return data.answer_key or _DEFAULT_KEYS[data.format][1]


def check_ground_truths(reward_name: str, data, *splits) -> None:
    """DataError naming the row (file:line) and field of an example whose ground truth reward
    `reward_name` can never score (`rewards.GROUND_TRUTHS`: a float or a list under `exact`, a
    list under `math`)."""
    problem = GROUND_TRUTHS.get(reward_name)
    for examples in splits if problem else ():
        for ex in examples:
            if why := problem(ex.meta[0]):
                raise DataError(f"{ex.meta[2]}: field {_answer_key(data)!r} (the ground truth) "
                                f"{why}")


def row_to_example(row: dict, where: str, data, tokenizer) -> Example:
    prompt_key, _, source_key = _DEFAULT_KEYS[data.format]
    prompt_key = data.prompt_key or prompt_key
    answer_key = _answer_key(data)
    messages = _messages(get_field(row, prompt_key, where, "data.prompt_key"), where, prompt_key)
    truth_raw = get_field(row, answer_key, where, "data.answer_key")
    truth = _ground_truth(truth_raw, where, answer_key)
    if data.format == "plain" and isinstance(truth, str) and "####" in truth:
        truth = _ground_truth(truth.rsplit("####", 1)[1], where, answer_key)  # GSM8K style
    target = truth_raw if data.sft_key is None else _sft_target(row, where, data.sft_key)
    source = row.get(source_key, "") if source_key else ""
    messages = _checked_messages(messages, getattr(tokenizer, "special_texts", ()), data,
                                 where, prompt_key)
    specials = getattr(tokenizer, "special_texts", ())
    target = special_text(str(target).strip(), specials, data, where,
                          data.sft_key or answer_key)
    prompt = render_prompt(messages, tokenizer, data.template, where)
    return Example(prompt, target, (truth, str(source), where))


def _checked_messages(messages: list[dict], specials: tuple, data, where: str,
                      key: str) -> list[dict]:
    """`messages` with every field the prompt renders under data.special_tokens_in_text
    (`special_text`): each content, and each role where the chat template renders it (no
    `data.template`)."""
    out = []
    for i, m in enumerate(messages):
        role = m["role"] if data.template is not None else \
            special_text(m["role"], specials, data, where, f"{key}[{i}].role")
        out.append(dict(m, role=role,
                        content=special_text(m["content"], specials, data, where, key)))
    return out


ESCAPE = "\u200b"
"""What `data.special_tokens_in_text=escape` puts after a special token's first character (a
zero-width space): the text then tokenizes as ordinary text."""


def special_text(text: str, specials: tuple, data, where: str, key: str) -> str:
    """`text` of a row (a message's content or role, the SFT target) under
    data.special_tokens_in_text: a special token's text in it (`<|im_end|>`) would be read as
    the token itself (a row could forge a turn; the end-of-turn id also stops sampling).
    forbid: DataError naming the row, the field and the token; escape: each occurrence broken
    by `ESCAPE`; allow: unchanged."""
    found = [t for t in specials if t in text]
    if not found or data.special_tokens_in_text == "allow":
        return text
    if data.special_tokens_in_text == "forbid":
        raise DataError(f"{where}: field {key!r} holds {found[0]!r}, a special token of the "
                        "tokenizer, which would be read as that token (a row could forge a turn "
                        "or end a response); set data.special_tokens_in_text=escape to keep it "
                        "as text (or allow)")
    for t in found:  # longest first (`specials` is sorted so): no token inside another's escape
        text = text.replace(t, t[0] + ESCAPE + t[1:])
    return text


# ----------------------------------------------------------------------------- files -> splits


def _encode(tokenizer, text: str, where: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as e:  # the toy character tokenizer's vocabulary
        raise DataError(f"{where}: the {type(tokenizer).__name__} cannot encode the prompt "
                        f"({str(e)[:120]}...); set data.tokenizer_path (or model.hf_path) to "
                        "a tokenizer folder") from None


def load_examples(paths: list[str], data, tokenizer, max_prompt_tokens: int,
                  what: str) -> tuple[list[Example], int]:
    """Examples of every row of `paths` and the number of overlong prompts skipped."""
    bos = 0 if tokenizer.bos_id is None else 1
    out, skipped = [], 0
    for path in paths:
        for where, row in read_rows(path, what):
            ex = row_to_example(row, where, data, tokenizer)
            n = bos + len(_encode(tokenizer, ex.prompt, where))
            if n > max_prompt_tokens:
                if data.skip_overlong_prompts:
                    skipped += 1
                    continue
                raise DataError(
                    f"{where}: prompt ({data.prompt_key or _DEFAULT_KEYS[data.format][0]}) is "
                    f"{n} tokens, over data.max_prompt_tokens={max_prompt_tokens} (default: the"
                    " model's max_seq_len - rollout.max_new_tokens); raise model.max_seq_len or "
                    "set data.skip_overlong_prompts=true")
            out.append(ex)
    return out, skipped


def _held_out(data, tokenizer, limit: int, rng, train: list, split: str,
              rows: int) -> tuple[list, list, int]:
    """(held-out examples, train rows left, overlong prompts skipped) of split "test" / "val":
    its own files (data.{split}_files, shuffled with `rng`), else the first
    data.{split}_fraction of the `rows` rows read from data.train_files, taken from the front of
    `train` (at least one row; none for a fraction 0)."""
    files, fraction = getattr(data, f"{split}_files"), getattr(data, f"{split}_fraction")
    if not files:
        n = max(1, round(fraction * rows)) if fraction else 0
        if n >= len(train):
            raise DataError(f"{len(train)} rows in {data.train_files} leave no training rows "
                            f"after holding out data.{split}_fraction={fraction}")
        return train[:n], train[n:], 0
    examples, skipped = load_examples(files, data, tokenizer, limit, f"data.{split}_files")
    if data.shuffle:
        rng.shuffle(examples)
    if not examples:
        raise DataError(f"no {split} examples in {files}"
                        + (f" ({skipped} overlong prompts skipped)" if skipped else ""))
    return examples, train, skipped


def dataset_splits(data, tokenizer, max_prompt_tokens: int,
                   ) -> tuple[list[Example], list[Example], list[Example], dict[str, int]]:
    """Train / validation / test examples (deterministic for data.seed) and counts:
    data/{train,val,test}_size, data/skipped_overlong_prompts. The rows of data.train_files are
    shuffled; test comes from data.test_files or their first data.test_fraction, then validation
    from data.val_files or the next data.val_fraction (none when 0), so the test split and its
    shuffle are those of a config without a validation split."""
    if max_prompt_tokens < 1:
        raise DataError(f"no room for a prompt: max_prompt_tokens={max_prompt_tokens} (raise "
                        "model.max_seq_len or lower rollout.max_new_tokens)")
    rng = random.Random(data.seed)
    train, skipped = load_examples(data.train_files, data, tokenizer, max_prompt_tokens,
                                   "data.train_files")
    if not train:
        raise DataError(f"no training examples in {data.train_files}"
                        + (f" ({skipped} overlong prompts skipped)" if skipped else ""))
    if data.shuffle:
        rng.shuffle(train)
    rows = len(train)
    test, train, n_test = _held_out(data, tokenizer, max_prompt_tokens, rng, train, "test", rows)
    val, train, n_val = _held_out(data, tokenizer, max_prompt_tokens, rng, train, "val", rows)
    skipped += n_test + n_val
    test = test[:data.max_test] if data.max_test else test
    return train, val, test, {"data/train_size": len(train), "data/val_size": len(val),
                              "data/test_size": len(test),
                              "data/skipped_overlong_prompts": skipped}


def check_sft_lengths(tokenizer, examples, max_len: int, max_new_tokens: int) -> int:
    """DataError naming the first example whose `<bos> prompt answer <eos>` (an SFT row) is
    longer than the model (otherwise the SFT step that drew it fails in the forward); returns
    how many targets (with <eos>) are longer than `max_new_tokens`, which eval cuts."""
    bos = 0 if tokenizer.bos_id is None else 1
    cut = 0
    for ex in examples:
        answer = len(tokenizer.encode(ex.answer)) + 1
        cut += answer > max_new_tokens
        n = bos + len(tokenizer.encode(ex.prompt)) + answer
        if n > max_len:
            where = ex.meta[2] if len(ex.meta) == 3 and isinstance(ex.meta[2], str) \
                else f"prompt {ex.prompt[:60]!r}"
            raise DataError(f"{where}: the SFT example (<bos> prompt, target (data.sft_key), "
                            f"<eos>) is {n} tokens, over the model's max_seq_len={max_len}; "
                            "raise model.max_seq_len or use shorter targets")
    return cut


def build_task(cfg, tokenizer, model_max_len: int, verbose: bool = False):
    """(task, train, validation, test examples): a toy task's seeded splits, or the dataset's.
    The validation split is empty without task.n_val / data.val_files / data.val_fraction."""
    if cfg.task.name != "dataset":
        task = make_task(cfg.task.name, **dict(cfg.task.kwargs))
        try:
            splits = make_splits(task, cfg.task.n_train, cfg.task.n_test, cfg.task.seed,
                                 n_val=cfg.task.n_val)
        except ValueError as e:  # more prompts asked for than the task has
            raise ConfigError(f"task.n_train / task.n_val / task.n_test: {e}") from None
        return (task, *splits)
    task = DatasetTask(reward_name=cfg.reward.name or "math",
                       reward_timeout_s=cfg.reward.timeout_s,
                       reward_batch_timeout_s=cfg.reward.batch_timeout_s
                       or cfg.model.dist_timeout_min * 30,
                       format_weight=cfg.reward.format_weight)
    room = model_max_len - cfg.rollout.max_new_tokens  # the longest prompt a rollout can take
    if cfg.data.max_prompt_tokens and cfg.data.max_prompt_tokens > room:
        raise ConfigError(f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}: over the "
                          f"{room} tokens a prompt can have (model length {model_max_len} - "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens})")
    limit = cfg.data.max_prompt_tokens or room
    train, val, test, counts = dataset_splits(cfg.data, tokenizer, limit)
    check_ground_truths(task.reward_name, cfg.data, train, val, test)
    if verbose:
        skipped = counts["data/skipped_overlong_prompts"]
        print(f"data: {len(train)} train / {len(val)} validation / {len(test)} test examples, "
              f"reward {task.reward_name}" + (f", {skipped} overlong prompts skipped" if skipped
                                              else ""), flush=True)
    return task, train, val, test


def tokenizer_folder(cfg) -> str | None:
    """data.tokenizer_path, else model.hf_path (when the config has it), else None (the
    character tokenizer)."""
    return cfg.data.tokenizer_path or getattr(cfg.model, "hf_path", None) or None

