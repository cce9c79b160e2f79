"""TRL's side of `bench.throughput`: GRPOTrainer (GSPO settings) on a Qwen3-MoE of our
preset's shape, with a character tokenizer of our ids, timed per generation batch.

Needs `pip install trl transformers accelerate datasets` (the `[bench]` extra); nothing is
downloaded (random-init model, tokenizer built in memory).
"""

from __future__ import annotations

import time

import torch

from megatron_gspo.tasks.toy import CharTokenizer

_set_num_threads = torch.set_num_threads
"""torch's own: an in-process vLLM engine (bench.throughput --with-vllm) makes
`torch.set_num_threads` a no-op for the whole process."""


def hf_tokenizer(vocab_size: int):
    """`PreTrainedTokenizerFast` with CharTokenizer's ids (<bos> prepended), padded to
    `vocab_size` with unused tokens so every id the model can emit decodes."""
    # optional dependencies (the [bench] extra): only TRL's side needs them
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ct = CharTokenizer()
    vocab = {"<pad>": ct.pad_id, "<bos>": ct.bos_id, "<eos>": ct.eos_id}
    vocab.update({ch: ct.encode(ch)[0] for ch in ct.chars})
    vocab.update({f"<unused{i}>": i for i in range(ct.vocab_size, vocab_size)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                      special_tokens=[("<bos>", ct.bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", padding_side="left")
    for text in ("12+34=", "c:3,5>8="):
        if tok(text)["input_ids"] != [ct.bos_id] + ct.encode(text):
            raise RuntimeError(f"HF tokenizer disagrees with CharTokenizer on {text!r}")
    return tok


def hf_model(preset, experts_impl: str | None):
    """Random-init Qwen3MoeForCausalLM with the preset's exact shape."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # optional dependency (the [bench] extra)

    extra = {"experts_implementation": experts_impl} if experts_impl else {}
    cfg = Qwen3MoeConfig(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.moe_ffn_hidden_size, num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_query_groups, head_dim=preset.kv_channels,
        num_experts=preset.num_experts, num_experts_per_tok=preset.topk,
        moe_intermediate_size=preset.moe_ffn_hidden_size, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        rope_theta=preset.rotary_base, max_position_embeddings=preset.max_seq_len,
        rms_norm_eps=preset.norm_epsilon, router_aux_loss_coef=0.0,
        output_router_logits=False, **extra)
    model = Qwen3MoeForCausalLM(cfg)
    n_hf, n_ours = sum(p.numel() for p in model.parameters()), preset.num_params()["total"]
    if n_hf != n_ours:
        raise RuntimeError(f"HF Qwen3-MoE has {n_hf} parameters, {preset.name} has {n_ours}")
    return model


def timed_trainer_class():
    from trl import GRPOTrainer  # optional dependency (the [bench] extra): the base class

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that records per-generation-batch timings and token counts."""

        bench_records: list

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            self.bench_records[-1]["rollout_s"] += time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            self.bench_records.append({"rollout_s": 0.0, "score_s": 0.0, "steps_s": 0.0})
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            rec = self.bench_records[-1]
            rec["score_s"] = time.perf_counter() - t0
            rec["rollout_tokens"] = float(out["completion_mask"].sum())
            rec["train_tokens"] = float(out["prompt_mask"].sum()) + rec["rollout_tokens"]
            return out

    return TimedGRPOTrainer


def step_timer_callback(threads: int, steps_per_gen: int, between_batches):
    """Times on_step_begin -> on_step_end; at each generation boundary first calls
    `between_batches()` (our iteration), outside TRL's timed section."""
    from transformers import TrainerCallback  # optional dependency (the [bench] extra): the base class

    class StepTimer(TrainerCallback):
        trainer = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % steps_per_gen == 0:
                between_batches()
            _set_num_threads(threads)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.trainer.bench_records[-1]["steps_s"] += time.perf_counter() - self.t0

    return StepTimer()


def build_trl(args, preset, train_set, task, total_iters: int, out_dir: str, callback,
              rollout_func=None, reward=None):
    """TRL GRPOTrainer (GSPO settings) on the same prompts, model shape and batch split.
    `rollout_func`: TRL's hook returning the generation batch's prompt and completion ids in
    place of `model.generate` (`bench.packing`: fixed lengths), with its `reward`."""
    # optional dependencies (the [bench] extra): only TRL's side needs them
    from datasets import Dataset
    from trl import GRPOConfig

    B = args.prompts * args.group_size

    def task_reward(completions, idx, **_):
        return [task.reward(train_set[i], c) for i, c in zip(idx, completions)]

    data = Dataset.from_list([{"prompt": ex.prompt, "idx": i} for i, ex in enumerate(train_set)])
    tok = hf_tokenizer(preset.vocab_size)
    unused = list(range(CharTokenizer().vocab_size, preset.vocab_size))
    if args.force_length:
        unused.append(CharTokenizer().eos_id)
    config = GRPOConfig(
        output_dir=out_dir, importance_sampling_level="sequence", loss_type="grpo", beta=0.0,
        epsilon=3e-4, epsilon_high=4e-4,  # GSPO paper sec. 5.1, as our loss.name=gspo
        num_generations=args.group_size, per_device_train_batch_size=B // args.minibatches,
        gradient_accumulation_steps=1, steps_per_generation=args.minibatches, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"suppress_tokens": unused} if unused else None,  # = our vocab mask
        use_vllm=False, gradient_checkpointing=False, bf16=False, fp16=False,
        use_cpu=not torch.cuda.is_available(), learning_rate=1e-4, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch", weight_decay=0.0,
        max_steps=total_iters * args.minibatches, logging_steps=1, report_to="none",
        eval_strategy="no", save_strategy="no", disable_tqdm=True, seed=args.seed,
        dataloader_num_workers=0, log_completions=False)
    trainer = timed_trainer_class()(
        model=hf_model(preset, args.hf_experts), reward_funcs=reward or task_reward, args=config,
        train_dataset=data, processing_class=tok, callbacks=[callback],
        **({"rollout_func": rollout_func} if rollout_func else {}))
    from transformers.trainer_callback import PrinterCallback  # optional dependency (the [bench] extra)

    trainer.remove_callback(PrinterCallback)  # logs are still computed every step, not printed
    trainer.bench_records = []
    callback.trainer = trainer
    return trainer


def trl_rows(records: list) -> list:
    rows = []
    for r in records:
        rows.append({"rollout_s": r["rollout_s"], "old_s": r["score_s"] - r["rollout_s"],
                     "train_s": r["steps_s"] - r["score_s"],
                     "rollout_tokens": r["rollout_tokens"], "train_tokens": r["train_tokens"]})
    return rows


def trl_unavailable() -> str | None:
    try:
        import datasets  # noqa: F401
        import transformers  # noqa: F401
        import trl  # noqa: F401
        from transformers import Qwen3MoeConfig  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report any import failure verbatim
        return (f"{type(e).__name__}: {e} (pip install trl transformers accelerate datasets, "
                "keeping torch pinned)")
    return None
