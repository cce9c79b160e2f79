"""Hugging Face Qwen3-MoE / Qwen2-MoE checkpoints in and out (moe.hf).

Tiny random models are built locally from a config (tests/hf_fixtures.py) and compared with
transformers on the same tokens in float32: max abs logit diff <= 1e-4 in 1 process here, and for
TP=2 (+SP), EP=2 and TP2xEP2 on 2 gloo processes (tests/moe/hf_worker.py, which also checks what
each rank reads). The three models differ where a mapping can go wrong: GQA ratio 3 with
head_dim * heads != hidden, top-3 renormalised, a config vocab larger than the tokenizer
(`qwen3`); GQA 6 (one KV head), top-5 not renormalised, tied embeddings (`qwen3_mqa`); Qwen2-MoE's
sigmoid-gated shared expert, QKV bias, top-2 not renormalised, tied embeddings (`qwen2`).
"""

import json

import pytest
import torch

from moe.platform.parallel import free_port
from tests.hf_fixtures import load_hf, make_model
from tests.moe import hf_worker as hw
from tests.moe import parallel_worker as pw

MODELS = {
    "qwen3": ("qwen3_moe", {"vocab_size": 305}),
    "qwen3_mqa": ("qwen3_moe", {"num_key_value_heads": 1, "num_experts_per_tok": 5,
                                "norm_topk_prob": False, "tie_word_embeddings": True}),
    "qwen2": ("qwen2_moe", {}),
}
REAL_VOCAB = 300  # the fixture tokenizer's size


def batch(B: int = 4, T: int = 12, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, REAL_VOCAB, (B, T), generator=g)
    valid_BT = torch.ones(B, T, dtype=torch.bool)
    valid_BT[1, :3] = False  # left padding
    valid_BT[3, :5] = False
    return tokens_BT, valid_BT


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    dirs = {}
    for key, (family, overrides) in MODELS.items():
        folder = tmp_path_factory.mktemp(key)
        make_model(str(folder), family, **overrides)
        dirs[key] = str(folder)
    return dirs


def hf_logits(folder: str, tokens_BT, valid_BT):
    with torch.no_grad():
        return load_hf(folder)(tokens_BT, attention_mask=valid_BT.long()).logits.float()


@pytest.mark.parametrize("key", list(MODELS))
def test_logits_match_transformers(single_process, hf_dirs, key):
    tokens_BT, valid_BT = batch()
    policy, reader = hw.build_from_hf(hf_dirs[key], REAL_VOCAB)
    assert policy.preset.vocab_size == 384  # 300 or 305 padded to a multiple of 128
    with torch.no_grad():
        ours = policy.logits(tokens_BT, valid_BT)
    diff = hw.logit_diff(ours, hf_logits(hf_dirs[key], tokens_BT, valid_BT), valid_BT,
                         REAL_VOCAB)
    assert diff <= hw.TOL
    assert {r[1] for r in reader.reads} == {None}  # 1 process: every tensor whole, once
    assert len(reader.reads) == len(reader.names())


def test_a_wrong_mapping_is_caught(single_process, hf_dirs):
    """Not vacuous: swapping two experts' weights in our model moves the logits past 1e-4."""
    tokens_BT, valid_BT = batch()
    policy, _ = hw.build_from_hf(hf_dirs["qwen3"], REAL_VOCAB)
    fc2 = policy.model.module.decoder.layers[0].mlp.experts.linear_fc2.weight
    with torch.no_grad():
        fc2[[0, 1]] = fc2[[1, 0]]
        ours = policy.logits(tokens_BT, valid_BT)
    ref = hf_logits(hf_dirs["qwen3"], tokens_BT, valid_BT)
    assert hw.logit_diff(ours, ref, valid_BT, REAL_VOCAB) > 1e-2


@pytest.mark.slow
def test_two_process_layouts_match_transformers(hf_dirs, tmp_path):
    tokens_BT, valid_BT = batch()
    ref = {}
    for key in ("qwen3", "qwen2"):
        config = json.load(open(f"{hf_dirs[key]}/config.json"))
        ref[key] = {"dir": hf_dirs[key], "tokens": tokens_BT, "valid": valid_BT,
                    "hf_logits": hf_logits(hf_dirs[key], tokens_BT, valid_BT),
                    "real_vocab": REAL_VOCAB, "hf_vocab": config["vocab_size"]}
    path = tmp_path / "ref.pt"
    torch.save(ref, path)
    layouts = [("qwen3", 2, 1, True), ("qwen3", 1, 2, False), ("qwen3", 2, 2, True),
               ("qwen2", 2, 2, True)]
    pw.spawn(hw.worker, (2, free_port(), str(path), layouts), nprocs=2, timeout_s=600)
    results = [json.load(open(f"{path}.rank{r}.json")) for r in range(2)]
    for rank_results in results:
        assert len(rank_results) == len(layouts)
        for r in rank_results:
            print(f"{r['layout']}: max_abs_logit_diff={r['max_abs_logit_diff']:.2e} read "
                  f"{r['read_elements']}/{r['checkpoint_elements']} elements")
            assert r["max_abs_logit_diff"] <= hw.TOL
            # experts are not TP-split (expert TP = 1): with EP=2 a rank reads half of them
            share = 0.75 if "ep=2" in r["layout"] else 1.0
            assert r["read_elements"] < share * r["checkpoint_elements"], r


