"""Tiny Hugging Face model folders built locally (nothing is downloaded).

`make_tokenizer(dir)` trains a byte-level BPE (the `tokenizers` library, well under a second) and
saves it with transformers' `PreTrainedTokenizerFast` and a Qwen-like chat template: `<|im_end|>`
ends a turn and is the EOS, `<|endoftext|>` pads, there is no BOS (as in Qwen).
`make_model(dir, family, **config)` saves a seeded random Qwen3-MoE or Qwen2-MoE in safetensors
next to it. Weights are re-drawn wider than transformers' init (std 0.2, norm gains in [0.5, 1.5])
so routing is decisive and a wrong expert or a wrong slice moves the logits visibly.
"""

from __future__ import annotations

import torch

from tools.make_fixtures import SPECIAL as SPECIALS, train_tokenizer
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [f"{a}+{b}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)] + [
    "the user asks the assistant a question about numbers and the assistant answers",
    "system: you are a helpful assistant. user: what is 12 plus 30? assistant: 42",
] * 4

QWEN3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
             intermediate_size=128, norm_topk_prob=True, rope_theta=1e6,
             max_position_embeddings=128, rms_norm_eps=1e-6)
QWEN2 = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
             shared_expert_intermediate_size=40, intermediate_size=96, norm_topk_prob=False,
             tie_word_embeddings=True, max_position_embeddings=128, rms_norm_eps=1e-5)


def make_tokenizer(folder: str, vocab_size: int = 300) -> int:
    """Save a BPE tokenizer with a chat template to `folder`; returns its size (len)."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(CORPUS, vocab_size, special_tokens=SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)
    return len(fast)


def make_model(folder: str, family: str = "qwen3_moe", vocab_size: int | None = None,
               seed: int = 0, tokenizer: bool = True, **overrides) -> dict:
    """Save tokenizer + a random model of `family` to `folder`; returns its config dict."""
    from transformers import (Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    n_tok = make_tokenizer(folder) if tokenizer else None
    config_cls, model_cls, base = {
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, QWEN2)}[family]
    kwargs = dict(base, vocab_size=vocab_size or n_tok, eos_token_id=None, **overrides)
    if n_tok is not None:  # the template's end of turn, as Qwen's generation_config has it
        kwargs["eos_token_id"] = SPECIALS.index("<|im_end|>")
        kwargs["pad_token_id"] = SPECIALS.index("<|endoftext|>")
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return config.to_dict()


def load_hf(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
