"""`megatron-gspo export`: a run's checkpoint back to a Hugging Face folder.

The export writes sharded safetensors (a small shard limit forces an index), which transformers
loads with every tensor equal to the source, and whose greedy generation equals ours token for
token; the exported folder loads back into our model through the index. Toy runs export their
preset's shape; the dtype, the tokenizer the run trained with and tokens added past vocab_size
are kept; a non-empty target, a moved source or a damaged shard is one line.
"""

import json
import os

import pytest
import torch

from megatron_gspo.cli import main as cli_main
from megatron_gspo.config.schema import load_config
from megatron_gspo.run import checkpoint as ckpt
from tests.hf_fixtures import load_hf, make_model
from tests.megatron_gspo.hf_runs import hf_dir, one_line, run_config, save_run  # noqa: F401
from tests.megatron_gspo.sampling import sample


def test_export_round_trip_and_greedy_generation_match(single_process, hf_dir, tmp_path,
                                                        capsys):
    from megatron_gspo.run.setup import build_policy
    from megatron_gspo.tasks.tokenizer import load_tokenizer
    from moe.hf.io import INDEX, SafetensorsReader
    from moe.hf.weights import load_hf_weights

    cfg = run_config(hf_dir, tmp_path / "run")
    tok = load_tokenizer(hf_dir)
    policy = build_policy(cfg, tok.vocab_size, optim=None)
    save_run(policy, cfg, cfg.run_dir)
    out = str(tmp_path / "export")
    assert cli_main(["export", "--run-dir", cfg.run_dir, "--to-hf", out,
                     "--max-shard-bytes", "60000"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["tokenizer"] and summary["model_type"] == "qwen3_moe"
    assert os.path.isfile(os.path.join(out, INDEX)) and len(
        [f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= \
        set(os.listdir(out))
    # every tensor exactly the source's
    src, dst = SafetensorsReader(hf_dir), SafetensorsReader(out)
    assert src.names() == dst.names()
    assert all(torch.equal(src.read(n), dst.read(n)) for n in src.names())
    # transformers loads it; greedy generation equals ours token for token
    hf = load_hf(out)
    assert json.load(open(os.path.join(out, "config.json")))["vocab_size"] == 300
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
               for q in ("12+30=?", "what is 7 plus 5?", "hi")]
    tokens_BT, _, response_BT, _, _ = sample(policy, tok, prompts, max_new_tokens=10,
                                             greedy=True)
    for b, prompt in enumerate(prompts):
        ids = torch.tensor([tok.encode(prompt)])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                           do_sample=False, eos_token_id=sorted(tok.stop_ids),
                           pad_token_id=tok.pad_id)[0, ids.shape[1]:].tolist()
        got = tokens_BT[b][response_BT[b]].tolist()
        assert got == want, (prompt, got, want)
    # and the exported folder (an index and shards) loads back into our model unchanged
    before = {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}
    load_hf_weights(policy.model.module, out)
    for n, p in policy.model.module.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("layers", [None, 3, "e4k3"], ids=["preset", "num_layers", "overrides"])
def test_export_of_a_toy_run_is_a_qwen3_moe_model(single_process, tmp_path, capsys, layers):
    """A run without hf_path exports its preset's shape (no tokenizer files); with
    model.num_layers, at that depth; with model.preset_overrides, that architecture."""
    from megatron_gspo.run.setup import build_policy

    arch = {"e4k3": ["model.preset_overrides={num_experts: 4, topk: 3}"],
            3: ["model.num_layers=3"], None: []}[layers]
    cfg = load_config(None, [f"run_dir={tmp_path / 'toy'}", "model.preset=tiny", *arch])
    policy = build_policy(cfg, 26, optim=None)
    layers = layers if layers != "e4k3" else None
    assert policy.preset.num_layers == (layers or 2)
    if arch and not layers:
        assert (policy.preset.num_experts, policy.preset.topk) == (4, 3)
    save_run(policy, cfg, cfg.run_dir)
    out = str(tmp_path / "toy_hf")
    assert cli_main(["export", "--run-dir", cfg.run_dir, "--to-hf", out]) == 0
    assert not json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokenizer"]
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == (layers or 2)
    tokens_BT = torch.randint(0, 26, (2, 9), generator=torch.Generator().manual_seed(0))
    valid_BT = torch.ones_like(tokens_BT, dtype=torch.bool)
    with torch.no_grad():
        ours = policy.logits(tokens_BT, valid_BT)[..., :26]
        ref = load_hf(out)(tokens_BT).logits[..., :26]
    assert (ours - ref).abs().max() <= 1e-4


def test_export_errors_name_the_problem(tmp_path, capsys):
    assert cli_main(["export", "--run-dir", str(tmp_path / "missing"), "--to-hf", "x"]) == 2
    assert "missing' does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        cli_main(["export", "--to-hf", "x"])
    assert err.value.code == 2


def test_export_reads_a_moved_source_folder_and_writes_its_own_config(single_process, hf_dir,
                                                                      tmp_path):
    """`hf_path` overrides the run's model.hf_path (the source moved); the export writes its own
    config.json and weights (never the source's copies) and refuses a source config whose
    vocabulary is larger than the checkpoint's embedding."""
    import shutil

    from megatron_gspo.run.export import export_run
    from megatron_gspo.run.setup import build_policy
    from moe.hf.io import SafetensorsReader

    moved, src = tmp_path / "moved", tmp_path / "src"
    shutil.copytree(hf_dir, moved)
    cfg = run_config(str(moved), tmp_path / "run")
    save_run(build_policy(cfg, 300, optim=None), cfg, cfg.run_dir)
    moved.rename(src)
    config = json.load(open(src / "config.json"))
    assert "num_local_experts" in config  # transformers 5's spelling; the export writes ours
    with pytest.raises(FileNotFoundError, match="model.hf_path=.*moved, which does not exist "
                                                "now: pass --hf-path"):
        export_run(cfg.run_dir, str(tmp_path / "out0"))
    out = tmp_path / "out"
    summary = export_run(cfg.run_dir, str(out), hf_path=str(src), max_shard_bytes=60000)
    written = json.load(open(out / "config.json"))
    assert written["num_experts"] == 8 and "num_local_experts" not in written
    assert "model.safetensors" not in os.listdir(out) and summary["files"].count(
        "config.json") == 1
    reader, want = SafetensorsReader(str(out)), SafetensorsReader(str(src))
    assert all(torch.equal(reader.read(n), want.read(n)) for n in want.names())
    other = tmp_path / "other"  # another model's folder: one line, no traceback
    make_model(str(other), "qwen2_moe")
    dist_run = tmp_path / "dist_run"
    save_run(build_policy(run_config(str(src), dist_run), 300, optim=None),
             run_config(str(src), dist_run), str(dist_run))
    with pytest.raises(ValueError, match=f"its checkpoint is not the model of {other}: .*"
                                         "shape mismatch"):
        export_run(str(dist_run), str(tmp_path / "out1"), hf_path=str(other))
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(ValueError, match="vocab_size=1000 exceeds the checkpoint's 384 "
                                         "embedding rows"):
        export_run(cfg.run_dir, str(tmp_path / "out2"), hf_path=str(big))


def test_export_keeps_the_parameter_dtype(single_process, tmp_path):
    """bfloat16 parameters export as bfloat16 tensors, and config.json says so."""
    from megatron_gspo.run.setup import build_policy
    from moe.hf.config import hf_config_dict
    from moe.hf.io import SafetensorsReader
    from moe.hf.weights import export_hf
    from moe.model.sharding import gather_full_params

    cfg = load_config(None, [f"run_dir={tmp_path / 'toy'}", "model.preset=tiny"])
    policy = build_policy(cfg, 26, optim=None)
    full = {n: p.to(torch.bfloat16) for n, p in gather_full_params(policy.model.module).items()}
    export_hf(full, str(tmp_path / "out"), hf_config_dict(policy.preset, 26))
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == "bfloat16"
    reader = SafetensorsReader(str(tmp_path / "out"))
    assert {reader.read(n).dtype for n in reader.names()} == {torch.bfloat16}


def test_export_never_writes_into_a_non_empty_folder(single_process, hf_dir, tmp_path, capsys):
    """The source folder itself (its weights would be overwritten, then the tokenizer copy
    crashed), a previous export (a stale model.safetensors next to new shards is what
    transformers loads) or a file: exit 2, one line, every file as it was; so is an output
    path that cannot be created (was an OSError traceback)."""
    import shutil

    from megatron_gspo.run.setup import build_policy

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    cfg = run_config(str(src), tmp_path / "run")
    save_run(build_policy(cfg, 300, optim=None), cfg, cfg.run_dir)
    out = tmp_path / "out"
    assert cli_main(["export", "--run-dir", cfg.run_dir, "--to-hf", str(out)]) == 0
    (tmp_path / "file").write_text("x")
    for target in (src, out, tmp_path / "file"):
        before = {p.name: p.read_bytes() for p in target.iterdir()} if target.is_dir() else None
        capsys.readouterr()
        assert cli_main(["export", "--run-dir", cfg.run_dir, "--to-hf", str(target),
                         "--max-shard-bytes", "60000"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--to-hf '{target}' exists" in err[0], err
        if before is not None:
            assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    err = one_line(capsys, ["export", "--run-dir", cfg.run_dir, "--to-hf",
                            str(tmp_path / "file" / "out")])  # not writable: one line too
    assert "Not a directory" in err and str(tmp_path / "file" / "out") in err
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert cli_main(["export", "--run-dir", cfg.run_dir, "--to-hf", str(tmp_path / "empty")]) == 0


def test_a_bf16_run_exports_bf16_tensors(single_process, hf_dir, tmp_path):
    """model.dtype=bf16: the checkpoint's weights are bf16 values, which the 1-process reader
    holds as float32; the export writes them as bf16 (half the bytes, config.json says
    bfloat16, values unchanged) instead of float32."""
    from megatron_gspo.run.export import export_run
    from megatron_gspo.run.setup import build_policy
    from moe.hf.io import SafetensorsReader
    from moe.model.sharding import gather_full_params

    cfg = run_config(hf_dir, tmp_path / "run", "model.dtype=bf16")
    policy = build_policy(cfg, 300, optim=None)
    save_run(policy, cfg, cfg.run_dir)
    export_run(cfg.run_dir, str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == "bfloat16"
    reader = SafetensorsReader(str(tmp_path / "out"))
    assert {reader.read(n).dtype for n in reader.names()} == {torch.bfloat16}
    ours = gather_full_params(policy.model.module)["embedding.word_embeddings.weight"]
    assert ours.dtype == torch.bfloat16
    assert torch.equal(reader.read("model.embed_tokens.weight"), ours[:300])


def test_tokens_added_past_vocab_size_keep_their_rows(single_process, hf_dir, tmp_path):
    """A tokenizer with tokens added past config.json's vocab_size (300 + 2 tool tokens): the
    run trains rows for them, and the export keeps them (vocab_size 302), so transformers
    embeds the tokens its tokenizer gives (config.json's 300 rows were an IndexError)."""
    import shutil

    from transformers import AutoTokenizer

    from megatron_gspo.run.export import export_run
    from megatron_gspo.run.setup import build_policy

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    tok.save_pretrained(str(src))
    cfg = run_config(str(src), tmp_path / "run")
    save_run(build_policy(cfg, 302, optim=None), cfg, cfg.run_dir)
    out = tmp_path / "out"
    export_run(cfg.run_dir, str(out))
    assert json.load(open(out / "config.json"))["vocab_size"] == 302
    ids = AutoTokenizer.from_pretrained(str(out))("<tool_call>7", return_tensors="pt").input_ids
    assert ids.max() >= 300
    assert load_hf(str(out))(ids).logits.shape == (1, ids.shape[1], 302)


def test_export_writes_the_tokenizer_the_run_trained_with(single_process, hf_dir, tmp_path,
                                                          capsys):
    """data.tokenizer_path's files (not the data files beside them) go into the export: a toy
    run with a BPE tokenizer had none, and an hf run with tokens added through its own
    tokenizer folder exported the source's tokenizer, without them."""
    import shutil

    from transformers import AutoTokenizer

    from megatron_gspo.run.export import export_run
    from megatron_gspo.run.setup import build_policy

    gsm = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny")
    cfg = load_config(None, [f"run_dir={tmp_path / 'toy'}", "model.preset=tiny",
                             f"data.tokenizer_path={gsm}"])
    save_run(build_policy(cfg, 512, optim=None), cfg, cfg.run_dir)
    summary = export_run(cfg.run_dir, str(tmp_path / "toy_hf"))
    assert summary["tokenizer"] and "train.jsonl" not in os.listdir(tmp_path / "toy_hf")
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "toy_hf"))) == 512

    tok_dir = tmp_path / "tok"
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    tok.save_pretrained(str(tok_dir))
    cfg = run_config(hf_dir, tmp_path / "run", f"data.tokenizer_path={tok_dir}")
    save_run(build_policy(cfg, 302, optim=None), cfg, cfg.run_dir)
    export_run(cfg.run_dir, str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["vocab_size"] == 302
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "out"))) == 302
    shutil.rmtree(tok_dir)  # gone since (or relative to another working directory)
    assert export_run(cfg.run_dir, str(tmp_path / "out2"))["tokenizer"]  # the model folder's
    assert f"data.tokenizer_path={tok_dir}, which does not exist here: exporting the " \
        f"tokenizer of {hf_dir}" in capsys.readouterr().err
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "out2"))) == 300


