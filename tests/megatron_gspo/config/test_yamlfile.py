"""megatron_gspo.config.yamlfile: YAML errors with line and column, duplicate keys, `base:`
inheritance, mappings as overrides, the atomic write of the resolved config."""

import errno
import os
import textwrap

import pytest

from megatron_gspo.config.schema import RunConfig, load_config
from megatron_gspo.config.yamlfile import (atomic_write, deep_merge, load_yaml,
                                           mapping_to_overrides)
from megatron_gspo.errors import ConfigError, UserError


def test_yaml_errors_point_at_the_problem(tmp_path):
    """Guards `load_yaml`'s location: 1-based line:column of the problem (not of its context,
    e.g. the bracket a list opened at), and a duplicate key names the line of its first use."""
    path = os.path.join(tmp_path, "c.yaml")
    with open(path, "w") as f:
        f.write("seed: 1\nmodel:\n  preset: tiny\n  tp: 1\n  preset: small\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert str(e.value) == (f"{path}:5:3: invalid YAML: duplicate "
                            "key 'preset' (first at line 3)")
    with open(path, "w") as f:
        f.write("model:\n  preset: [tiny\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3:1: invalid YAML"):
        load_yaml(path)


def test_missing_file_names_it(tmp_path):
    path = os.path.join(tmp_path, "nope.yaml")
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(path)


def _files(tmp_path, files: dict) -> None:
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(tmp_path, name)), exist_ok=True)
        with open(os.path.join(tmp_path, name), "w") as f:
            f.write(textwrap.dedent(text))


def test_base_is_loaded_first_and_deep_merged(tmp_path):
    _files(tmp_path, {
        "common/root.yaml": """
            run_dir: runs/root
            task: {name: addition, kwargs: {num_digits: 3}, n_train: 10}
            loss: {name: grpo, eps_low: 0.2}
            train: {steps: 9}
            """,
        "common/mid.yaml": """
            base: root.yaml
            loss: {eps_high: 0.27}
            train: {steps: 7}
            """,
        "exp/arm.yaml": """
            base: ../common/mid.yaml
            run_dir: runs/arm
            task: {kwargs: {num_digits: 2}}
            """})
    cfg = load_config(os.path.join(tmp_path, "exp", "arm.yaml"), ["train.steps=5"])
    assert cfg.run_dir == "runs/arm" and cfg.task.n_train == 10
    assert cfg.task.kwargs == {"num_digits": 2}  # mappings merge (loss: three files)
    assert (cfg.loss.name, cfg.loss.eps_low, cfg.loss.eps_high) == ("grpo", 0.2, 0.27)
    assert cfg.train.steps == 5  # file beats base, override beats file
    assert load_config(os.path.join(tmp_path, "exp", "arm.yaml")).train.steps == 7


def test_base_replaces_lists_and_scalars():
    base = {"a": [1, 2], "b": {"c": 1, "d": [3]}, "e": {"f": 1}}
    top = {"a": [9], "b": {"d": [4, 5]}, "e": None}
    assert deep_merge(base, top) == {"a": [9], "b": {"c": 1, "d": [4, 5]}, "e": None}
    assert base == {"a": [1, 2], "b": {"c": 1, "d": [3]}, "e": {"f": 1}}  # not modified


def test_a_mapping_on_top_replaces_a_scalar_or_null_in_the_base():
    """Guards `deep_merge`: only mapping-on-mapping merges; a file section over a base's empty
    (null) or scalar value replaces it."""
    base = {"wandb": None, "seed": 3, "task": {"name": "addition", "n_train": 10}}
    top = {"wandb": {"mode": "disabled"}, "seed": {"x": 1}, "task": {"n_train": 5}}
    assert deep_merge(base, top) == {"wandb": {"mode": "disabled"}, "seed": {"x": 1},
                                     "task": {"name": "addition", "n_train": 5}}