def _config(tmp_path, **changes):
    from tests.hf_fixtures import QWEN3

    cfg = {**QWEN3, "model_type": "qwen3_moe", "vocab_size": 300, **changes}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "olmoe"}, "model_type='olmoe' is not supported"),
    ({"mlp_only_layers": [0]}, "dense MLP layers"),
    ({"decoder_sparse_step": 2}, "dense MLP layers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE scaling"),  # older spelling
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "RoPE scaling"),  # transformers 5's spelling
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},  # a transformers 5 save
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},  # + Qwen's long-context recipe
     r"RoPE scaling rope_scaling=\{'rope_type': 'yarn'"),
    ({"num_experts": None}, "neither 'num_experts' nor 'num_local_experts'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config \\(quant_method='fp8'\\) is not supported"),
])
def test_unsupported_configs_are_refused_naming_the_key(tmp_path, changes, match):
    from moe.hf.config import preset_from_hf

    with pytest.raises(ValueError, match=match):
        preset_from_hf(_config(tmp_path, **changes))


def test_config_key_spellings_and_missing_files(tmp_path):
    from moe.hf.config import preset_from_hf

    folder = _config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg = json.load(open(f"{folder}/config.json"))
    cfg["num_local_experts"] = cfg.pop("num_experts")  # transformers 5's spelling
    cfg.pop("rope_theta")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    preset = preset_from_hf(folder)
    assert (preset.num_experts, preset.rotary_base, preset.kv_channels) == (8, 5e5, 16)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        preset_from_hf(str(tmp_path / ".."))
    with pytest.raises(FileNotFoundError, match="hub name"):
        preset_from_hf("Qwen/Qwen3-30B-A3B")


_OPTIONAL = ("head_dim", "rope_theta", "max_position_embeddings", "rms_norm_eps",
             "norm_topk_prob", "tie_word_embeddings", "qkv_bias")


def _family_config(model_type: str, drop: tuple = ()) -> dict:
    """The fixture config.json of `model_type` (tests/hf_fixtures.py) without keys `drop`."""
    from tests.hf_fixtures import QWEN2, QWEN3

    base = {"qwen3_moe": QWEN3, "qwen2_moe": QWEN2}[model_type]
    return {**{k: v for k, v in base.items() if k not in drop}, "model_type": model_type,
            "vocab_size": 300}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_missing_optional_keys_mean_what_transformers_makes_of_them(model_type):
    """A config.json without the optional keys builds the model transformers builds from it
    (its config class defaults; head_dim = hidden / heads as its attention computes it)."""
    from transformers import AutoConfig

    from moe.hf.config import preset_from_hf_config

    cfg = _family_config(model_type, drop=_OPTIONAL)
    preset = preset_from_hf_config(cfg)
    hf = AutoConfig.for_model(**cfg)
    assert preset.kv_channels == hf.hidden_size // hf.num_attention_heads
    assert (preset.max_seq_len, preset.norm_epsilon, preset.rotary_base) == \
        (hf.max_position_embeddings, hf.rms_norm_eps, hf.rope_parameters["rope_theta"])
    assert (preset.norm_topk_prob, preset.tie_word_embeddings) == \
        (hf.norm_topk_prob, hf.tie_word_embeddings)
    assert preset.qkv_bias == getattr(hf, "qkv_bias", False)
    assert preset.shared_expert_gate == (model_type == "qwen2_moe")  # only with a shared expert


def _qwen_preset(model_type: str):
    from moe.hf.config import preset_from_hf_config

    return preset_from_hf_config(_family_config(model_type))


def test_export_config_drops_stale_keys_of_the_source():
    """The exported config.json says the preset's values once: a source's num_local_experts,
    torch_dtype and rope_theta do not survive next to what was written."""
    import dataclasses

    from transformers import AutoConfig

    from moe.hf.config import hf_config_dict

    preset = dataclasses.replace(_qwen_preset("qwen3_moe"), rotary_base=5e5)
    base = {"num_local_experts": 4, "torch_dtype": "bfloat16", "rope_theta": 1e6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "bos_token_id": 7}
    out = hf_config_dict(preset, 300, dtype="bfloat16", base=base)
    assert "num_local_experts" not in out and "torch_dtype" not in out and "rope_theta" not in out
    assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    assert (out["dtype"], out["bos_token_id"], out["num_experts"]) == ("bfloat16", 7, 8)
    hf = AutoConfig.for_model(**out)
    assert (hf.num_experts, hf.rope_parameters["rope_theta"]) == (8, 5e5)


