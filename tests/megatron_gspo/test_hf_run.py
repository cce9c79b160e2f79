"""A run from model.hf_path: `setup_runtime` builds the tokenizer, the preset from config.json
(vocab padding) and the weights; a hub name, another model family, weights that disagree with
config.json, a layout config.json cannot split, or another model's run as init_checkpoint each
exit 2 with one line. The export back to a Hugging Face folder: `run/test_export.py`.
"""

import json
import os

import pytest
import torch

from megatron_gspo.cli import main as cli_main
from megatron_gspo.config.schema import load_config
from tests.hf_fixtures import load_hf
from tests.megatron_gspo.hf_runs import hf_dir, run_config, save_run  # noqa: F401 (a fixture)
from tests.megatron_gspo.sampling import encode_prompts


def test_runtime_builds_tokenizer_preset_and_weights_from_hf_path(single_process, hf_dir,
                                                                  tmp_path):
    from megatron_gspo.jobs import evaluate
    from megatron_gspo.run.setup import setup_runtime
    from megatron_gspo.tasks.tokenizer import HFTokenizer

    rt = setup_runtime(run_config(hf_dir, tmp_path / "run"), evaluate.SPEC)
    assert isinstance(rt.tokenizer, HFTokenizer) and rt.tokenizer.vocab_size == 300
    preset = rt.policy.preset
    assert (preset.name, preset.num_query_groups, preset.topk, preset.vocab_size) == \
        ("hf:qwen3_moe", 2, 3, 384)
    assert rt.policy.real_vocab == 300
    tokens_BT, valid_BT = encode_prompts(rt.tokenizer, ["12+30=", "7+5="])
    with torch.no_grad():
        ours = rt.policy.logits(tokens_BT, valid_BT)
        ref = load_hf(hf_dir)(tokens_BT, attention_mask=valid_BT.long()).logits
    assert (ours[..., :300] - ref)[valid_BT].abs().max() <= 1e-4
    # vocab_multiple is configurable
    cfg = run_config(hf_dir, tmp_path / "run2", "model.vocab_multiple=64")
    from megatron_gspo.run.setup import resolve_preset

    assert resolve_preset(cfg, 300).vocab_size == 320


def test_hub_name_is_a_clear_error(single_process, tmp_path):
    from megatron_gspo.jobs import evaluate
    from megatron_gspo.run.setup import setup_runtime

    with pytest.raises(FileNotFoundError, match="hub name"):
        setup_runtime(run_config("Qwen/Qwen3-30B-A3B", tmp_path / "run"), evaluate.SPEC)


def test_bad_hf_path_exits_2_before_the_run_dir_is_claimed(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", f"run_dir={run_dir}", "wandb.mode=disabled"]
    assert cli_main(argv + ["model.hf_path=Qwen/Qwen3-30B-A3B"]) == 2
    assert "hub name" in capsys.readouterr().err
    folder = tmp_path / "olmoe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "olmoe"}))
    assert cli_main(argv + [f"model.hf_path={folder}"]) == 2
    assert "model.hf_path=" in capsys.readouterr().err
    assert not run_dir.exists()


def test_weights_that_disagree_with_config_exit_2(single_process, hf_dir, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(hf_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors[
        "model.layers.0.self_attn.q_proj.weight"][:-16]  # one head short
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    argv = ["eval", f"model.hf_path={folder}", "task.n_eval=2", "wandb.mode=disabled"]
    assert cli_main(argv) == 2
    assert "q_proj" in capsys.readouterr().err


@pytest.mark.parametrize("layout,match", [
    (("model.ep=2",), "num_experts=5 is not divisible by ep=2"),
    (("model.tp=4", "model.sequence_parallel=true"),
     "num_query_groups=2 is not divisible by tp=4")])
def test_a_config_that_does_not_split_over_the_layout_exits_2(hf_dir, tmp_path, monkeypatch,
                                                              capsys, layout, match):
    """config.json's experts / KV heads that the layout cannot split: one line naming the value
    before the run dir is claimed (was a ValueError traceback from the model build on every
    rank). The layout's process groups are faked: only the checks before them run."""
    from types import SimpleNamespace

    from megatron_gspo.run import setup as runtime

    folder = tmp_path / "five_experts"
    folder.mkdir()
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": 5}))
    monkeypatch.setattr(runtime, "init_parallel", lambda *a, **k: SimpleNamespace(is_main=True))
    run_dir = tmp_path / "run"
    assert cli_main(["train", f"model.hf_path={folder}", f"run_dir={run_dir}", *layout]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"model.hf_path={folder}" in err[0] and match in err[0], err
    assert not run_dir.exists()


def test_init_from_another_models_run_names_its_hf_path(single_process, hf_dir, tmp_path):
    """A run started from model.hf_path recorded the default model.preset, which it ignored:
    the refusal names the folder it came from, not that preset."""
    from megatron_gspo.errors import ConfigError
    from megatron_gspo.run.setup import build_policy, load_init_weights

    cfg = run_config(hf_dir, tmp_path / "run")
    save_run(build_policy(cfg, 300, optim=None), cfg, cfg.run_dir)
    toy = build_policy(load_config(None, ["model.preset=tiny"]), 26, optim=None)
    with pytest.raises(ConfigError, match=f"holds model.hf_path={hf_dir}, this run builds "
                                          "'tiny'"):
        load_init_weights(toy, cfg.run_dir)
