"""Dataset task: reading JSONL / parquet rows in the verl and plain schemas, rendering, splits,
and the errors that name file, row and field."""

import os
from types import SimpleNamespace

import pytest

from megatron_gspo.config.schema import DataConfig, load_config
from megatron_gspo.errors import ConfigError, DataError
from megatron_gspo.run.names import check_names
from megatron_gspo.tasks.datasets import (DatasetTask, dataset_splits, freeze, read_rows,
                                          tokenizer_folder)
from megatron_gspo.tasks.toy import Example
from tests.jsonl import write_jsonl

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny")


class ByteTok:
    """Protocol stand-in: one token per UTF-8 byte; a '<u>...<a>' chat template (or none)."""

    vocab_size, pad_id, eos_id, bos_id, stop_ids = 256, 0, 1, None, frozenset({1})

    def __init__(self, chat=True, bos=None):
        self.chat, self.bos_id = chat, bos

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8")

    def apply_chat_template(self, messages):
        if not self.chat:
            return None
        return "".join(f"<{m['role'][0]}>{m['content']}" for m in messages) + "<a>"


def verl_row(i, question=None, truth=None):
    return {"data_source": "toy/src", "ability": "math",
            "prompt": [{"role": "user", "content": question or f"What is {i} + {i}?"}],
            "reward_model": {"style": "rule",
                             "ground_truth": str(2 * i) if truth is None else truth},
            "extra_info": {"answer": f"{i} + {i} = {2 * i}.\n#### {2 * i}"}}


def data_cfg(**kw):
    return DataConfig(**{"test_fraction": 0.25, **kw})


def test_verl_rows_become_examples(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [verl_row(i) for i in range(8)])
    train, _, evals, counts = dataset_splits(data_cfg(train_files=[path], shuffle=False),
                                          ByteTok(), max_prompt_tokens=100)
    assert counts == {"data/train_size": 6, "data/val_size": 0, "data/test_size": 2,
                      "data/skipped_overlong_prompts": 0}
    assert evals[0] == Example("<u>What is 0 + 0?<a>", "0", ("0", "toy/src", f"{path}:1"))
    assert [ex.answer for ex in train] == [str(2 * i) for i in range(2, 8)]


def test_sft_key_and_plain_format_with_gsm8k_answers(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [verl_row(i) for i in range(4)])
    train, _, _, _ = dataset_splits(data_cfg(train_files=[path], shuffle=False,
                                          sft_key="extra_info.answer"), ByteTok(), 100)
    assert train[0].answer == "1 + 1 = 2.\n#### 2" and train[0].meta[0] == "2"
    plain = write_jsonl(tmp_path / "plain.jsonl", [
        {"question": "Tom has {x} and 3 more?", "answer": "He has 3 + 4 = 7.\n#### 7"},
        {"question": "q2", "answer": "5"}, {"question": "q3", "answer": "6"},
        {"question": "q4", "answer": "8"}])
    train, _, evals, _ = dataset_splits(data_cfg(train_files=[plain], format="plain",
                                              template="Q: {prompt}\nA:", shuffle=False),
                                     ByteTok(chat=False), 100)
    # {x} in the prompt survives (the template is filled by replace, not str.format)
    assert evals[0] == Example("Q: Tom has {x} and 3 more?\nA:", "He has 3 + 4 = 7.\n#### 7",
                               ("7", "", f"{plain}:1"))
    assert [ex.meta[0] for ex in train] == ["5", "6", "8"]


def test_plain_ground_truth_is_the_text_after_the_last_marker(tmp_path):
    """A plain answer with '####' twice: the ground truth follows the last one (as
    rewards.math_gold_text reads it); the SFT target keeps the whole text."""
    plain = write_jsonl(tmp_path / "plain.jsonl", [
        {"question": f"q{i}", "answer": f"write #### then {i}.\n#### {i} "} for i in range(4)])
    train, _, evals, _ = dataset_splits(data_cfg(train_files=[plain], format="plain",
                                              template="{prompt}", shuffle=False),
                                     ByteTok(chat=False), 100)
    assert [ex.meta[0] for ex in evals + train] == ["0", "1", "2", "3"]
    assert evals[0].answer == "write #### then 0.\n#### 0"


