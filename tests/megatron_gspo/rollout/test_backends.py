"""Backends declare what they can do (`megatron_gspo.rollout.sampler.Backend`) and nothing else
names them: the name scan over megatron_gspo/, the decoders' and a fake backend's declarations
read by the config checks, the CLI and the plan."""

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_gspo import cli
from megatron_gspo.config.schema import load_config, load_config_origins
from megatron_gspo.errors import ConfigError
from megatron_gspo.jobs import plan
from megatron_gspo.rollout.backends import (BACKENDS, backend_of, check_backend, check_config,
                                            unused_settings)
from megatron_gspo.rollout.sampler import SAMPLERS, Backend, register_sampler

ROOT = Path(__file__).resolve().parents[3]
BUILT_IN = ("lean", "megatron", "megatron_engine", "vllm")
OWNERS = {"rollout/decoders.py", "rollout/engine.py", "rollout/sampler.py", "rollout/backends.py"}
"""Where a backend's name may be a string in code: its own module, the registry (and
rollout/vllm*.py: the vLLM backend's modules)."""
ALLOWED = {"config/rollout.py": {"lean"}}
"""The rollout section names its default backend (and `decoder`, the older spelling of it)."""
EXEMPT = {("jobs/plan_time.py", "DECODE")}
"""Measured figures keyed as the results file experiments/gpu/results/rollout.json keys them."""


def _names_in_code(path: Path, rel: str) -> list[str]:
    """`line: 'name'` of each string constant equal to a built-in backend's name, docstrings,
    annotations and the EXEMPT assignments left out."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))  # a docstring
        for ann in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if isinstance(ann, ast.AST):
                skip.update(id(n) for n in ast.walk(ann))
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and (rel, t.id) in EXEMPT for t in node.targets):
            skip.update(id(n) for n in ast.walk(node.value))
    return [f"{rel}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in BUILT_IN and id(n) not in skip
            and n.value not in ALLOWED.get(rel, ())]


def test_no_backend_name_outside_its_own_module_and_the_registry():
    """Code outside a backend's module(s) and the registry asks the backend's declared
    capabilities (`backend_of(cfg)`), never `if backend == "vllm"`: adding a backend edits
    no other file."""
    assert set(BUILT_IN) <= set(BACKENDS)
    package = ROOT / "megatron_gspo"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel in OWNERS or rel.startswith("rollout/vllm"):
            continue
        found += _names_in_code(path, rel)
    assert found == []


def test_the_decoders_record_routing_for_r3_only_with_the_kv_cache_and_no_sequence_parallel():
    """R3 records routing through the KV-cache sampler, which sequence parallelism and
    rollout.decoders.kv_cache=false bypass: the decoders' own check, in one line naming the keys."""
    with pytest.raises(ConfigError, match=r"model.sequence_parallel=false \(got True\)"):
        check_config(load_config(None, ["train.routing_replay=r3", "model.tp=2",
                                        "model.sequence_parallel=true"]))
    with pytest.raises(ConfigError, match=r"rollout.decoders.kv_cache=true \(got False\)"):
        check_config(load_config(None, ["train.routing_replay=r3",
                                        "rollout.decoders.kv_cache=false"]))
    for ok in (["train.routing_replay=r3"],
               ["train.routing_replay=r2", "rollout.decoders.kv_cache=false"],
               ["train.routing_replay=r3", "rollout.backend=vllm", "model.tp=2",
                "model.sequence_parallel=true"]):  # an engine records whatever the layout
        check_config(load_config(None, ok))


def _fake_check(cfg):
    if cfg.rollout.max_batch_rows == 3:
        raise ConfigError("rollout.max_batch_rows=3: the fake backend takes no odd batches")


def _fake_memory(preset, cfg, rows, T):
    return [(f"fake engine ({rows} rows x {T})", 2.0 * 2**30)], True


FAKE = Backend(engine=True, check=_fake_check, plan_memory=_fake_memory,
               own_keys=("rollout.top_p",))


