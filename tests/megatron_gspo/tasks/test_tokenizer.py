"""The Tokenizer protocol: CharTokenizer and a locally built Hugging Face tokenizer folder."""

import json
import os

import pytest

from megatron_gspo.errors import ConfigError
from megatron_gspo.tasks.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
from tests.hf_fixtures import SPECIALS, make_tokenizer

PROTOCOL = ("vocab_size", "pad_id", "eos_id", "bos_id", "stop_ids", "encode", "decode",
            "apply_chat_template")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(folder))
    return str(folder)


def test_char_tokenizer_is_the_default_and_has_no_template():
    tok = load_tokenizer(None)
    assert isinstance(tok, CharTokenizer)
    assert all(hasattr(tok, a) for a in PROTOCOL)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (26, 0, 1, 2)
    assert tok.decode(tok.encode("12+30=42")) == "12+30=42"
    assert tok.apply_chat_template([{"role": "user", "content": "1+1"}]) is None


def test_char_tokenizer_decode_rejects_ids_outside_the_vocabulary():
    """-1 and vocab_size are errors, not a character read from the end of the table."""
    tok = CharTokenizer()
    assert tok.decode([tok.vocab_size - 1]) == "s"
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match=f"token id {bad} outside the vocabulary"):
            tok.decode([bad])


def test_hf_tokenizer_ids_round_trip_and_chat_template(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert isinstance(tok, HFTokenizer)
    assert all(hasattr(tok, a) for a in PROTOCOL)
    assert tok.vocab_size == len(tok.hf) == 300
    assert tok.eos_id == SPECIALS.index("<|im_end|>") == 2
    assert tok.pad_id == SPECIALS.index("<|endoftext|>") == 0
    assert tok.bos_id is None  # Qwen has none: prompts get no <bos>
    assert tok.stop_ids == frozenset({2})
    text = "12+30=42 and the assistant answers"
    ids = tok.encode(text)
    assert len(ids) < len(text)  # merges were learned
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "12+30=?"}])
    assert prompt == "<|im_start|>user\n12+30=?<|im_end|>\n<|im_start|>assistant\n"
    # special tokens encode to their own ids; decoding stops at the first stop id
    assert tok.encode("<|im_start|>")[0] == 1
    assert tok.decode(tok.encode("42") + [tok.eos_id] + tok.encode("junk")) == "42"
    assert tok.decode(tok.encode("<|im_start|>42")) == "42"  # special tokens are skipped


def test_generation_config_eos_ids_join_the_stop_set(tok_dir, tmp_path):
    import shutil

    folder = tmp_path / "gen"
    shutil.copytree(tok_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_tokenizer(str(folder)).stop_ids == frozenset({0, 2})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))  # an int
    assert load_tokenizer(str(folder)).stop_ids == frozenset({1, 2})


def test_end_of_turn_stops_only_with_a_chat_template(tok_dir, tmp_path):
    """With EOS <|endoftext|> (a Qwen base tokenizer), the template's <|im_end|> joins the stop
    set; without a chat template it does not."""
    import shutil

    folder = tmp_path / "base"
    shutil.copytree(tok_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(folder))
    assert (tok.eos_id, tok.pad_id, tok.stop_ids) == (0, 0, frozenset({0, 2}))
    assert tok.decode(tok.encode("42<|im_end|>junk")) == "42"
    config.pop("chat_template", None)  # where older transformers versions keep it
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "eos_token": "<|endoftext|>"}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok = load_tokenizer(str(folder))
    assert tok.apply_chat_template([{"role": "user", "content": "1"}]) is None
    assert tok.stop_ids == frozenset({0})


def test_hub_name_and_missing_folder_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="hub name.*never downloads"):
        load_tokenizer("Qwen/Qwen3-30B-A3B")
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        load_tokenizer(str(tmp_path / "nope"))
    assert "hub name" not in str(err.value)