def test_custom_dotted_keys_and_structured_ground_truth(tmp_path):
    rows = [{"q": f"n{i}", "sol": {"final": {"numbers": [1, i], "target": i + 1}}}
            for i in range(4)]
    path = write_jsonl(tmp_path / "cd.jsonl", rows)
    train, _, _, _ = dataset_splits(data_cfg(train_files=[path], prompt_key="q",
                                          answer_key="sol.final", shuffle=False), ByteTok(), 100)
    assert train[0].meta[0] == (("numbers", (1, 1)), ("target", 2))
    hash(train[0])
    assert freeze({"b": [1, {"c": 2}], "a": 1}) == (("a", 1), ("b", (1, (("c", 2),))))


def test_split_is_seeded_disjoint_and_eval_files_replace_it(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(40)])
    split = lambda **kw: dataset_splits(data_cfg(train_files=[path], **kw), ByteTok(), 100)
    a_train, _, a_eval, _ = split(seed=1)
    b_train, _, b_eval, _ = split(seed=1)
    c_train, _, c_eval, _ = split(seed=2)
    assert (a_train, a_eval) == (b_train, b_eval) and a_eval != c_eval
    assert len(a_eval) == 10 and len(a_train) == 30
    assert {e.prompt for e in a_eval}.isdisjoint(e.prompt for e in a_train)
    assert sorted(e.meta[0] for e in a_train + a_eval) == sorted(str(2 * i) for i in range(40))
    ev = write_jsonl(tmp_path / "e.jsonl", [verl_row(i) for i in range(100, 106)])
    train, _, evals, counts = split(test_files=[ev], max_test=4)
    assert len(train) == 40 and len(evals) == 4 and counts["data/test_size"] == 4
    assert {e.meta[0] for e in evals} <= {str(2 * i) for i in range(100, 106)}


