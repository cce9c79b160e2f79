"""Config schema, strict YAML / override loading, round trips, docs."""

import dataclasses
import os
import textwrap

import pytest

from megatron_gspo.config.schema import (ConfigError, LossConfig, ModelConfig, RunConfig,
                                  config_from_dict, config_to_dict, describe_config,
                                  field_docs, load_config, save_config)


def _write(tmp_path, text: str) -> str:
    path = os.path.join(tmp_path, "exp.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


def test_defaults_construct():
    cfg = load_config(None)
    assert cfg == RunConfig()
    assert cfg.model.preset == "qwen3-moe-tiny" and cfg.model.attention == "sdpa"
    # dispatcher 'auto' resolves at load (saved resolved): all-to-all only with EP
    assert cfg.model.dispatcher == "allgather"
    assert load_config(None, ["model.ep=2"]).model.dispatcher == "alltoall"
    assert load_config(None, ["model.ep=2", "model.dispatcher=allgather"]).model.dispatcher \
        == "allgather"
    assert cfg.rollout.group_size == 8 and cfg.train.num_minibatches == 4
    # eps None resolves to the loss's paper default at load (sec. 5.1), so the saved config
    # shows the clip range that ran
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 4e-4)
    assert cfg.optim.beta2 == 0.999 and cfg.sft.lr == 3e-3
    assert cfg.train.routing_replay == "off" and cfg.wandb.mode == "offline"
    assert cfg.task.kwargs == {} and cfg.resume is True


def test_yaml_file_and_demo_experiments_load(tmp_path):
    path = _write(tmp_path, """
        run_dir: runs/x
        task: {name: addition, kwargs: {num_digits: 3}, n_train: 10}
        loss: {eps_low: 3e-4, eps_high: 4.0e-4}
        train: {routing_replay: off, num_minibatches: 2}
        wandb:
          mode: disabled
        """)
    cfg = load_config(path)
    assert cfg.run_dir == "runs/x" and cfg.task.kwargs == {"num_digits": 3}
    assert cfg.loss.eps_low == 3e-4 and isinstance(cfg.loss.eps_low, float)
    assert cfg.loss.eps_high == 4e-4
    assert cfg.train.routing_replay == "off"  # YAML 1.1 would make unquoted off a bool
    assert cfg.task.n_train == 10 and cfg.task.n_eval == 128  # unset keys keep defaults
    root = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "demo")
    for name in ("sft.yaml", "gspo.yaml"):  # both exist; a missing one fails here
        assert load_config(os.path.join(root, name)).wandb.mode == "disabled"


@pytest.mark.parametrize("text, key", [
    ("bogus: 1\n", "'bogus'"),
    ("model:\n  tp: 1\n  experts: 4\n", "'model.experts'"),
    ("task:\n  nam: addition\n", "'task.nam'"),
])
def test_unknown_yaml_key_names_dotted_key_and_valid_keys(tmp_path, text, key):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    msg = str(e.value)
    assert key in msg
    if "model" in key:
        assert "preset, tp, ep, sequence_parallel, dispatcher, dtype, aux_loss_coeff" in msg
    if key == "'bogus'":
        assert "run_dir" in msg and "wandb" in msg


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="train: expected a mapping"):
        load_config(_write(tmp_path, "train: 5\n"))


def test_wrong_type_in_a_file_names_the_key(tmp_path):
    """A str field given a YAML number or list in a file is refused, not stored as is (an
    override's text stays a string; a file's value keeps its YAML type)."""
    for text, fragment in [("wandb: {project: 5}\n", "wandb.project=5: expected str"),
                           ("run_dir: [a, b]\n", "run_dir=['a', 'b']: expected str")]:
        with pytest.raises(ConfigError) as e:
            load_config(_write(tmp_path, text))
        assert str(e.value) == fragment


