"""The docs' statements about settings and metrics hold for the code (doc-vs-code guards):
docs/metrics.md names every key the code emits, docs/data.md's template example parses, and
docs/reliability.md names tests that exist."""

import os
import re
import shlex
from types import SimpleNamespace

from megatron_gspo.config.schema import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _page(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_data_page_template_example_gives_a_newline():
    """docs/data.md's `data.template=...` example, as the shell passes it, is accepted and its
    `\\n` is a newline (a single-quoted YAML value was a YAML mapping error; in YAML single
    quotes it would be a literal backslash-n)."""
    example, = re.findall(r"`(data\.template=[^`]*)`", _page("docs/data.md"))
    cfg = load_config(None, ["task.name=dataset", "data.train_files=a.jsonl",
                             *shlex.split(example)])
    assert cfg.data.template == "Question: {prompt}\nAnswer:"


def _documented_metric_patterns() -> list[re.Pattern]:
    """docs/metrics.md's keys as patterns: `{a,b}` expanded, `layer_XX` any layer, a trailing
    `/...` or `/*` any stat."""
    text = _page("docs/metrics.md")
    patterns = []
    for token in re.findall(r"`([a-z_]+/[^`\s]*)`", text):
        alts = [token]
        while any("{" in a for a in alts):
            a = next(a for a in alts if "{" in a)
            head, rest = a.split("{", 1)
            body, tail = rest.split("}", 1)
            alts = [x for x in alts if x != a] + [head + b + tail for b in body.split(",")]
        for a in alts:
            rx = re.escape(a).replace("layer_XX", r"layer_\d+")
            rx = re.sub(r"/(\\\.\\\.\\\.|\\\*)$", r"/.+", rx)
            patterns.append(re.compile(rx))
    return patterns


def _emitted_keys() -> set[str]:
    """Keys the metric-producing functions return, on tiny inputs."""
    import torch

    from megatron_gspo.algo.advantages import group_advantages
    from megatron_gspo.algo.corrections import correction_inputs
    from megatron_gspo.tasks.datasets import DatasetTask
    from megatron_gspo.rollout.filters import overlong_filter, rollout_health
    from megatron_gspo.algo.losses import POLICY_LOSSES, PolicyLossConfig, tis_weights
    from megatron_gspo.tasks.toy import Example, score
    from megatron_gspo.jobs.rl import response_metrics, rollout_metrics
    from megatron_gspo.jobs.rl_metrics import throughput
    from megatron_gspo.rollout.overlap import staleness_metrics
    from megatron_gspo.run.metrics import Timer
    from megatron_gspo.algo.expert_load import load_metrics
    from megatron_gspo.algo.margins import margin_metrics
    from megatron_gspo.algo.sensitivity import sensitivity_metrics
    from moe.routing.scores import RouterScores

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 5, generator=g)
    old, mask = logp + 0.01 * torch.randn(4, 5, generator=g), torch.ones(4, 5)
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    keys = set()
    for name in POLICY_LOSSES:
        keys |= set(POLICY_LOSSES[name](logp, old, torch.ones(4), mask,
                                        PolicyLossConfig(name))[1])
    keys |= set(tis_weights(old, logp, mask, 2.0)[1])
    keys |= set(correction_inputs(old, logp, mask, PolicyLossConfig("grpo", icepop=[0.5, 2]))[1])
    keys |= set(group_advantages(rewards, 2)[1])
    batch = SimpleNamespace(rewards_B=rewards, response_BT=mask, sampler_logp_BT=logp,
                            response_lengths_B=mask.sum(1), truncated_B=rewards.bool(),
                            reward_status_B=torch.zeros(4, dtype=torch.long),
                            version_B=torch.zeros(4, dtype=torch.long))
    keys |= set(rollout_metrics(batch, old)) | set(rollout_metrics(batch, old, "rollout/x_r3/"))
    keys |= set(rollout_health(batch)) | set(overlong_filter(torch.ones(4), batch, True)[1])
    mb = SimpleNamespace(response_BT=mask, old_logp_BT=old)
    keys |= set(response_metrics(mb, logp, torch.rand(4, 5, generator=g)))
    keys |= set(score(DatasetTask("exact"), [Example("p", "1", ("1", "", "f:1"))], ["1"]))
    scores = RouterScores(torch.rand(3, 2, 3, generator=g).sort(2, descending=True).values,
                          torch.arange(3).expand(3, 2, 3).to(torch.uint8),
                          torch.ones(1, 3, dtype=torch.bool), 4)
    keys |= set(margin_metrics(scores, torch.ones(3, dtype=torch.bool), 0.01))
    keys |= set(sensitivity_metrics([0.1, 0.2]))
    keys |= set(load_metrics(torch.tensor([[3.0, 1.0], [2.0, 2.0]])))
    keys |= set(staleness_metrics(batch, 0))
    batch.valid_BT = mask
    keys |= set(throughput(batch, Timer()))
    return keys - {"rollout/x_r3/mean", "rollout/x_r3/max"}