def test_a_validation_split_leaves_the_test_split_as_it_was(tmp_path):
    """data.val_fraction takes its rows from the training rows after the test split's, so the
    test split (and its order) is the one of the same config without it; data.val_files are
    their own rows, shuffled after the test files (whose shuffle they leave alone)."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(40)])
    split = lambda **kw: dataset_splits(data_cfg(train_files=[path], **kw), ByteTok(), 100)
    train0, val0, test0, _ = split(seed=1)
    train, val, test, counts = split(seed=1, val_fraction=0.2)
    assert test == test0 and val0 == [] and (len(train), len(val), len(test)) == (22, 8, 10)
    assert val == train0[:8] and train == train0[8:]
    assert (counts["data/val_size"], counts["data/test_size"]) == (8, 10)
    ev = write_jsonl(tmp_path / "e.jsonl", [verl_row(i) for i in range(100, 106)])
    va = write_jsonl(tmp_path / "v.jsonl", [verl_row(i) for i in range(200, 203)])
    _, _, test_files, _ = split(test_files=[ev])
    train, val, test, _ = split(test_files=[ev], val_files=[va])
    assert test == test_files and len(train) == 40
    assert sorted(e.meta[0] for e in val) == [str(2 * i) for i in range(200, 203)]


def test_parquet_gives_the_same_examples_as_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [verl_row(i) for i in range(6)]
    jsonl = write_jsonl(tmp_path / "t.jsonl", rows)
    parquet = str(tmp_path / "t.parquet")
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    cfg = dict(shuffle=False, sft_key="extra_info.answer")
    from_json = dataset_splits(data_cfg(train_files=[jsonl], **cfg), ByteTok(), 100)
    from_pq = dataset_splits(data_cfg(train_files=[parquet], **cfg), ByteTok(), 100)
    strip = lambda exs: [(e.prompt, e.answer, e.meta[:2]) for e in exs]
    assert strip(from_json[0]) == strip(from_pq[0]) and strip(from_json[2]) == strip(from_pq[2])
    assert from_pq[2][0].meta[2] == f"{parquet} row 0"


@pytest.mark.parametrize("rows,fragment", [
    ([verl_row(0), {"prompt": "hi", "data_source": "s"}],
     "t.jsonl:2: missing field 'reward_model.ground_truth' (data.answer_key); the row has "
     "['data_source', 'prompt']"),
    ([verl_row(0), {"prompt": "hi", "reward_model": {"style": "rule"}}],
     "t.jsonl:2: missing field 'reward_model.ground_truth' (data.answer_key); reward_model "
     "has ['style']"),
    ([verl_row(0), {"reward_model": {"ground_truth": "1"}}],
     "t.jsonl:2: missing field 'prompt' (data.prompt_key)"),
    ([verl_row(0, truth="  ")], "t.jsonl:1: field 'reward_model.ground_truth' (the ground truth)"
                                " must be a non-empty string"),
    ([verl_row(0, truth=True)], "must be a non-empty string"),
    ([verl_row(0), verl_row(1, truth=float("nan"))],  # json.dumps writes NaN (scored 0, silently)
     "t.jsonl:2: field 'reward_model.ground_truth' (the ground truth) must be a non-empty "
     "string, a finite number or a JSON object, got nan"),
    ([{**verl_row(0), "reward_model": {"style": "rule", "ground_truth": None}}],
     "t.jsonl:1: missing field 'reward_model.ground_truth' (data.answer_key); "
     "reward_model.ground_truth is null"),  # JSON null (was: "reward_model has ['ground_truth',")
    ([{**verl_row(0), "reward_model": None}],
     "t.jsonl:1: missing field 'reward_model.ground_truth' (data.answer_key); reward_model is "
     "null"),
    ([{**verl_row(0), "prompt": []}],
     "t.jsonl:1: field 'prompt' must be a string or a non-empty list of {role, content}"),
    ([{**verl_row(0), "prompt": [{"role": "user"}]}],
     "t.jsonl:1: field 'prompt' must be a string or a non-empty list of {role, content}"),
    ([verl_row(0), "{not json"], "t.jsonl:2: not valid JSON"),
    ([verl_row(0), "[1, 2]"], "t.jsonl:2: a row must be a JSON object, got list"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, rows, fragment):
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError) as e:
        dataset_splits(data_cfg(train_files=[path]), ByteTok(), 100)
    assert fragment in str(e.value)


def test_missing_file_empty_file_and_bad_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data file not found: .*nope.jsonl "
                                                r"\(data.train_files\)"):
        dataset_splits(data_cfg(train_files=[str(tmp_path / "nope.jsonl")]), ByteTok(), 100)
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="no training examples in"):
        dataset_splits(data_cfg(train_files=[empty]), ByteTok(), 100)
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=r"x.csv: unsupported file type .*'.jsonl', '.parquet'"):
        list(read_rows(str(csv)))
    one = write_jsonl(tmp_path / "one.jsonl", [verl_row(0)])
    with pytest.raises(DataError, match="leave no training rows"):
        dataset_splits(data_cfg(train_files=[one]), ByteTok(), 100)


def test_blank_lines_are_skipped_and_lines_still_counted(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(0), verl_row(1), {"prompt": "x"}],
                       blank_line_at=1)
    with pytest.raises(DataError, match=r"t.jsonl:4: missing field"):
        dataset_splits(data_cfg(train_files=[path]), ByteTok(), 100)


def test_overlong_prompts_error_or_are_skipped_and_counted(tmp_path):
    rows = [verl_row(i) for i in range(6)] + [verl_row(9, question="x" * 50)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    # "<u>What is 5 + 5?<a>" is 20 bytes; the long one is 56
    with pytest.raises(DataError, match=r"t.jsonl:7: prompt \(prompt\) is 56 tokens, over "
                                        r"data.max_prompt_tokens=20"):
        dataset_splits(data_cfg(train_files=[path]), ByteTok(), 20)
    train, _, evals, counts = dataset_splits(data_cfg(train_files=[path],
                                                   skip_overlong_prompts=True), ByteTok(), 20)
    assert counts["data/skipped_overlong_prompts"] == 1 and len(train) + len(evals) == 6
    with pytest.raises(DataError, match="is 21 tokens"):  # a <bos> counts
        dataset_splits(data_cfg(train_files=[path]), ByteTok(bos=2), 20)
    with pytest.raises(DataError, match="no room for a prompt: max_prompt_tokens=0"):
        dataset_splits(data_cfg(train_files=[path]), ByteTok(), 0)


def test_eval_files_are_seeded_shuffled_and_their_skips_counted(tmp_path):
    """data.shuffle also shuffles data.eval_files (with data.seed), so max_eval takes a seeded
    sample; overlong eval prompts skipped count in data/skipped_overlong_prompts."""
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(4)])
    ev = write_jsonl(tmp_path / "e.jsonl", [verl_row(i) for i in range(100, 108)]
                     + [verl_row(9, question="x" * 50)])
    split = lambda **kw: dataset_splits(data_cfg(train_files=[path], test_files=[ev],
                                                 skip_overlong_prompts=True, **kw), ByteTok(), 30)
    _, _, in_order, counts = split(shuffle=False)
    truths = [str(2 * i) for i in range(100, 108)]
    assert [e.meta[0] for e in in_order] == truths
    assert counts["data/skipped_overlong_prompts"] == 1 and counts["data/test_size"] == 8
    (_, _, a, _), (_, _, a2, _), (_, _, b, _) = split(seed=1), split(seed=1), split(seed=2)
    assert a == a2 and a != in_order and a != b
    assert sorted(e.meta[0] for e in a) == sorted(truths)


def test_no_chat_template_needs_data_template(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(0)])
    with pytest.raises(DataError, match=r"t.jsonl:1: data.template is null .* set "
                                        "data.template"):
        dataset_splits(data_cfg(train_files=[path]), ByteTok(chat=False), 100)


def test_real_chat_template_from_the_fixture_tokenizer():
    pytest.importorskip("transformers")
    from megatron_gspo.tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(FIXTURE)
    data = data_cfg(train_files=[os.path.join(FIXTURE, "train.jsonl")],
                    test_files=[os.path.join(FIXTURE, "test.jsonl")], shuffle=False)
    train, _, evals, _ = dataset_splits(data, tok, 200)
    assert (len(train), len(evals)) == (180, 20)
    assert train[0].prompt.startswith("<|im_start|>user\nMaya has 10 apples.")
    assert train[0].prompt.endswith("\"####\".<|im_end|>\n<|im_start|>assistant\n")
    assert train[0].answer == "82" and train[0].meta[0] == "82"
    assert tok.eos_id in tok.stop_ids and tok.decode(tok.encode("#### 5<|im_end|>junk")) \
        == "#### 5"


def test_dataset_task_reward_and_format_weight():
    pytest.importorskip("math_verify")
    ex = Example("p", "3 + 4 = 7\n#### 7", ("7", "src", "f:1"))
    plain = DatasetTask("math")
    assert plain.reward(ex, "#### 7") == 1.0 and plain.reward(ex, "#### 8") == 0.0
    shaped = DatasetTask("math", format_weight=0.1)
    assert shaped.reward(ex, "#### 7") == 1.0
    assert shaped.reward(ex, "#### 8") == 0.1  # wrong, right format
    assert shaped.reward(ex, "it is 8") == 0.0  # wrong, no #### / \boxed
    assert shaped.format_ok("\\boxed{8}") and not shaped.format_ok("8")
    with pytest.raises(TypeError, match="come from its files"):
        plain.sample(None)
    with pytest.raises(KeyError, match="valid names"):
        DatasetTask("nope")


def test_fixture_solutions_score_one_and_shifted_answers_zero():
    """Every fixture row's worked solution (its SFT target) passes the math verifier."""
    pytest.importorskip("math_verify")
    task = DatasetTask("math")
    for name in ("train.jsonl", "test.jsonl"):
        for where, row in read_rows(os.path.join(FIXTURE, name)):
            truth = row["reward_model"]["ground_truth"]
            ex = Example("", "", (truth, "", where))
            solution = row["extra_info"]["answer"]
            assert solution.endswith(f"#### {truth}")
            assert task.reward(ex, solution) == 1.0, where
            assert task.reward(ex, solution.rsplit("####", 1)[0] + "#### 1000") == 0.0, where