def test_empty_file_and_empty_base_are_all_defaults(tmp_path):
    """A file with no keys (empty, or comments only) is the defaults, also as a base."""
    _files(tmp_path, {"empty.yaml": "# nothing set yet\n",
                      "exp.yaml": "base: empty.yaml\nseed: 3\n"})
    assert load_config(os.path.join(tmp_path, "empty.yaml")) == RunConfig()
    assert load_config(os.path.join(tmp_path, "exp.yaml")) == RunConfig(seed=3)


@pytest.mark.parametrize("files, match", [
    ({"exp.yaml": "base: b.yaml\n", "b.yaml": "base: exp.yaml\n"},
     r"config base cycle: .*exp.yaml -> .*b.yaml -> .*exp.yaml"),
    ({"exp.yaml": "base: exp.yaml\n"}, r"config base cycle: .*exp.yaml -> .*exp.yaml"),
    ({"exp.yaml": "base: gone.yaml\n"}, r"base config not found: .*gone.yaml \(the base of"),
    ({"exp.yaml": "base: [a.yaml]\n"}, r"exp.yaml: base=\['a.yaml'\]: expected the path"),
    ({"exp.yaml": "base: ''\n"}, r"exp.yaml: base='': expected the path"),
    ({"exp.yaml": "base: b.yaml\n", "b.yaml": "- 1\n"}, r"b.yaml: expected a mapping"),
    ({"exp.yaml": "base: b.yaml\n", "b.yaml": "train: {stepz: 1}\n"}, r"'train.stepz'"),
])
def test_bad_base_is_a_clear_error(tmp_path, files, match):
    _files(tmp_path, files)
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(tmp_path, "exp.yaml"))


def test_an_empty_mapping_in_an_overlay_is_an_override_of_its_own():
    """Guards `mapping_to_overrides`: `kwargs: {}` sets the key to an empty mapping (it clears
    the base's kwargs) instead of vanishing; nested keys become dotted ones, strings stay
    text and other values JSON."""
    overlay = {"task": {"kwargs": {}, "n_train": 5}, "loss": {"eps_high": None},
               "wandb.name": "2024", "data": {"train_files": ["a.jsonl"]}}
    out = mapping_to_overrides(overlay)
    assert out == ["task.kwargs={}", "task.n_train=5", "loss.eps_high=null", "wandb.name=2024",
                   'data.train_files=["a.jsonl"]']
    cfg = load_config(None, ["task.kwargs.num_digits=3", *out[:2]])
    assert cfg.task.kwargs == {} and cfg.task.n_train == 5


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    """Guards `atomic_write`: the new text replaces the file, with the umask's mode (not
    mkstemp's 0600); a write that fails (a full disk) is one UserError naming the file, and
    leaves the old file and no tmp file behind."""
    path = tmp_path / "c.yaml"
    atomic_write(str(path), "seed: 1\n")
    atomic_write(str(path), "seed: 2\n")
    assert path.read_text() == "seed: 2\n" and os.listdir(tmp_path) == ["c.yaml"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(UserError) as e:
        atomic_write(str(path), "seed: 3\n")
    assert str(e.value) == (f"cannot write {path}: No space left on device; files already "
                            "written are unchanged")
    assert path.read_text() == "seed: 2\n" and os.listdir(tmp_path) == ["c.yaml"]


def test_a_config_file_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path, capsys):
    """A config saved in Latin-1 (`café` in a comment), directly or as a `base:`, was a
    UnicodeDecodeError traceback from the CLI; now one line naming the file and the byte."""
    from megatron_gspo.cli import main

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("seed: 1\n# caf\u00e9\n".encode("latin-1"))
    top = tmp_path / "top.yaml"
    top.write_text("base: latin1.yaml\nseed: 2\n")
    for config in (latin1, top):
        assert main(["train", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"{latin1}: not UTF-8 text: byte 0xe9 at offset 13" in err, err
