"""The README's statements about settings and metrics hold for the code (doc-vs-code guards)."""

import os
import re
import shlex

from megatron_gspo.config import load_config

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def test_readme_template_example_gives_a_newline():
    """The README's `data.template=...` example, as the shell passes it, is accepted and its
    `\\n` is a newline (a single-quoted YAML value was a YAML mapping error; in YAML single
    quotes it would be a literal backslash-n)."""
    example, = re.findall(r"`(data\.template=[^`]*)`", _readme())
    cfg = load_config(None, ["task.name=dataset", "data.train_files=a.jsonl",
                             *shlex.split(example)])
    assert cfg.data.template == "Question: {prompt}\nAnswer:"
