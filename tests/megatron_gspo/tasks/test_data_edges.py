"""Dataset task edge cases: message checks, template joining, splits' boundaries, build_task
wiring (mutation-pass guards; helpers from test_data)."""

import re
from types import SimpleNamespace

import pytest

import megatron_gspo.tasks.rewards as rewards_mod
from megatron_gspo.config.schema import load_config
from megatron_gspo.tasks.datasets import DatasetTask, build_task, dataset_splits
from megatron_gspo.errors import DataError
from megatron_gspo.tasks.rewards import REWARDS, FORMAT_CHECKS, register_reward
from megatron_gspo.tasks.toy import Example
from tests.jsonl import write_jsonl
from tests.megatron_gspo.tasks.test_data import ByteTok, data_cfg, verl_row


def test_math_reward_needs_math_verify_at_construction(monkeypatch):
    """A missing math-verify fails when the task is built, not as a counted error (and a
    zero) at every reward; other rewards do not need it."""
    def missing():
        raise ImportError("reward 'math' needs the math-verify package: pip install")

    monkeypatch.setattr(rewards_mod, "_math_verify", missing)
    with pytest.raises(ImportError, match="pip install"):
        DatasetTask("math")
    assert DatasetTask("exact").reward_name == "exact"


def test_partial_reward_keeps_the_larger_of_it_and_the_format_weight():
    """format_weight is a floor for a wrong but well-formatted answer, not a replacement."""
    register_reward("half_test", format_check=lambda c: True)(lambda c, truth: 0.5)
    try:
        ex = Example("p", "a", ("a", "", "f:1"))
        assert DatasetTask("half_test", format_weight=0.25).reward(ex, "x") == 0.5
        assert DatasetTask("half_test", format_weight=0.75).reward(ex, "x") == 0.75
    finally:
        REWARDS.pop("half_test", None)
        FORMAT_CHECKS.pop("half_test", None)


def test_a_message_without_a_role_names_the_row(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{**verl_row(0), "prompt": [{"content": "hi"}]}])
    with pytest.raises(DataError, match=r"t.jsonl:1: field 'prompt' must be a string or a "
                                        r"non-empty list of \{role, content\}"):
        dataset_splits(data_cfg(train_files=[path]), ByteTok(), 100)


def test_template_joins_messages_with_a_blank_line_and_chat_sees_only_role_content(tmp_path):
    """data.template gets the messages' contents joined by a blank line; a chat template gets
    each message as {role, content} only (other keys of the row are dropped)."""
    messages = [{"role": "system", "content": "Be brief.", "name": "x"},
                {"role": "user", "content": "1+1?"}]
    path = write_jsonl(tmp_path / "t.jsonl", [{**verl_row(i), "prompt": messages}
                                              for i in range(4)])
    cfg = dict(train_files=[path], shuffle=False)
    _, _, evals, _ = dataset_splits(data_cfg(template="Q: {prompt}", **cfg), ByteTok(), 100)
    assert evals[0].prompt == "Q: Be brief.\n\n1+1?"

    seen = []

    class Recording(ByteTok):
        def apply_chat_template(self, msgs):
            seen.append(msgs)
            return super().apply_chat_template(msgs)

    dataset_splits(data_cfg(**cfg), Recording(), 100)
    assert seen[0] == [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "1+1?"}]


def test_bos_text_is_removed_only_where_the_template_starts_with_it(tmp_path):
    """A tokenizer with a BOS whose chat template does not write it keeps the whole text."""

    class BosNotWritten(ByteTok):
        hf = SimpleNamespace(bos_token="<s>")

    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(4)])
    _, _, evals, _ = dataset_splits(data_cfg(train_files=[path], shuffle=False),
                                 BosNotWritten(bos=2), 100)
    assert evals[0].prompt == "<u>What is 0 + 0?<a>"


def test_verl_ground_truth_with_a_marker_is_kept_whole(tmp_path):
    """Only the plain schema reduces 'solution #### answer'; a verl ground truth is the field."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i, truth=f"x #### {i}") for i in range(4)])
    train, _, _, _ = dataset_splits(data_cfg(train_files=[path], shuffle=False), ByteTok(), 100)
    assert train[0].meta[0] == "x #### 1"


def test_eval_fraction_rounds_to_the_nearest_row(tmp_path):
    """9 rows * 0.2 = 1.8 -> 2 eval rows (rounded, not truncated)."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(9)])
    train, _, evals, _ = dataset_splits(data_cfg(train_files=[path], test_fraction=0.2),
                                     ByteTok(), 100)
    assert (len(train), len(evals)) == (7, 2)