@pytest.fixture(autouse=True)
def fakes():
    """Two backends registered from here for each test, then removed (FAKE's own key would
    refuse rollout.top_p for every other backend)."""
    register_sampler("fake_engine", FAKE)(lambda policy, tokenizer, cfg: None)
    register_sampler("fake_cuda", Backend(needs_cuda=True))(lambda policy, tokenizer, cfg: None)
    yield
    for name in ("fake_engine", "fake_cuda"):
        SAMPLERS.pop(name)
        BACKENDS.pop(name)


def test_a_backend_without_routing_is_refused_under_r3_in_one_line_naming_it(capsys, tmp_path):
    """A registered backend that declares no routing record: R3 is refused before anything is
    set up, by the CLI in one line naming rollout.backend (exit 2), and by the plan."""
    argv = ["rollout.backend=fake_engine", "train.routing_replay=r3"]
    with pytest.raises(ConfigError, match=r"^train.routing_replay=r3 replays the sampler's "
                                          r"routing: rollout.backend=fake_engine does not "
                                          r"record it$"):
        check_config(load_config(None, argv))
    assert cli.main(["train", *argv, f"run_dir={tmp_path / 'run'}", "wandb.mode=disabled"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout.backend=fake_engine does not record it" in err
    assert not (tmp_path / "run").exists()  # refused before the run dir was claimed
    assert cli.main(["plan", "--gpus", "1", "--gpu-mem-gib", "80", *argv]) == 2
    assert "rollout.backend=fake_engine does not record it" in capsys.readouterr().err


def test_a_backends_own_check_and_own_keys_run_from_its_declaration():
    cfg = load_config(None, ["rollout.backend=fake_engine", "rollout.max_batch_rows=3"])
    with pytest.raises(ConfigError, match=r"^rollout.max_batch_rows=3: the fake backend"):
        check_config(cfg)
    assert check_config(load_config(None, ["rollout.backend=fake_engine",
                                           "rollout.top_p=0.9"])) is FAKE
    with pytest.raises(ConfigError, match=r"^rollout.top_p=0.9: needs "
                                          r"rollout.backend=fake_engine, not 'lean'$"):
        check_config(load_config(None, ["rollout.top_p=0.9"]))
    with pytest.raises(ConfigError, match=r"^rollout.backend='nope': no such backend"):
        backend_of(load_config(None, ["rollout.backend=nope"]))


def test_an_engine_declared_elsewhere_is_an_engine_to_the_trainer_and_the_plan():
    """The trainer records an engine's routing (its mismatch) where the engine can record it,
    and the plan counts the memory it declares, for the whole step, and says whose decode
    figure stands in for it."""
    from types import SimpleNamespace

    from megatron_gspo.jobs.plan_time import sampler_figure
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, ["rollout.backend=fake_engine", "model.preset=tiny"])
    assert not Trainer.records_sampler_routing(SimpleNamespace(cfg=cfg))  # it cannot
    SAMPLERS.pop("fake_engine")  # registered again, recording its routing
    register_sampler("fake_engine", dataclasses.replace(FAKE, records_routing=lambda c: True))(
        lambda policy, tokenizer, cfg: None)
    assert Trainer.records_sampler_routing(SimpleNamespace(cfg=cfg))
    p, _ = plan.model_preset(cfg)
    planned = plan.plan_layout(p, cfg, 1)
    rows, T = planned.facts["per_call"], planned.facts["T"]
    assert dict(planned.rows)[f"fake engine ({rows} rows x {T})"] == 2.0 * 2**30
    assert planned.phases["rollout"] == 0.0  # counted for the whole step
    key, _, note = sampler_figure(cfg)
    assert note == f"rollout.backend=fake_engine has no GPU figure here: {key}' stands in"


def test_a_backend_that_needs_cuda_is_refused_in_one_line_without_it():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    with pytest.raises(ConfigError, match=r"^rollout.backend=fake_cuda needs a CUDA GPU; none "
                                          r"is visible here$"):
        check_backend(load_config(None, ["rollout.backend=fake_cuda"]))


def test_each_backends_settings_are_a_section_of_their_own():
    """A backend's settings live in the section it declares (`Backend.settings`), nested in
    rollout; its own keys are keys of that section; the decoders share one."""
    from megatron_gspo.config.schema import RunConfig

    sections = {}
    for name in BUILT_IN:
        caps = BACKENDS[name]
        section = RunConfig()
        for part in caps.settings.split("."):
            section = getattr(section, part)
        assert dataclasses.is_dataclass(section) and section._section == caps.settings, name
        sections[name] = section
        assert all(k.startswith(caps.settings + ".") for k in caps.own_keys), name
    assert type(sections["lean"]) is type(sections["megatron"])
    assert {BACKENDS[n].settings for n in BUILT_IN} == {
        "rollout.decoders", "rollout.megatron_engine", "rollout.vllm"}


def test_a_setting_of_a_backend_the_run_does_not_use_is_refused_on_the_command_line():
    """`rollout.backend=vllm rollout.decoders.sampler_dtype=bf16` sampled in float32, exit 0:
    a setting in another backend's section (`Backend.settings`) is named in one line, with
    every backend that reads it (here also those other tests registered over the decoders). The
    run's own backend's section, and sections no backend declares, pass."""
    cfg, origins = load_config_origins(None, ["rollout.backend=vllm",
                                              "rollout.decoders.sampler_dtype=bf16"])
    with pytest.raises(ConfigError, match=r"^rollout.decoders.sampler_dtype='bf16' is a setting "
                                          r"of rollout.backend=lean or megatron( or \w+)*; "
                                          r"this run samples with 'vllm', which never reads "
                                          r"it: drop it, or set rollout.backend$"):
        unused_settings(cfg, origins)
    for ok in (["rollout.backend=vllm", "rollout.vllm.dtype=bf16", "rollout.temperature=0.5"],
               ["rollout.decoder=megatron", "rollout.decoders.kv_cache=false"],
               ["rollout.backend=fake_engine"]):
        assert unused_settings(*load_config_origins(None, ok)) == []


def test_a_file_setting_another_backends_defaults_is_warned_about_naming_it(tmp_path,
                                                                            monkeypatch, capsys):
    """A `base:` file may set defaults for several backends: the run goes on, with a warning
    naming the file and each setting away from its default that its backend ignores; on the
    command line the same setting stops the CLI (train and plan) before anything runs."""
    base, exp = tmp_path / "base.yaml", tmp_path / "exp.yaml"
    base.write_text("rollout:\n  vllm: {dtype: bf16, kv_cache_gb: 2, mode: in_process}\n"
                    "  decoders: {sampler_dtype: bf16}\n")  # mode: its default, nothing ignored
    exp.write_text("base: base.yaml\nrollout: {backend: megatron}\n")
    seen = []
    monkeypatch.setattr(cli, "run", lambda command, cfg: seen.append(cfg) or {})
    assert cli.main(["train", "--config", str(exp), f"run_dir={tmp_path / 'run'}"]) == 0
    warned = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("WARNING")]
    assert warned == [f"WARNING: {base}: rollout.vllm.{k} is a setting of rollout.backend=vllm; "
                      f"this run samples with 'megatron', which never reads it (ignored)"
                      for k in ("dtype='bf16'", "kv_cache_gb=2.0")]
    assert seen[0].rollout.decoders.sampler_dtype == "bf16"
    for argv in (["train", f"run_dir={tmp_path / 'run'}"],
                 ["plan", "--gpus", "1", "--gpu-mem-gib", "80"]):
        assert cli.main([*argv, "--config", str(exp), "rollout.vllm.dtype=fp32"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "rollout.vllm.dtype='fp32' is a setting of " \
            "rollout.backend=vllm; this run samples with 'megatron'" in err, err
    assert len(seen) == 1
