"""Run configuration sections for files of prompts: `data`, `reward`, `filter` (`task.name=dataset`
and DAPO's rollout filters), and their rules across sections. Part of the schema in
`megatron_gspo.config.schema`, which re-exports them; the conventions of
`megatron_gspo.config.sections` hold (a docstring under every field, `__post_init__` only
checks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_gspo.config.fields import OptionalPath, Paths, check, validate
from megatron_gspo.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    """Prompts from files (task.name=dataset; task.n_train / n_val / n_test / seed do not apply)."""
    _section: ClassVar[str] = "data"
    _renamed: ClassVar[dict] = {"eval_files": "test_files", "eval_fraction": "test_fraction",
                                "max_eval": "max_test"}

    train_files: Paths = field(default_factory=list)
    """Training files (.jsonl, or .parquet with pyarrow installed); a string is one file. Set
    exactly when task.name=dataset."""
    test_files: Paths = field(default_factory=list)
    """Held-out test files (evaluated at a run's first and last step, `test/...`); empty = split
    data.test_fraction of the (shuffled) train rows off. Formerly eval_files (still read)."""
    val_files: Paths = field(default_factory=list)
    """Validation files (verl's val_files): what evals during training and the accuracy bands
    read; empty = split data.val_fraction of the train rows off (after the test rows)."""
    format: Literal["verl", "plain"] = "verl"
    """Row schema. verl: `prompt` = list of chat messages ({role, content}),
    `reward_model.ground_truth`, `data_source`. plain: `question`, `answer` (a GSM8K answer's
    text after '####' is its ground truth)."""
    prompt_key: Optional[str] = None
    """Dotted field holding the prompt; None = the format's (verl: prompt; plain: question)."""
    answer_key: Optional[str] = None
    """Dotted field holding the ground truth; None = the format's (verl:
    reward_model.ground_truth; plain: answer)."""
    sft_key: Optional[str] = None
    """Dotted field holding the SFT target (a worked solution), e.g. extra_info.answer;
    None = the answer field."""
    template: Optional[str] = None
    """None = the tokenizer's chat template (apply_chat_template, generation prompt on; an
    error if it has none). A string with {prompt} = a plain template for base models, e.g.
    "Question: {prompt}\\nAnswer:" in YAML double quotes, where \\n is a newline (on the command
    line: data.template='"Question: {prompt}\\nAnswer:"'); {prompt} = the message contents
    joined by blank lines."""
    test_fraction: float = 0.1
    """Fraction of the train rows held out for test when data.test_files is empty. Formerly
    eval_fraction (still read)."""
    val_fraction: float = 0.0
    """Fraction of the train rows held out for validation when data.val_files is empty (taken
    after the test rows, so the test split stays as without it); 0 = no validation split: evals
    during training and the accuracy bands read the test split, as before this split existed."""
    max_test: Optional[int] = None
    """Cap on the test examples (the first ones after the seeded shuffle); None = all. Formerly
    max_eval (still read)."""
    shuffle: bool = True
    """Shuffle rows with data.seed before splitting (and the test / validation rows read from
    their own files)."""
    seed: int = 1234
    """Seed of the shuffle and train / validation / test split."""
    max_prompt_tokens: Optional[int] = None
    """Longest prompt in tokens (with <bos>); None = the model's max_seq_len minus
    rollout.max_new_tokens. Longer prompts are an error naming file, row and field, or skipped
    and counted with data.skip_overlong_prompts."""
    skip_overlong_prompts: bool = False
    """Skip (and count) prompts longer than max_prompt_tokens instead of failing."""
    special_tokens_in_text: Literal["forbid", "allow", "escape"] = "forbid"
    """A special token's text inside a row's prompt (a message's content, and its role where
    the chat template renders it) or SFT target (`<|im_end|>`, `<|im_start|>`), which the
    tokenizer would read as the token itself: a row could forge a
    chat turn, and an end-of-turn id also stops sampling. forbid: an error naming the file, line
    and token; escape: a zero-width space after its first character makes it ordinary text;
    allow: read as the token (Hugging Face's and verl's default)."""
    tokenizer_path: OptionalPath = None
    """Local tokenizer folder (tokenizer.json + tokenizer_config.json). Precedence:
    data.tokenizer_path, else model.hf_path (the model's folder), else the toy character
    tokenizer."""

    def __post_init__(self):
        validate(self, nonempty=("prompt_key", "answer_key", "sft_key", "tokenizer_path"),
                 ge={"max_test": 1, "max_prompt_tokens": 1})
        for name in ("train_files", "test_files", "val_files"):
            check(self, name, all(isinstance(p, str) and p for p in getattr(self, name)),
                  "must be a list of non-empty paths")
        check(self, "test_fraction", 0 < self.test_fraction < 1 or bool(self.test_files),
              "must be in (0, 1) (or give data.test_files)")
        check(self, "val_fraction", 0 <= self.val_fraction < 1, "must be in [0, 1)")
        held_out = (0 if self.test_files else self.test_fraction) + \
            (0 if self.val_files else self.val_fraction)
        check(self, "val_fraction", held_out < 1, f"and data.test_fraction={self.test_fraction} "
              "leave no training rows")
        check(self, "template", self.template is None or "{prompt}" in self.template,
              "must contain {prompt} (or be null for the tokenizer's chat template)")


@dataclass(frozen=True)
class RewardConfig:
    """Verifier of dataset tasks (registry in `megatron_gspo.tasks.rewards`)."""
    _section: ClassVar[str] = "reward"

    name: Optional[str] = None
    """Reward: exact, countdown or math (math-verify, pip install -e .[math]), or any name
    registered with `register_reward` (checked at set-up). None = the task's own verifier (toy
    tasks; task.name=dataset uses math). Toy tasks take no name."""
    timeout_s: float = 5.0
    """Per-answer time limit in seconds of a dataset task's reward (0 = none); a reward that
    raises or runs out of time scores 0 and is counted in reward/errors."""
    batch_timeout_s: Optional[float] = None
    """Time limit in seconds of scoring one batch on a rank (a rollout batch, an eval), so that
    a rank never keeps its peers waiting in a collective past model.dist_timeout_min: answers
    not reached in time score 0 and are counted in reward/timeouts. None = half the collective
    timeout (model.dist_timeout_min * 30); must be below model.dist_timeout_min * 60."""
    format_weight: float = 0.0
    """Reward of a wrong answer in the right format (the reward's format check, e.g. a
    \\boxed{} or '#### ' answer for math); 0 = off. In [0, 1): a correct answer scores 1."""

    def __post_init__(self):
        validate(self, nonempty=("name",), ge={"timeout_s": 0}, gt={"batch_timeout_s": 0})
        check(self, "format_weight", 0 <= self.format_weight < 1, "must be in [0, 1)")


@dataclass(frozen=True)
class FilterConfig:
    """DAPO's rollout filters (arXiv 2503.14476, sec. 3.2 and 3.4)."""
    _section: ClassVar[str] = "filter"

    overlong: bool = False
    """Overlong filtering: responses that hit rollout.max_new_tokens without a stop token get
    advantage 0 (no policy-gradient signal). response/truncated_frac is logged either way."""
    dynamic_sampling: bool = False
    """Dynamic sampling: drop prompt groups whose G rewards are all equal and draw more prompts,
    up to filter.max_rounds rollout rounds; the batch keeps its size (equal-reward groups fill
    it when too few varied ones were found). Logs filter/zero_std_frac/{before,after}."""
    max_rounds: int = 4
    """Most rollout rounds per iteration under dynamic sampling (1 = no extra draws)."""

    def __post_init__(self):
        validate(self, ge={"max_rounds": 1})


def check_data_sections(cfg) -> None:
    """Cross-section rules of DataConfig / RewardConfig / FilterConfig (RunConfig calls it)."""
    dataset = cfg.task.name == "dataset"
    if dataset != bool(cfg.data.train_files):
        raise ConfigError(
            f"task.name={cfg.task.name} with data.train_files={cfg.data.train_files}: set "
            "task.name=dataset together with data.train_files (and neither for a toy task)")
    if dataset and cfg.task.kwargs:
        raise ConfigError(f"task.kwargs={cfg.task.kwargs}: task.name=dataset is configured by "
                          "the data section")
    if not dataset and cfg.reward.name is not None:
        raise ConfigError(f"reward.name={cfg.reward.name}: toy task {cfg.task.name} has its "
                          "own verifier (reward.name applies to task.name=dataset)")
    collective_s = cfg.model.dist_timeout_min * 60
    if cfg.reward.batch_timeout_s is not None and cfg.reward.batch_timeout_s >= collective_s:
        raise ConfigError(f"reward.batch_timeout_s={cfg.reward.batch_timeout_s:g}: not below the "
                          "collective timeout model.dist_timeout_min="
                          f"{cfg.model.dist_timeout_min:g} ({collective_s:g} s), which the other "
                          "ranks wait under while one scores its batch")
    if cfg.filter.dynamic_sampling and cfg.train.routing_replay == "r3":
        raise ConfigError("filter.dynamic_sampling=true with train.routing_replay=r3: the "
                          "sampler's routing of several rollout rounds is not merged; use r2")
