"""bench/throughput.py: the arguments (--with-vllm switches every side's preset), the side-by-side
table with two, three or four sides (the vLLM engine server's), and --force-length reaching the sampler that was already built
(our decoder's stop ids, the vLLM sampler's tokenizer)."""

import importlib.util

import pytest

from bench import throughput as bench
from bench import throughput_table


def side(rollout_tps, train_tps, rollout_s, sync_s=0.0):
    return {"rollout_tps": rollout_tps, "train_tps": train_tps, "rollout_s": rollout_s,
            "sync_s": sync_s, "old_s": 0.1, "train_s": 2.0, "rollout_tokens": 320.0,
            "train_tokens": 900.0, "spread": f"rollout {rollout_tps:.0f}"}


def test_with_vllm_switches_every_side_to_the_head_dim_32_preset():
    from megatron_gspo.rollout.vllm.engine import CPU_HEAD_DIMS
    from moe.model.presets import get_preset

    plain, three = bench.parse_args([]), bench.parse_args(["--with-vllm"])
    assert not plain.with_vllm and bench.preset_name(plain) == "qwen3-moe-tiny"
    assert three.with_vllm and bench.preset_name(three) == bench.VLLM_PRESET
    assert get_preset(bench.VLLM_PRESET).kv_channels in CPU_HEAD_DIMS
    assert get_preset(bench.PRESET).kv_channels not in CPU_HEAD_DIMS


def test_two_sides_table_is_unchanged_without_vllm():
    text = throughput_table.format_table(side(100.0, 300.0, 1.0), side(50.0, 150.0, 2.0), None)
    lines = text.splitlines()
    assert lines[0] == ("| metric (median per iteration) | ours (megatron-core) | "
                        "TRL GRPOTrainer | ours/TRL |")
    assert "| rollout tokens/s | 100.0 | 50.0 | 2.00 |" in lines
    assert "| rollout s/iter | 1.000 | 2.000 | 0.50 |" in lines
    assert not any("weight push" in ln for ln in lines)
    assert lines[-1] == "min-max over iterations: ours rollout 100; TRL rollout 50"


def test_three_sides_with_every_ratio():
    text = throughput_table.format_table(side(100.0, 300.0, 1.0), side(50.0, 150.0, 2.0), None,
                              vllm=side(80.0, 300.0, 1.25, sync_s=0.25), with_vllm=True)
    assert ("| metric (median per iteration) | ours (megatron-core, lean decoder) | "
            "ours + vLLM rollouts | TRL GRPOTrainer | ours/TRL | vLLM/TRL | vLLM/ours |") in text
    assert "| rollout tokens/s | 100.0 | 80.0 | 50.0 | 2.00 | 1.60 | 0.80 |" in text
    assert "| weight push s/iter (in rollout) | - | 0.250 | - | - | - | - |" in text
    assert "| train tokens/s | 300.0 | 300.0 | 150.0 | 2.00 | 2.00 | 1.00 |" in text
    assert "ours rollout 100; vLLM rollout 80; TRL rollout 50" in text


def test_the_engine_server_side_with_its_ratios_to_ours_and_to_the_in_process_engine():
    args = bench.parse_args(["--vllm-server-tp", "2"])
    assert args.with_vllm and bench.preset_name(args) == bench.VLLM_PRESET
    text = throughput_table.format_table(side(100.0, 300.0, 1.0), None, "--skip-trl",
                                         vllm=side(80.0, 300.0, 1.25, sync_s=0.25),
                                         with_vllm=True, server=side(40.0, 300.0, 2.5, 0.5),
                                         server_tp=2)
    assert ("| ours (megatron-core, lean decoder) | ours + vLLM rollouts | ours + vLLM server "
            "(TP=2) | TRL GRPOTrainer | ours/TRL | vLLM/TRL | vLLM/ours | server/ours | "
            "server/vLLM |") in text
    assert "| rollout tokens/s | 100.0 | 80.0 | 40.0 | skipped | - | - | 0.80 | 0.40 | 0.50 |" \
        in text
    assert "| weight push s/iter (in rollout) | - | 0.250 | 0.500 | skipped | -" in text
    assert "ours rollout 100; vLLM rollout 80; vLLM server rollout 40" in text
    skipped = throughput_table.format_table(side(100.0, 300.0, 1.0), None, None,
                                            vllm=side(80.0, 300.0, 1.25), with_vllm=True,
                                            server_tp=2, server_skip="UserError: no engine")
    assert skipped.endswith("vLLM server skipped: UserError: no engine")


def test_a_skipped_side_says_why_and_drops_its_ratios():
    text = throughput_table.format_table(side(100.0, 300.0, 1.0), None, "--skip-trl", vllm=None,
                              vllm_skip="rollout.backend=vllm needs vLLM", with_vllm=True)
    assert "| rollout tokens/s | 100.0 | skipped | skipped | - | - | - |" in text
    assert "TRL skipped: --skip-trl" in text
    assert text.endswith("vLLM skipped: rollout.backend=vllm needs vLLM")


def _one_iteration(argv):
    args = bench.parse_args(["--skip-trl", "--force-length", "--prompts", "2",
                             "--group-size", "2", "--minibatches", "1", "--max-new-tokens", "3",
                             "--iterations", "1", "--warmup", "0", *argv])
    return args, bench.measure(args)


def test_force_length_reaches_our_decoder(tmp_path):
    """Our decoder takes its stop ids when it is built (the sampler seam): replacing the run's
    tokenizer afterwards left <eos> stopping samples. Forced, the built sampler has none."""
    argv = ["--skip-trl", "--prompts", "2", "--group-size", "2", "--minibatches", "1"]
    plain, _ = bench.build_ours(bench.parse_args(argv), str(tmp_path / "plain"))
    forced, _ = bench.build_ours(bench.parse_args([*argv, "--force-length"]),
                                 str(tmp_path / "forced"))
    assert plain.rt.sampler.stop_ids.numel() > 0 and forced.rt.sampler.stop_ids.numel() == 0
    assert forced.rt.tokenizer.stop_ids == frozenset()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_with_vllm_measures_the_engine_sides_in_one_run(capsys):
    """One run, the vLLM sides (in process, and an engine server of two workers) in the same
    alternation: their rollouts forced to length too, a weight push timed every iteration, the
    report naming them; torch's thread count set and kept (the engine's no-op
    set_num_threads bypassed, and undone when the engine closes)."""
    import torch

    args, res = _one_iteration(["--with-vllm", "--vllm-server-tp", "2"])
    assert res["vllm_skip"] is None and res["vllm"]["rollout_tokens"] == pytest.approx(4 * 3)
    assert res["server_skip"] is None and res["server"]["rollout_tokens"] == pytest.approx(4 * 3)
    assert res["server"]["sync_s"] > 0
    assert res["ours"]["rollout_tokens"] == pytest.approx(4 * 3) and res["vllm"]["sync_s"] > 0
    assert res["preset"].startswith(bench.VLLM_PRESET) and torch.get_num_threads() == 1
    assert torch.set_num_threads is bench._set_num_threads
    bench.report(args, res)
    out = capsys.readouterr().out
    assert ("| ours + vLLM rollouts | ours + vLLM server (TP=2) | TRL GRPOTrainer | ours/TRL | "
            "vLLM/TRL | vLLM/ours | server/ours | server/vLLM |") in out
    assert "alternating ours/vLLM/vLLM server;" in out and "plus rollout.backend=vllm" in out
    assert "plus rollout.vllm.mode=server rollout.vllm.tensor_parallel_size=2" in out