def test_config_rules():
    base = ["task.name=dataset", "data.train_files=a.jsonl"]
    cfg = load_config(None, base)
    assert cfg.data.train_files == ["a.jsonl"] and cfg.reward.name is None
    for bad, fragment in [
        (["task.name=dataset"], "set task.name=dataset together with data.train_files"),
        (["data.train_files=[a.jsonl]"], "task.name=addition with data.train_files"),
        (["reward.name=math"], "toy task addition has its own verifier"),
        ([*base, "reward.format_weight=1.0"], "reward.format_weight=1.0: must be in [0, 1)"),
        ([*base, "data.template=Answer"], "data.template=Answer: must contain {prompt}"),
        ([*base, "data.test_fraction=0"], "data.test_fraction=0.0: must be in (0, 1)"),
        ([*base, "data.train_files=[a.jsonl, '']"], "must be a list of non-empty paths"),
        ([*base, "task.kwargs.num_digits=2"], "configured by the data section"),
        (["filter.dynamic_sampling=true", "train.routing_replay=r3"], "use r2"),
        (["filter.max_rounds=0"], "filter.max_rounds=0: must be >= 1"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, bad)
        assert fragment in str(e.value), (bad, str(e.value))
    assert load_config(None, [*base, "data.test_fraction=0", "data.test_files=b.jsonl"])
    with pytest.raises(ConfigError) as e:  # a registry's name: checked at set-up
        check_names(load_config(None, [*base, "reward.name=mth"]))
    assert "reward.name=mth: valid names: ['countdown', 'exact'" in str(e.value)


def test_tokenizer_folder_precedence():
    cfg = lambda tok, hf: SimpleNamespace(data=SimpleNamespace(tokenizer_path=tok),
                                          model=SimpleNamespace(hf_path=hf))
    assert tokenizer_folder(cfg("tok", "model")) == "tok"
    assert tokenizer_folder(cfg(None, "model")) == "model"
    assert tokenizer_folder(cfg(None, None)) is None
    assert tokenizer_folder(SimpleNamespace(data=SimpleNamespace(tokenizer_path=None),
                                            model=SimpleNamespace())) is None


def test_template_bos_text_is_not_doubled(tmp_path):
    """A template that writes the BOS text itself (Llama 3 style) loses it: the sampler
    prepends bos_id to every prompt already."""

    class BosTok(ByteTok):
        hf = SimpleNamespace(bos_token="<s>")

        def apply_chat_template(self, messages):
            return "<s>" + super().apply_chat_template(messages)

    path = write_jsonl(tmp_path / "t.jsonl", [verl_row(i) for i in range(4)])
    cfg = data_cfg(train_files=[path], shuffle=False)
    _, _, evals, _ = dataset_splits(cfg, BosTok(bos=2), 100)
    assert evals[0].prompt == "<u>What is 0 + 0?<a>"
    _, _, evals, _ = dataset_splits(cfg, BosTok(bos=None), 100)  # no bos id: the text stays
    assert evals[0].prompt == "<s><u>What is 0 + 0?<a>"


def test_build_task_prompt_limit_defaults_to_model_length_minus_new_tokens(tmp_path, capsys):
    from megatron_gspo.tasks.datasets import build_task
    from megatron_gspo.run.setup import model_max_len

    rows = [verl_row(i) for i in range(5)] + [verl_row(7, question="x" * 30)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    over = ["task.name=dataset", f"data.train_files={path}", "reward.name=exact",
            "rollout.max_new_tokens=8", "model.max_seq_len=30"]
    cfg = load_config(None, over)
    assert model_max_len(cfg) == 30 and model_max_len(load_config(None)) == 64
    with pytest.raises(DataError, match=r"t.jsonl:6: prompt \(prompt\) is 36 tokens, over "
                                        r"data.max_prompt_tokens=22"):
        build_task(cfg, ByteTok(), model_max_len(cfg))
    cfg = load_config(None, over + ["data.skip_overlong_prompts=true"])
    task, train, _, evals = build_task(cfg, ByteTok(), model_max_len(cfg), verbose=True)
    assert (task.name, task.reward_name, len(train), len(evals)) == ("dataset", "exact", 4, 1)
    assert task.reward(evals[0], evals[0].meta[0]) == 1.0
    assert "4 train / 0 validation / 1 test examples, reward exact, 1 overlong prompts skipped" \
        in capsys.readouterr().out
    # an explicit data.max_prompt_tokens replaces the default (here 64 - 8 = 56)
    cfg = load_config(None, over + ["model.max_seq_len=64", "data.max_prompt_tokens=22"])
    with pytest.raises(DataError, match="is 36 tokens, over data.max_prompt_tokens=22"):
        build_task(cfg, ByteTok(), model_max_len(cfg))
    # one the model cannot take is refused before any data is read (not at the first forward
    # of a long prompt, mid-run)
    cfg = load_config(None, over + ["data.max_prompt_tokens=23"])
    with pytest.raises(ConfigError, match=r"^data.max_prompt_tokens=23: over the 22 tokens a "
                                          r"prompt can have \(model length 30 - "
                                          r"rollout.max_new_tokens=8\)$"):
        build_task(cfg, ByteTok(), model_max_len(cfg))