def test_eval_files_with_no_usable_row_are_an_error(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(4)])
    ev = write_jsonl(tmp_path / "e.jsonl", [verl_row(9, question="x" * 50)])
    with pytest.raises(DataError, match="no test examples in"):
        dataset_splits(data_cfg(train_files=[path], test_files=[ev], skip_overlong_prompts=True),
                       ByteTok(), 30)


def test_build_task_takes_reward_settings_and_a_prompt_limit_equal_to_the_room(tmp_path):
    """reward.timeout_s / format_weight reach the task; data.max_prompt_tokens equal to
    max_seq_len - max_new_tokens (the whole room) is allowed."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(5)])
    cfg = load_config(None, ["task.name=dataset", f"data.train_files={path}",
                             "reward.name=exact", "reward.timeout_s=2.5",
                             "reward.format_weight=0.2", "rollout.max_new_tokens=8",
                             "model.max_seq_len=30", "data.max_prompt_tokens=22"])
    task, train, _, evals = build_task(cfg, ByteTok(), 30)
    assert (task.reward_timeout_s, task.format_weight) == (2.5, 0.2)
    assert len(train) + len(evals) == 5


def _ground_truth_task(tmp_path, reward: str, truths: list):
    """build_task over one verl row per ground truth, scored by `reward`."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i, truth=t) for i, t in enumerate(truths)])
    cfg = load_config(None, ["task.name=dataset", f"data.train_files={path}",
                             f"reward.name={reward}", "model.max_seq_len=40"])
    return build_task(cfg, ByteTok(), 40)


@pytest.mark.parametrize("reward, truth, says", [
    ("exact", 82.0, "is the number 82.0: reward 'exact' compares the answer's text with '82.0'"),
    ("exact", ["82"], "is a list: reward 'exact' compares"),
    ("math", [8, 2], "is a list: reward 'math' compares one answer"),
    ("math", {"value": 82}, "is a JSON object: reward 'math' compares one answer"),
    ("countdown", "82", "is the str '82': reward 'countdown' reads [numbers, target] or"),
])
def test_a_ground_truth_the_reward_can_never_score_is_refused_naming_the_row(tmp_path, reward,
                                                                             truth, says):
    """A float under `exact` (the text "82.0" is not the answer "82"), a list under `exact` or
    `math`, a lone value under `countdown`: the data check names the file, line and field,
    where the run would score every answer to that row 0."""
    good = {"exact": "8", "math": "8", "countdown": [[1, 7], 8]}[reward]
    with pytest.raises(DataError, match=rf"t.jsonl:5: field 'reward_model.ground_truth' \(the "
                                        rf"ground truth\) {re.escape(says)}"):
        _ground_truth_task(tmp_path, reward, [good] * 4 + [truth])


@pytest.mark.parametrize("reward, truth", [
    ("exact", "82"), ("exact", 82), ("math", 82.5), ("math", "\\frac{1}{2}"),
    ("countdown", [[1, 2], 3]), ("countdown", {"numbers": [1, 2], "target": 3})])
def test_a_ground_truth_the_reward_reads_loads(tmp_path, reward, truth):
    _, train, _, test = _ground_truth_task(tmp_path, reward, [truth] * 4)
    assert len(train) + len(test) == 4


@pytest.mark.parametrize("reward_model", ["the ground_truth is 4", 4, ["ground_truth"]])
def test_a_non_object_on_the_field_path_names_its_type(tmp_path, reward_model):
    """reward_model holding a string / number / list is a missing field, not a substring
    match or a TypeError."""
    path = write_jsonl(tmp_path / "t.jsonl", [{**verl_row(0), "reward_model": reward_model}])
    with pytest.raises(DataError, match=r"t.jsonl:1: missing field 'reward_model.ground_truth' "
                                        rf"\(data.answer_key\); reward_model has "
                                        rf"{type(reward_model).__name__}$"):
        dataset_splits(data_cfg(train_files=[path]), ByteTok(), 100)


def test_prompt_the_char_tokenizer_cannot_encode_names_the_row(tmp_path):
    """task.name=dataset without data.tokenizer_path falls back to the toy character tokenizer,
    which cannot encode real text: a DataError naming the row and the setting, not a bare
    ValueError (a traceback from the CLI)."""
    from megatron_gspo.tasks.tokenizer import CharTokenizer

    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(4)])
    with pytest.raises(DataError, match=r"t.jsonl:1: the CharTokenizer cannot encode the prompt "
                                        r"\(unknown character 'Q'.*data.tokenizer_path"):
        dataset_splits(data_cfg(train_files=[path], template="Q: {prompt}", shuffle=False),
                       CharTokenizer(), 100)