def test_export_verifies_the_shard_checksums(single_process, tmp_path, capsys):
    """A flipped byte in a policy shard is one line naming the file (the export read it and
    wrote the damaged weights); a resume already checked them."""
    from megatron_gspo.run.setup import build_policy

    cfg = load_config(None, [f"run_dir={tmp_path / 'toy'}", "model.preset=tiny"])
    save_run(build_policy(cfg, 26, optim=None), cfg, cfg.run_dir)
    dist = os.path.join(ckpt.step_dir(os.path.join(cfg.run_dir, "checkpoints"), 3), "dist")
    shards = sorted(n for n in os.listdir(dist) if n.endswith(".distcp"))
    for name in os.listdir(dist):
        ckpt.write_checksum(os.path.join(dist, name))
    with open(os.path.join(dist, shards[0]), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli_main(["export", "--run-dir", cfg.run_dir, "--to-hf", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and shards[0] in err[0], err
    assert not os.path.exists(tmp_path / "o" / "config.json")


def test_a_checkpoint_without_dist_is_one_line_for_export_and_init(single_process, tmp_path,
                                                                  capsys):
    """A step dir whose policy is not a dist checkpoint (the format before dist checkpoints kept
    it in the rank files) is named in one line by export and by init_checkpoint."""
    from megatron_gspo.config.schema import config_to_dict
    from megatron_gspo.errors import ConfigError
    from megatron_gspo.run.init import load_init_weights
    from megatron_gspo.run.setup import build_policy

    cfg = load_config(None, [f"run_dir={tmp_path / 'old'}", "model.preset=tiny"])
    root = os.path.join(cfg.run_dir, "checkpoints")
    ckpt.save_checkpoint(root, 3, {"config": config_to_dict(cfg), "full_params": {}})
    ckpt.mark_latest(root, 3)
    line = one_line(capsys, ["export", "--run-dir", cfg.run_dir, "--to-hf",
                             str(tmp_path / "out")])
    assert "step_000003 has no dist/ checkpoint" in line
    with pytest.raises(ConfigError, match="step_000003 has no dist/ checkpoint"):
        load_init_weights(build_policy(cfg, 26, optim=None), cfg.run_dir)