def test_every_metric_the_code_emits_is_on_the_metrics_page():
    """docs/metrics.md (the README's Metrics section before it) names every key of the loss,
    advantage, rollout, filter and eval metrics (adv/{mean,std}, reward/group_std/mean,
    policy/log_ratio/abs_max and eval/{reward_mean,format_ok} were missing once), and the
    trainer's train/{iteration,minibatch} and the step's train/{pad_frac,microbatches}."""
    patterns = _documented_metric_patterns()
    keys = _emitted_keys() | {"train/iteration", "train/minibatch", "train/pad_frac",
                              "train/microbatches"}
    missing = sorted(k for k in keys if not any(p.fullmatch(k) for p in patterns))
    assert not missing, f"emitted but not in docs/metrics.md: {missing}"


def test_every_sft_metric_is_on_the_metrics_page():
    """`megatron-gspo sft` logs an `sft/` group the Metrics section did not name."""
    import torch

    from megatron_gspo.jobs.band import SFTBand
    from megatron_gspo.jobs.sft import draw_batch, sft_step
    from tests.megatron_gspo.jobs.test_sft import fake_runtime

    band = SFTBand(load_config(None, ["sft.target_accuracy=[0.2,0.5]"]))
    band.update(0, 0.1)
    band.update(5, 0.3)
    rt = fake_runtime(4, 1)
    keys = set(sft_step(rt, draw_batch(rt, torch.Generator().manual_seed(0)))) | set(
        band.record())
    patterns = _documented_metric_patterns()
    missing = sorted(k for k in keys if not any(p.fullmatch(k) for p in patterns))
    assert not missing and "sft/band_step" in keys, missing


def test_routing_mismatch_is_logged_for_a_bf16_sampler_without_r3():
    """The docs once said `rollout/routing_mismatch` was R3 only; a bf16 sampler records the
    sampler's routing (and so logs it) without R3 too."""
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, ["rollout.decoders.sampler_dtype=bf16"])
    assert cfg.train.routing_replay == "off"
    assert Trainer.records_sampler_routing(SimpleNamespace(cfg=cfg))
    assert "`rollout/routing_mismatch/...` (R3 only" not in _page("docs/metrics.md")
    row, = [ln for ln in _page("docs/metrics.md").splitlines()
            if ln.startswith("| `rollout/routing_mismatch/{layer_XX,mean,max}`")]
    assert "rollout.decoders.sampler_dtype" in row


def test_every_test_the_reliability_page_names_exists():
    """docs/reliability.md names the test that holds each guarantee: each must exist (a
    renamed or deleted test would leave a guarantee unguarded while the page still claims it)."""
    rows = [ln for ln in _page("docs/reliability.md").splitlines()
            if ln.startswith("| ") and "::" in ln]
    assert rows
    for row in rows:
        path = None
        for file, name in re.findall(r"`(tests/[\w/]+\.py)?::(test_\w+)`", row):
            path = file or path
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                assert f"def {name}(" in f.read(), f"{path}::{name} (docs/reliability.md)"


def test_every_named_test_exists():
    """Docs, experiment READMEs and code comments that cite a test (a file under tests/, or
    file::name) cite one that is there: tests move with the rooms they mirror."""
    import glob

    files = [os.path.join(ROOT, p) for p in ("README.md", "CHANGELOG.md")]
    for pattern in ("docs/*.md", "experiments/*/README.md", "megatron_gspo/**/*.py",
                    "moe/**/*.py", "bench/*.py", "tools/*.py", "tests/**/*.py"):
        files += glob.glob(os.path.join(ROOT, pattern), recursive=True)
    missing = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            text = f.read()
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(test_\w+))?", text):
            full = os.path.join(ROOT, path)
            if not os.path.isfile(full):
                missing.append(f"{os.path.relpath(file, ROOT)}: {path}")
            elif name:
                with open(full, encoding="utf-8") as f:
                    if f"def {name}(" not in f.read():
                        missing.append(f"{os.path.relpath(file, ROOT)}: {path}::{name}")
    assert not missing, missing