def test_jsonl_with_a_bom_crlf_and_no_final_newline_reads_every_row(tmp_path):
    """Files saved by Windows tools: a UTF-8 BOM before the first row (was 'not valid JSON' on
    line 1), CRLF line ends and no newline after the last row."""
    import json

    from megatron_gspo.tasks.datasets import read_rows

    rows = [verl_row(i) for i in range(3)]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(r) for r in rows).encode())
    got = list(read_rows(str(path)))
    assert [w for w, _ in got] == [f"{path}:{i}" for i in (1, 2, 3)]
    assert [r for _, r in got] == rows


@pytest.mark.parametrize("entry", ["", "/*.jsonl", "/a.jsonl,{d}/b.jsonl"])
def test_a_directory_glob_or_comma_list_says_how_to_list_files(tmp_path, entry):
    """These were 'data file not found' (for a directory that exists); the message now gives
    the list syntax that works on the command line."""
    from megatron_gspo.tasks.datasets import read_rows

    write_jsonl(tmp_path / "a.jsonl", [verl_row(0)])
    path = str(tmp_path) + entry.format(d=tmp_path)
    with pytest.raises(DataError, match=r"\(data.train_files\): one entry is one file, .*"
                                        r"data.train_files=\[a.jsonl,b.jsonl\]"):
        list(read_rows(path))


def test_a_json_error_message_reads_once_at_column(tmp_path):
    """json's messages 'Invalid control character at' / 'Unterminated string starting at' end
    in 'at'; the column is appended once (was '... at at column 14'). An unclosed string on a
    line meets the line's newline first."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(0), '{"prompt": "a'])
    from megatron_gspo.tasks.datasets import read_rows

    with pytest.raises(DataError, match=r"t.jsonl:2: not valid JSON \(Invalid control character "
                                        r"at column 14\)$"):
        list(read_rows(path))


@pytest.mark.parametrize("sft_key,kind", [("extra_info", "dict"), ("prompt", "list")])
def test_an_sft_key_on_an_object_or_list_is_refused(tmp_path, sft_key, kind):
    """data.sft_key=extra_info (for extra_info.answer) trained SFT on the Python repr of the
    dict ("{'answer': ...}"), silently; the target must be a string or a number."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(4)])
    with pytest.raises(DataError, match=rf"t.jsonl:1: field '{sft_key}' \(data.sft_key, the SFT "
                                        rf"target\) must be a string or a number, got {kind}"):
        dataset_splits(data_cfg(train_files=[path], sft_key=sft_key, shuffle=False), ByteTok(),
                       100)


def test_a_chat_template_that_refuses_the_messages_names_the_row(tmp_path):
    class Refusing(ByteTok):
        def apply_chat_template(self, messages):
            if messages[0]["role"] == "system":
                raise ValueError("the chat template of tok/ refused the messages: no system")
            return super().apply_chat_template(messages)

    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(0), {**verl_row(1), "prompt": system}])
    with pytest.raises(DataError, match=r"t.jsonl:2: the chat template of tok/ refused the "
                                        r"messages: no system \(roles \['system', 'user'\]\); "
                                        r"fix the rows or set data.template"):
        dataset_splits(data_cfg(train_files=[path]), Refusing(), 100)


def test_a_corrupt_or_mislabeled_parquet_file_is_a_data_error(tmp_path):
    """A truncated download or a JSONL file named .parquet raised pyarrow's ArrowInvalid (a
    traceback from the CLI)."""
    pytest.importorskip("pyarrow")
    from megatron_gspo.tasks.datasets import read_rows

    path = write_jsonl(tmp_path / "t.parquet", [verl_row(0)])
    with pytest.raises(DataError, match=r"t.parquet: not a readable parquet file \(.*magic"):
        list(read_rows(path))


def test_a_row_that_is_not_utf8_names_its_line(tmp_path):
    """A file saved as Latin-1 / cp1252 raised UnicodeDecodeError (a traceback, no line)."""
    import json

    from megatron_gspo.tasks.datasets import read_rows

    rows = [verl_row(0), verl_row(1, question="Élodie has 3 apples.")]
    path = tmp_path / "t.jsonl"
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n"
                             for r in rows).encode("latin-1"))
    with pytest.raises(DataError, match=r"t.jsonl:2: not UTF-8 \(invalid continuation byte at "
                                        r"byte \d+\); save the file as UTF-8"):
        list(read_rows(str(path)))


def test_eval_files_whose_prompts_were_all_skipped_say_so(tmp_path):
    """As for the train files: 'no test examples' alone read like an empty file."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(4)])
    ev = write_jsonl(tmp_path / "e.jsonl", [verl_row(9, question="x" * 50)] * 2)
    with pytest.raises(DataError, match=r"no test examples in \[.*e.jsonl'\] \(2 overlong "
                                        r"prompts skipped\)$"):
        dataset_splits(data_cfg(train_files=[path], test_files=[ev], skip_overlong_prompts=True),
                       ByteTok(), 30)