def test_export_config_refuses_presets_transformers_would_build_differently():
    """No exact config, no export: Qwen2-MoE ignores head_dim (it uses hidden / heads), and a
    Qwen3-MoE without q/k norms has no config.json spelling."""
    import dataclasses

    from moe.hf.config import hf_config_dict

    qwen2 = _qwen_preset("qwen2_moe")
    with pytest.raises(ValueError, match=r"qwen2_moe needs head_dim \* heads == hidden"):
        hf_config_dict(dataclasses.replace(qwen2, kv_channels=16), 300)
    qwen3 = dataclasses.replace(_qwen_preset("qwen3_moe"), qk_layernorm=False)
    with pytest.raises(ValueError, match="has no exact qwen3_moe config"):
        hf_config_dict(qwen3, 300)


def test_checkpoint_that_disagrees_with_its_config_is_refused(single_process, hf_dirs, tmp_path):
    """An extra tensor (a dense layer, a bias the config does not declare) has no place."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra"
    shutil.copytree(hf_dirs["qwen3"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no place.*o_proj.bias"):
        hw.build_from_hf(str(folder), REAL_VOCAB)
    del tensors["model.layers.0.self_attn.o_proj.bias"]
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match="experts.5.up_proj"):
        hw.build_from_hf(str(folder), REAL_VOCAB)
    # a whole tensor of another shape is named, not broadcast into the model's
    tensors = load_file(hf_dirs["qwen3"] + "/model.safetensors")
    gate = "model.layers.0.mlp.gate.weight"
    tensors[gate] = tensors[gate][:, :1].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"router.weight <- .*got shape \(8, 1\), the model "
                                         r"holds \(8, 64\)"):
        hw.build_from_hf(str(folder), REAL_VOCAB)


def test_tied_checkpoint_may_carry_its_lm_head(single_process, hf_dirs, tmp_path):
    """A tied-embedding checkpoint that also saved lm_head.weight (the embedding again) loads."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "tied"
    shutil.copytree(hf_dirs["qwen3_mqa"], folder)
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    policy, _ = hw.build_from_hf(str(folder), REAL_VOCAB)
    assert policy.preset.tie_word_embeddings


def test_qwen3_30b_a3b_preset_is_the_released_models_shape():
    """The preset equals what preset_from_hf makes of Qwen3-30B-A3B's config.json (the values
    of the released file; slime's scripts/models/qwen3-30B-A3B.sh has the same shape)."""
    import dataclasses

    from moe.hf.config import preset_from_hf_config
    from moe.model.presets import get_preset

    released = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
                "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
                "max_position_embeddings": 40960, "mlp_only_layers": [],
                "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
                "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
                "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
                "rope_theta": 1000000.0, "tie_word_embeddings": False,
                "use_sliding_window": False, "vocab_size": 151936}
    preset = preset_from_hf_config(released)
    assert dataclasses.replace(preset, name="qwen3-30b-a3b") == get_preset("qwen3-30b-a3b")
    assert preset.with_vocab(151936, 128 * 2).vocab_size == 152064  # 128 x TP=2 padding


def test_config_without_num_key_value_heads_is_refused(tmp_path):
    """transformers reads a missing num_key_value_heads as its config class default (4 for
    Qwen3-MoE, 16 for Qwen2-MoE), not as one KV head per query head: refused, not guessed."""
    from transformers import AutoConfig

    from moe.hf.config import preset_from_hf

    folder = _config(tmp_path)
    cfg = json.load(open(f"{folder}/config.json"))
    del cfg["num_key_value_heads"]
    assert AutoConfig.for_model(**cfg).num_key_value_heads == 4 != cfg["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json has no 'num_key_value_heads'"):
        preset_from_hf(folder)


def test_null_head_dim_fuses_qkv_with_hidden_over_heads():
    """A config whose head_dim is null (Qwen2-MoE's config class leaves it None in some
    transformers versions) fuses q/k/v with head_dim = hidden / heads, as transformers does."""
    from moe.hf.mapping import HFMapping

    mapping = HFMapping({**_family_config("qwen2_moe"), "head_dim": None})
    q, k, v = torch.randn(48, 48), torch.randn(16, 48), torch.randn(16, 48)  # 6 heads, 2 groups
    qkv = mapping.to_mcore("decoder.layers.0.self_attention.linear_qkv.weight", [q, k, v])
    assert torch.equal(qkv[:40], torch.cat([q[:24], k[:8], v[:8]]))  # group 0: 3 q heads, k, v