def _custom_tok(folder, bos_post_processor=False, extra_tokens=(), **special) -> str:
    """A fixture-corpus BPE saved with chosen special tokens (eos/pad/bos), an optional
    post-processor that prepends <|im_start|> (as BOS-adding tokenizers do) and added tokens."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from tests.hf_fixtures import CORPUS
    from tools.make_fixtures import train_tokenizer

    tok = train_tokenizer(CORPUS, 300, special_tokens=SPECIALS)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.add_tokens(list(extra_tokens))
    fast.save_pretrained(str(folder))
    return str(folder)


def test_missing_eos_is_refused_and_missing_pad_falls_back_to_eos(tmp_path):
    with pytest.raises(ValueError, match="tokenizer has no eos_token"):
        load_tokenizer(_custom_tok(tmp_path / "no_eos"))
    tok = load_tokenizer(_custom_tok(tmp_path / "no_pad", eos_token="<|im_end|>"))
    assert (tok.eos_id, tok.pad_id) == (2, 2)


def test_bos_id_and_encode_without_the_tokenizers_own_specials(tmp_path):
    """A BOS token is reported as bos_id (the sampler prepends it), so encode must not add it
    again through the tokenizer's post-processor."""
    tok = load_tokenizer(_custom_tok(tmp_path / "bos", bos_post_processor=True,
                                     eos_token="<|im_end|>", bos_token="<|im_start|>"))
    assert tok.bos_id == 1
    assert tok.hf.encode("42")[0] == 1 and tok.encode("42")[0] != 1
    assert tok.decode(tok.encode("42")) == "42"


def test_vocab_size_counts_added_tokens(tmp_path):
    """Added tokens get ids past the base vocabulary; the model's vocabulary must cover them."""
    tok = load_tokenizer(_custom_tok(tmp_path / "added", extra_tokens=["<tool>"],
                                     eos_token="<|im_end|>"))
    assert tok.vocab_size == len(tok.hf) == 301 and tok.encode("<tool>") == [300]


def test_decoding_stops_before_a_non_special_stop_id(tok_dir, tmp_path):
    """A generation_config eos id that is an ordinary token is cut, not decoded."""
    import shutil

    folder = tmp_path / "gen"
    shutil.copytree(tok_dir, folder)
    stop = load_tokenizer(tok_dir).encode("the")[0]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    tok = load_tokenizer(str(folder))
    assert tok.decode(tok.encode("42") + [stop] + tok.encode("7")) == "42"


def test_a_non_chatml_end_of_turn_stops_only_through_generation_config(tmp_path):
    """What docs/data.md states: ChatML's <|im_end|> is found from the template; another
    template's end-of-turn token (Gemma's <end_of_turn>) stops sampling only when
    generation_config.json lists it."""
    folder = tmp_path / "gemma_like"
    _custom_tok(folder, extra_tokens=["<end_of_turn>"], eos_token="<|endoftext|>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}<start>{{ m['content'] }}<end_of_turn>"
                               "{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    end = tok.hf.convert_tokens_to_ids("<end_of_turn>")
    assert tok.apply_chat_template([{"role": "user", "content": "1"}]) is not None
    assert end not in tok.stop_ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, end]}))
    assert end in load_tokenizer(str(folder)).stop_ids


def test_a_model_folder_without_tokenizer_files_is_refused(tmp_path):
    """Weights and config.json only (tokenizer files not downloaded): transformers would build
    an empty tokenizer of the config's class (1 token) and the run would fail much later."""
    from tests.hf_fixtures import make_model

    make_model(str(tmp_path), vocab_size=300, tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no tokenizer files.*data.tokenizer_path"):
        load_tokenizer(str(tmp_path))


def test_a_tokenizer_without_eos_exits_2_with_one_line(single_process, tmp_path, capsys):
    from megatron_gspo.cli import main

    folder = _custom_tok(tmp_path / "no_eos")
    rows = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny", "test.jsonl")
    argv = ["eval", f"data.tokenizer_path={folder}", "wandb.mode=disabled", "task.n_eval=2",
            "task.name=dataset", f"data.train_files={rows}", "reward.name=exact"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if "warning: eval without init_checkpoint" not in line]
    assert len(err) == 1 and "no_eos: tokenizer has no eos_token" in err[0], err


def test_a_template_that_raises_is_a_value_error_naming_the_folder(tok_dir, tmp_path):
    """Gemma-style templates raise_exception('System role not supported'); that was a jinja2
    TemplateError traceback from the data loader (data.py turns the ValueError into a
    DataError naming the row)."""
    import shutil

    folder = tmp_path / "no_system"
    shutil.copytree(tok_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok = load_tokenizer(str(folder))
    assert tok.apply_chat_template([{"role": "user", "content": "1"}]) == "1"
    with pytest.raises(ValueError, match=rf"the chat template of {folder} refused the messages: "
                                         "System role not supported"):
        tok.apply_chat_template([{"role": "system", "content": "s"},
                                 {"role": "user", "content": "1"}])


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_truncated_tokenizer_file_is_a_config_error(tok_dir, tmp_path, name):
    """A truncated download raised json's JSONDecodeError from transformers (a traceback)."""
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(tok_dir, folder)
    (folder / name).write_text((folder / name).read_text()[:60])
    with pytest.raises(ConfigError, match=rf"{folder}: cannot load the tokenizer .*\(Expecting"):
        load_tokenizer(str(folder))
