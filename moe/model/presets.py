"""Named MoE model presets.

A preset is the architecture only (no parallelism, no dtype): one frozen dataclass that
`moe.model.gpt` turns into a megatron-core `TransformerConfig`. Qwen3-MoE conventions throughout:
RMSNorm, QK-norm, SwiGLU experts, RoPE, softmax top-k routing whose top-k probabilities are
renormalised (softmax over the selected logits, megatron's `moe_router_pre_softmax=False`),
no shared expert, untied embeddings, every layer MoE.

Models read from a Hugging Face config.json (`moe.hf.preset_from_hf`) are presets too; the fields
after `qk_layernorm` carry what other families differ in (Qwen2-MoE: QKV bias, a sigmoid-gated
shared expert, top-k probabilities not renormalised) and default to the Qwen3-MoE conventions.

`qwen3-30b-a3b` follows the released Qwen3-30B-A3B config (48 layers, hidden 2048, 32 query
heads / 4 KV heads of dim 128, 128 experts top-8, expert FFN 768, vocab 151936, RoPE theta 1e6).
`qwen3-moe-tiny` keeps that structure (GQA, QK-norm, many experts, top-k > 2) scaled down so
RL runs on a 2-core CPU in minutes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe.platform.checks import is_int


@dataclass(frozen=True)
class MoEPreset:
    """Architecture of a Qwen3-style MoE decoder."""

    name: str
    """Registry name of the preset."""
    num_layers: int
    """Transformer layers; every one has an MoE MLP."""
    hidden_size: int
    """Residual stream width."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); must divide num_attention_heads."""
    kv_channels: int
    """Per-head dimension (Qwen3 decouples it from hidden_size / heads)."""
    num_experts: int
    """Routed experts per layer (E)."""
    topk: int
    """Experts activated per token (K)."""
    moe_ffn_hidden_size: int
    """Hidden size of each expert's SwiGLU MLP."""
    vocab_size: int
    """Vocabulary size; tasks with a smaller tokenizer override it (see `with_vocab`)."""
    max_seq_len: int
    """Maximum positions the model is built for."""
    rotary_base: float = 1_000_000.0
    """RoPE theta."""
    norm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    qk_layernorm: bool = True
    """Qwen3's per-head RMSNorm on queries and keys."""
    qkv_bias: bool = False
    """Bias on the query/key/value projections (Qwen2-MoE); the output projection has none."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE's norm_topk_prob). False
    keeps the softmax over all experts (megatron's `moe_router_pre_softmax=True`). At topk 1 it
    is a hard gate: weight 1, no gradient from the loss to the router (`moe.model.gpt`)."""
    shared_expert_ffn_hidden_size: int = 0
    """Hidden size of the always-on shared expert (Qwen2-MoE); 0 = none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w) (Qwen2-MoE's shared_expert_gate)."""
    tie_word_embeddings: bool = False
    """Output layer shares the input embedding matrix."""
    hf_model_type: str = "qwen3_moe"
    """The Hugging Face `model_type` whose layout this preset follows (for export)."""

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "num_experts", "topk", "moe_ffn_hidden_size", "vocab_size",
                    "max_seq_len")
        for field in positive:
            value = getattr(self, field)
            if not is_int(value) or value <= 0:
                raise ValueError(f"preset {self.name!r}: {field}={value!r} must be a positive int")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"preset {self.name!r}: num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of num_query_groups={self.num_query_groups}")
        if self.topk > self.num_experts:
            raise ValueError(
                f"preset {self.name!r}: topk={self.topk} exceeds num_experts={self.num_experts}")
        if not is_int(self.shared_expert_ffn_hidden_size) or \
                self.shared_expert_ffn_hidden_size < 0:
            raise ValueError(f"preset {self.name!r}: shared_expert_ffn_hidden_size="
                             f"{self.shared_expert_ffn_hidden_size!r} must be an int >= 0")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ValueError(f"preset {self.name!r}: shared_expert_gate needs a shared expert")
        if self.rotary_base <= 0 or self.norm_epsilon <= 0:
            raise ValueError(f"preset {self.name!r}: rotary_base and norm_epsilon must be > 0")

    def with_overrides(self, overrides: dict) -> "MoEPreset":
        """The same preset with some architecture fields replaced (`model.preset_overrides`),
        validated as any preset; ValueError naming an unknown or fixed field. The vocabulary
        comes from the tokenizer and the positions from model.max_seq_len, not from here."""
        fixed = {"name", "vocab_size", "max_seq_len", "hf_model_type"}
        known = {f.name for f in dataclasses.fields(self)} - fixed
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"{key!r} is not an architecture field of a preset; valid: "
                                 f"{', '.join(sorted(known))}")
            want = type(getattr(self, key))
            if want is bool and not isinstance(value, bool) or want is float and (
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{key}={value!r} must be a {want.__name__}")
        return dataclasses.replace(self, **overrides) if overrides else self

    def with_vocab(self, vocab_size: int, multiple: int = 16) -> "MoEPreset":
        """Same architecture with the vocabulary resized (rounded up to `multiple`)."""
        padded = -(-vocab_size // multiple) * multiple
        return dataclasses.replace(self, vocab_size=padded)

    def check_parallel(self, tp: int, ep: int) -> None:
        """Raise a ValueError naming the value if this preset cannot be split tp x ep ways."""
        for key, (axis, n) in (("num_experts", ("ep", ep)), ("num_query_groups", ("tp", tp)),
                               ("vocab_size", ("tp", tp)), ("moe_ffn_hidden_size", ("tp", tp)),
                               ("shared_expert_ffn_hidden_size", ("tp", tp))):
            if getattr(self, key) % n:
                raise ValueError(f"preset {self.name!r}: {key}={getattr(self, key)} is not "
                                 f"divisible by {axis}={n}")

    def num_params(self) -> dict[str, int]:
        """Analytic parameter counts: total and activated per token (embeddings included)."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_query_groups
        d = self.kv_channels
        attn = h * d * (q + 2 * kv) + q * d * h + (2 * d if self.qk_layernorm else 0) \
            + (d * (q + 2 * kv) if self.qkv_bias else 0)
        expert = 3 * h * self.moe_ffn_hidden_size
        router = h * self.num_experts
        norms = 2 * h
        shared = 3 * h * self.shared_expert_ffn_hidden_size + (h if self.shared_expert_gate else 0)
        per_layer_total = attn + router + norms + shared + self.num_experts * expert
        per_layer_active = attn + router + norms + shared + self.topk * expert
        # input (and, untied, output) embeddings + final norm
        emb = (1 if self.tie_word_embeddings else 2) * self.vocab_size * h + h
        return {"total": self.num_layers * per_layer_total + emb,
                "active": self.num_layers * per_layer_active + emb}

    def flops_per_token(self, context: int) -> int:
        """Matmul FLOPs of one token's forward pass that attends to `context` keys: the
        projections, router, top-k (and shared) experts and output layer (2 per multiply-add
        of the activated weights), plus QK^T and AV over the context (4 q d per key). Training
        is 3x (backward = 2 forwards), the usual MFU accounting (Megatron-LM, PaLM); norms,
        activations and softmax are not counted. A full-sequence forward of T tokens attends
        to T keys per token as the kernels compute it (the causal mask hides, not skips);
        a KV-cache step to the cached length."""
        h, q, kv, d = self.hidden_size, self.num_attention_heads, self.num_query_groups, \
            self.kv_channels
        per_layer = (2 * h * d * (q + 2 * kv) + 2 * q * d * h + 2 * h * self.num_experts
                     + self.topk * 6 * h * self.moe_ffn_hidden_size
                     + 6 * h * self.shared_expert_ffn_hidden_size
                     + (2 * h if self.shared_expert_gate else 0) + 4 * q * d * context)
        return self.num_layers * per_layer + 2 * h * self.vocab_size


# Qwen3-30B-A3B structure scaled down: the CPU RL experiments' policy.
_QWEN3_MOE_TINY = MoEPreset(name="qwen3-moe-tiny", num_layers=4, hidden_size=64,
                            num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            num_experts=16, topk=4, moe_ffn_hidden_size=64, vocab_size=64,
                            max_seq_len=64)

_QWEN3_MOE_TINY_HD32 = dataclasses.replace(_QWEN3_MOE_TINY, name="qwen3-moe-tiny-hd32",
                                           num_attention_heads=2, num_query_groups=1,
                                           kv_channels=32)

PRESETS: dict[str, MoEPreset] = {
    p.name: p
    for p in (
        # CPU, seconds per step: for unit tests and parallel-equivalence checks.
        MoEPreset(name="tiny", num_layers=2, hidden_size=32, num_attention_heads=4,
                  num_query_groups=2, kv_channels=8, num_experts=8, topk=2,
                  moe_ffn_hidden_size=32, vocab_size=64, max_seq_len=64, rotary_base=10000.0),
        _QWEN3_MOE_TINY,
        # The same layer, 12 deep: flip rate vs depth (experiments/routing_volatility).
        dataclasses.replace(_QWEN3_MOE_TINY, name="qwen3-moe-tiny-deep", num_layers=12),
        # More, narrower experts per token budget, 12 deep (a regime of volatile routing:
        # experiments/replay_dose_response measures its cost).
        dataclasses.replace(_QWEN3_MOE_TINY, name="qwen3-moe-tiny-wide", num_layers=12,
                            num_experts=64, moe_ffn_hidden_size=32),
        # The tiny layer with head_dim 32 (2 query heads / 1 KV head; same attention parameter
        # count): vLLM's CPU attention needs head_dim in {32, 64, ...}, so rollout.backend=vllm
        # runs on CPU (experiments/engine_mismatch, bench/throughput.py --with-vllm).
        _QWEN3_MOE_TINY_HD32,
        # ... 12 deep with 64 narrower experts (qwen3-moe-tiny-wide's MoE layer, head_dim 32).
        dataclasses.replace(_QWEN3_MOE_TINY_HD32, name="qwen3-moe-tiny-hd32-wide", num_layers=12,
                            num_experts=64, moe_ffn_hidden_size=32),
        # One GPU.
        MoEPreset(name="small", num_layers=12, hidden_size=512, num_attention_heads=8,
                  num_query_groups=4, kv_channels=64, num_experts=64, topk=8,
                  moe_ffn_hidden_size=256, vocab_size=32000, max_seq_len=2048),
        MoEPreset(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_attention_heads=32,
                  num_query_groups=4, kv_channels=128, num_experts=128, topk=8,
                  moe_ffn_hidden_size=768, vocab_size=151936, max_seq_len=40960),
    )
}


def get_preset(name: str) -> MoEPreset:
    """Look a preset up by name; KeyError listing the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}") from None