def test_override_into_a_section_left_empty_in_the_file(tmp_path):
    """`wandb:` with nothing under it (YAML null) is an empty section an override can fill."""
    cfg = load_config(_write(tmp_path, "wandb:\nrun_dir: runs/x\n"), ["wandb.mode=disabled"])
    assert cfg.wandb.mode == "disabled" and cfg.run_dir == "runs/x"


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
        "shared/root.yaml": """
            run_dir: runs/root
            task: {name: addition, kwargs: {num_digits: 3}, n_train: 10}
            loss: {name: grpo, eps_low: 0.2}
            train: {steps: 9}
            """,
        "shared/mid.yaml": """
            base: root.yaml
            loss: {eps_high: 0.27}
            train: {steps: 7}
            """,
        "exp/arm.yaml": """
            base: ../shared/mid.yaml
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
    from megatron_gspo.config.loader import deep_merge

    base = {"a": [1, 2], "b": {"c": 1, "d": [3]}, "e": {"f": 1}}
    top = {"a": [9], "b": {"d": [4, 5]}, "e": None}
    assert deep_merge(base, top) == {"a": [9], "b": {"c": 1, "d": [4, 5]}, "e": None}
    assert base == {"a": [1, 2], "b": {"c": 1, "d": [3]}, "e": {"f": 1}}  # not modified


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


def test_overrides_coerce_types():
    cfg = load_config(None, ["loss.eps_low=3e-4", "optim.lr=1e-5", "train.steps=7",
                             "rollout.temperature=2", "loss.eps_high=null", "seed=3",
                             "wandb.name=2024", "task.name=countdown",
                             "task.kwargs.num_numbers=3", "task.kwargs.max_number=[1,2]",
                             "train.routing_replay=r3"])
    assert cfg.loss.eps_low == pytest.approx(3e-4) and type(cfg.loss.eps_low) is float
    assert cfg.optim.lr == 1e-5 and cfg.train.steps == 7 and type(cfg.train.steps) is int
    assert cfg.rollout.temperature == 2.0 and type(cfg.rollout.temperature) is float
    assert cfg.loss.eps_high == 4e-4 and cfg.seed == 3  # null = GSPO's paper default
    assert cfg.wandb.name == "2024"  # a str field keeps the literal text
    assert cfg.task.kwargs == {"num_numbers": 3, "max_number": [1, 2]}  # YAML-typed values
    assert cfg.train.routing_replay == "r3"


def test_float_coercion_from_yaml11_string():
    # plain yaml.safe_load reads 3e-4 as the string '3e-4'; the config still takes it
    assert config_from_dict({"loss": {"eps_low": "3e-4"}}).loss.eps_low == 3e-4
    assert LossConfig(kl_coef=1).kl_coef == 1.0 and type(LossConfig(kl_coef=1).kl_coef) is float


@pytest.mark.parametrize("text, flag", [("true", True), ("false", False), ("True", True),
                                        ("yes", True), ("off", False)])
def test_bool_parsing(text, flag):
    assert load_config(None, [f"resume={text}"]).resume is flag
    assert load_config(None, [f"rollout.use_sampler_logprobs={text}"]) \
        .rollout.use_sampler_logprobs is flag


@pytest.mark.parametrize("override, fragment", [
    ("train.num_minibatches=abc", "train.num_minibatches=abc: expected int"),
    ("train.steps=2.5", "train.steps=2.5: expected int"),
    ("resume=maybe", "resume=maybe: expected bool | 'force'"),
    ("loss.eps_low=abc", "loss.eps_low=abc: expected float | null"),
    ("train.routing_replay=r9", "expected one of 'off', 'r2', 'r3'"),
    ("model.dtype=fp8", "expected one of 'fp32', 'bf16', 'fp16'"),
    ("model.tp=", "model.tp=: expected int"),
    ("model.nope=1", "unknown config key 'model.nope'"),
    ("nope.x=1", "unknown config key 'nope'"),
    ("model.tp.x=1", "model.tp.x"),
    ("model=1", "model is a section"),
    ("train.steps", "not of the form"),
    ("rollout.group_size=1", "rollout.group_size=1: must be >= 2"),
    ("rollout.top_p=0", "rollout.top_p=0.0: must be in (0, 1]"),
    ("rollout.temperature=nan", "rollout.temperature=nan: must be > 0"),
    ("model.sequence_parallel=true", "model.sequence_parallel=True: requires tp > 1"),
    ("model.tp=2", "model.sequence_parallel=False: must be true with tp=2"),
    ("model.dist_timeout_min=0", "model.dist_timeout_min=0.0: must be > 0"),
    ("model.dist_timeout_min=.inf", "model.dist_timeout_min=inf: must be finite"),
    ("model.num_layers=0", "model.num_layers=0: must be >= 1"),
    ("train.steps=true", "train.steps=True: expected int"),  # a bool is not a number
    ("rollout.temperature=true", "rollout.temperature=True: expected float"),
    ("rollout.kv_cache=2", "rollout.kv_cache=2: expected bool"),  # no truthiness
    ("run_dir=", "run_dir=: must be non-empty"),
    ("model.recompute_modules=moe,bogus", "model.recompute_modules=moe,bogus: expected a comma"),
    ("task.n_train=0", "task.n_train=0: must be >= 1"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5: must be in (0, 1]"),
    ("train.collapse_reward_drop=0", "train.collapse_reward_drop=0.0: must be in (0, 1]"),
    ("sft.min_lr=0.01", "sft.min_lr=0.01: must be <= sft.lr=0.003"),
])
def test_bad_overrides_raise_naming_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)


def test_num_layers_is_for_presets_only():
    with pytest.raises(ConfigError, match=r"model.num_layers=3: only with model.preset"):
        load_config(None, ["model.num_layers=3", "model.hf_path=/some/folder"])


def test_routing_replay_error_lists_valid_literals():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.routing_replay=r9"])
    assert str(e.value) == "train.routing_replay=r9: expected one of 'off', 'r2', 'r3'"


def test_num_minibatches_must_divide_batch():
    # default batch = 8 prompts * 8 = 64
    with pytest.raises(ConfigError, match="num_minibatches=3 does not divide .* = 64"):
        load_config(None, ["train.num_minibatches=3"])
    with pytest.raises(ConfigError, match="= 30"):
        load_config(None, ["rollout.prompts_per_batch=5", "rollout.group_size=6",
                           "train.num_minibatches=4"])
    cfg = load_config(None, ["rollout.prompts_per_batch=5", "rollout.group_size=6",
                             "train.num_minibatches=6"])
    assert cfg.train.num_minibatches == 6


def test_r3_needs_the_kv_cache_sampler_without_sequence_parallel():
    """R3 records routing through the KV-cache sampler, which sequence parallelism bypasses."""
    with pytest.raises(ConfigError, match=r"model.sequence_parallel=false \(got True\)"):
        load_config(None, ["train.routing_replay=r3", "model.tp=2", "model.sequence_parallel=true"])
    assert load_config(None, ["train.routing_replay=r3"]).train.routing_replay == "r3"


def test_sequence_parallel_ok_with_tp2():
    cfg = load_config(None, ["model.tp=2", "model.sequence_parallel=true"])
    assert cfg.model.sequence_parallel is True and cfg.model.tp == 2
    with pytest.raises(ConfigError, match="model.tp=0"):
        ModelConfig(tp=0)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().seed = 1


def test_dict_round_trip_and_strictness():
    cfg = load_config(None, ["task.kwargs.num_digits=3", "loss.eps_low=0.2", "wandb.name=x"])
    d = config_to_dict(cfg)
    assert d["loss"]["eps_low"] == 0.2 and d["task"]["kwargs"] == {"num_digits": 3}
    assert config_from_dict(d) == cfg
    d["optim"]["momentum"] = 0.9
    with pytest.raises(ConfigError, match="'optim.momentum'"):
        config_from_dict(d)


def test_save_load_round_trip(tmp_path):
    cfg = load_config(None, ["loss.eps_low=3e-4", "loss.eps_high=4e-4", "optim.lr=1e-10",
                             "train.routing_replay=off", "wandb.name=2024", "wandb.mode=disabled",
                             "task.kwargs.num_digits=2", "init_checkpoint=runs/sft",
                             "rollout.temperature=0.7"])
    path = os.path.join(tmp_path, "sub", "resolved.yaml")
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert os.listdir(os.path.dirname(path)) == ["resolved.yaml"]  # no tmp file left
    save_config(RunConfig(), path)  # overwrite in place
    assert load_config(path) == RunConfig()


def test_saved_config_keeps_the_schema_order(tmp_path):
    """The resolved config file lists the keys in the schema's order (run_dir first, then the
    sections as declared), not alphabetically."""
    path = os.path.join(tmp_path, "resolved.yaml")
    save_config(RunConfig(), path)
    with open(path) as f:
        lines = f.read().splitlines()
    top = [ln.split(":")[0] for ln in lines if ln and not ln.startswith(("#", " "))]
    assert top == [f.name for f in dataclasses.fields(RunConfig)]
    model = [ln.split(":")[0].strip() for ln in lines[lines.index("model:") + 1:][:3]]
    assert model == ["preset", "tp", "ep"]


def test_every_field_has_a_docstring():
    seen = 0
    for cls in [RunConfig] + [type(getattr(RunConfig(), f.name))
                              for f in dataclasses.fields(RunConfig)
                              if dataclasses.is_dataclass(getattr(RunConfig(), f.name))]:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name} has no docstring"
            seen += 1
    # every field of every section
    assert seen == 15 + 15 + 5 + 14 + 10 + 14 + 14 + 7 + 3 + 15 + 4 + 3


def test_describe_config_lists_every_key_with_default_and_doc():
    text = describe_config()
    for key, default in [("run_dir", "'runs/default'"), ("model.preset", "'qwen3-moe-tiny'"),
                         ("train.routing_replay", "'off'"), ("loss.eps_low", "None"),
                         ("sft.lr", "0.003"), ("wandb.name", "None")]:
        line = next(ln for ln in text.splitlines() if ln.startswith(key + ":"))
        assert line.endswith("= " + default), line
    assert "train.num_minibatches: int = 4" in text
    assert "must divide prompts_per_batch * group_size" in text
    n_keys = sum(1 for ln in text.splitlines() if ln and not ln.startswith((" ", "[", "megat")))
    assert n_keys == 4 + 15 + 5 + 14 + 10 + 14 + 14 + 7 + 3 + 15 + 4 + 3


def test_loss_section_is_the_policy_loss_config():
    """One definition: the run config's loss section is losses.PolicyLossConfig plus adv_eps,
    and the loss functions take it as it is."""
    from dataclasses import fields

    from megatron_gspo.algo.losses import PolicyLossConfig

    assert issubclass(LossConfig, PolicyLossConfig)
    assert [f.name for f in fields(LossConfig)] == \
        [f.name for f in fields(PolicyLossConfig)] + ["adv_eps"]
    cfg = load_config(None, ["loss.name=grpo", "loss.eps_high=0.3"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (0.2, 0.3)  # paper default + override
