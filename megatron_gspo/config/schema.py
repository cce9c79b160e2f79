"""Run configuration: frozen dataclasses are the single source of truth.

    cfg = load_config("experiments/demo/gspo.yaml", ["loss.eps_low=3e-4", "train.steps=5"])

`RunConfig` is the top level of an experiment file; its sections are one dataclass per component
(`megatron_gspo.config.sections`, `.loss`, `.rollout`, `.data`). Loading is strict and generic (`.loader` walks the
dataclass fields, no per-section code): an unknown key at any level is an error naming the
dotted key and listing the section's valid keys; values (YAML, or override text read as YAML:
`1e-5`, `true`, `[1,2]`, `null`) are read into the field's type before a dataclass is built,
and the dataclasses only check them. Every field has a docstring; `describe_config()` lists them
for `megatron-gspo config`. docs/config.md is the reference.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Sequence, Union

import yaml

from megatron_gspo.config.data import (DataConfig, FilterConfig, RewardConfig,  # noqa: F401
                                       check_data_sections)
from megatron_gspo.config.docs import describe_fields, field_docs
from megatron_gspo.config.fields import (MAY_CHANGE, OptionalPath, Path, Paths, check,
                                         field_types, may_change, validate)
from megatron_gspo.config.loader import apply_override, build, current_names
from megatron_gspo.config.parts import (PART, describe_all, host_fields, may_change_keys,
                                        settings_dict, settings_of)
from megatron_gspo.config.rollout import RolloutConfig  # noqa: F401
from megatron_gspo.config.loss import LossConfig  # noqa: F401
from megatron_gspo.config.sections import (ModelConfig, OptimConfig, SFTConfig,  # noqa: F401
                                           TaskConfig, TrainConfig, WandbConfig)
from megatron_gspo.config.yamlfile import atomic_write, load_layered
from megatron_gspo.errors import ConfigError

__all__ = ["COMMAND_LINE", "DEFAULT_INSTRUMENTS", "RunConfig", "config_from_dict",
           "config_to_dict", "describe_config", "field_docs", "load_config",
           "load_config_origins", "local_prompts", "resume_may_change",
           "save_config"]


DEFAULT_INSTRUMENTS = ("flips", "routing_log_ratio", "route_sensitivity", "expert_load",
                       "throughput", "collapse_alerts")
"""The built-in instruments (`megatron_gspo.jobs.rl_instruments`), all on by default."""


@dataclass(frozen=True)
class RunConfig:
    """Top level of an experiment file."""
    _section: ClassVar[str] = ""

    run_dir: Path = may_change("runs/default")
    """Output directory: metrics.jsonl, resolved config, checkpoints/."""
    seed: int = 0
    """Global seed (model init, sampling, minibatch order); 0 <= seed < 2**32."""
    init_checkpoint: OptionalPath = None
    """Initial weights: a run dir (its latest checkpoint) or a step dir, any parallel layout."""
    resume: Union[bool, Literal["force"]] = may_change(True)
    """Resume from run_dir's newest good checkpoint if there is one. A run dir belongs to one
    run: resuming with a different job or semantic config is refused (`megatron_gspo.run.rundir`);
    "force" resumes anyway with the new config; false refuses a run dir holding checkpoints."""
    plugins: Paths = may_change(factory=list)
    """User modules imported before the config's names are checked, so that a loss, reward,
    task or sampler they register is valid (docs/extending.md): a module name importable here
    or a path to a .py file or package folder (relative to the working directory). The CLI's
    `--plugin` adds one. A resume may change it."""
    instruments: list = may_change(factory=lambda: list(DEFAULT_INSTRUMENTS))
    """What RL measures besides what it trains, registry names called in this order
    (`megatron_gspo.jobs.instruments`): flips (with drift vs pi_old and router margins),
    routing_log_ratio, route_sensitivity, expert_load, throughput, collapse_alerts (the
    default: all of them), and any a plugin registers (docs/extending.md). Leaving one out
    drops its metrics and its cost; what is trained does not change, so a resume may change
    it. Their settings are train: keys (train.flip_every, ...)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy architecture and parallel layout."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Verifiable task."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampling."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """RL loop."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised cold start."""
    wandb: WandbConfig = may_change(factory=WandbConfig)
    """wandb logging."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset files (task.name=dataset)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Dataset reward."""
    filter: FilterConfig = field(default_factory=FilterConfig)
    """DAPO rollout filters."""

    def __post_init__(self):
        validate(self, nonempty=("run_dir", "init_checkpoint"), ge={"seed": 0})
        check(self, "plugins", all(isinstance(p, str) and p.strip() for p in self.plugins),
              "must be a list of module names or paths")
        check(self, "instruments", all(isinstance(n, str) and n for n in self.instruments),
              "must be a list of instrument names")
        # derived seeds (seed * 1_000_033 + step, ...) must fit torch's 64-bit generator seed
        check(self, "seed", self.seed < 2**32, "must be < 2**32")
        check_data_sections(self)
        batch = self.rollout.prompts_per_batch * self.rollout.group_size
        n = self.train.num_minibatches
        if batch % n:
            raise ConfigError(
                f"train.num_minibatches={n} does not divide the rollout batch "
                f"rollout.prompts_per_batch * rollout.group_size = {batch}")
        if self.loss.tis_cap is not None and self.rollout.use_sampler_logprobs:
            raise ConfigError(f"loss.tis_cap={self.loss.tis_cap} weights by pi_old / pi_sampler: "
                              "with rollout.use_sampler_logprobs=true pi_old is the sampler's, "
                              "so every weight would be 1")
        if self.rollout.max_staleness and self.filter.dynamic_sampling:
            raise ConfigError(f"filter.dynamic_sampling=true chooses groups by their rewards while "
                              f"it samples: not with rollout.max_staleness="
                              f"{self.rollout.max_staleness}, whose rewards are scored when the "
                              "trainer takes a batch sampled beside it")
        for key in ("is_mask_token", "is_mask_seq", "icepop"):
            if getattr(self.loss, key) is not None and self.rollout.use_sampler_logprobs:
                raise ConfigError(
                    f"loss.{key}={getattr(self.loss, key)} reads pi_old / pi_sampler: with "
                    "rollout.use_sampler_logprobs=true pi_old is the sampler's, so every ratio "
                    "would be 1")


def local_prompts(cfg: RunConfig, dp: int) -> int:
    """Prompts per rollout batch on one data-parallel rank; ConfigError unless the batch splits
    evenly over the ranks and each rank's rows split into `train.num_minibatches`."""
    prompts, group, n = cfg.rollout.prompts_per_batch, cfg.rollout.group_size, \
        cfg.train.num_minibatches
    if prompts % dp:
        raise ConfigError(f"rollout.prompts_per_batch={prompts} is not divisible by the "
                          f"data-parallel size {dp}")
    if prompts // dp * group % n:  # each rank splits its own share into minibatches
        raise ConfigError(f"train.num_minibatches={n} does not divide a data-parallel rank's "
                          f"{prompts // dp * group} rollout rows (rollout.prompts_per_batch / "
                          f"dp * rollout.group_size = {prompts} / {dp} * {group})")
    return prompts // dp


@functools.lru_cache(maxsize=None)
def resume_may_change(cls=RunConfig, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of the fields (or whole sections) marked `fields.may_change`, nested
    sections walked: what a resume may change (`megatron_gspo.run.rundir` leaves them out of a
    run's fingerprint)."""
    out, types = [], field_types(cls)
    for f in dataclasses.fields(cls):
        tp = types[f.name]
        if f.metadata.get(MAY_CHANGE):
            out.append(prefix + f.name)
        elif dataclasses.is_dataclass(tp):
            out += resume_may_change(tp, f"{prefix}{f.name}.")
    return tuple(out)


def value_at(cfg, key: str):
    """The value of dotted `key` ("rollout.decoders.kv_cache") in a config (or a section), a
    part's settings too ("rollout.my_backend.every": `parts.settings_of`)."""
    for part in key.split("."):
        if hasattr(cfg, "_parts") and part not in host_fields(type(cfg)):
            if cfg._parts[2]:  # nested: the part's own section
                cfg = settings_of(cfg, part)
                continue
            cfg = settings_of(cfg)  # flat: a key of the selected part's settings
        cfg = getattr(cfg, part)
    return cfg


def config_from_dict(d: dict) -> RunConfig:
    """Strict: unknown keys at any level, wrong types or bad values raise ConfigError. Names a
    registry of a higher room holds are checked at set-up (`megatron_gspo.run.names`)."""
    return build(RunConfig, d)


def config_to_dict(cfg) -> dict:
    """Plain nested dict, a part's settings (`megatron_gspo.config.parts`) spelled out where
    its keys are; `config_from_dict(config_to_dict(cfg)) == cfg`."""
    out = {f.name: config_to_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name))
           else copy.deepcopy(v) for f in dataclasses.fields(cfg) if not f.metadata.get(PART)}
    return {**out, **settings_dict(cfg)} if hasattr(cfg, "_parts") else out


def settings_may_change(config: dict, cls=RunConfig, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of parts' settings in a saved `config` marked `fields.may_change`
    (`resume_may_change` lists the sections' own)."""
    out = may_change_keys(cls, config, prefix) if hasattr(cls, "_parts") else []
    for name, tp in field_types(cls).items():
        if dataclasses.is_dataclass(tp) and isinstance(config.get(name), dict):
            out += settings_may_change(config[name], tp, f"{prefix}{name}.")
    return tuple(out)


COMMAND_LINE = "the command line"
"""Where `load_config_origins` says an override's value comes from."""


def load_config(path: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """YAML experiment file (None = all defaults; `base: other.yaml` inherits, see
    `yamlfile.load_layered`), then `a.b=c` overrides; all strict."""
    return load_config_origins(path, overrides)[0]


def load_config_origins(path: str | None, overrides: Sequence[str] = (), plugins=None
                        ) -> tuple[RunConfig, dict[str, str]]:
    """`load_config`, and {dotted key (its name now): where its value was given, the file of
    the base chain that set it last or COMMAND_LINE} of every key the file and the overrides
    set (what `megatron_gspo.rollout.backends.unused_settings` reads). `plugins(head) ->
    [entries]`, if given, is called before the rest is built with the config of the keys
    `HEAD` alone: it imports the run's plugins and returns the `plugins` the config keeps, so
    that the settings of the parts they register are read as strictly as a section's."""
    origins: dict[str, str] = {}
    raw = {} if path is None else load_layered(
        path, normalize=lambda layer: current_names(RunConfig, layer), origins=origins)
    for item in overrides:
        origins[apply_override(RunConfig, raw, item)] = COMMAND_LINE
    if plugins is not None:
        raw = {**raw, "plugins": plugins(build(RunConfig, {k: raw[k] for k in HEAD if k in raw}))}
    return config_from_dict(raw), origins


HEAD = ("run_dir", "resume", "plugins")
"""The keys that say which plugins a run imports (its own, or those its run dir recorded)."""


def save_config(cfg: RunConfig, path: str) -> None:
    """Write the config as YAML atomically (tmp file + os.replace): every key, as the run used
    it; `load_config(path) == cfg`."""
    text = ("# resolved megatron-gspo config (megatron-gspo ... --config THIS_FILE)\n"
            + yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, text)


def describe_config() -> str:
    """Every key with its type, default and docstring (`megatron-gspo config`)."""
    lines = ["megatron-gspo config keys (YAML sections, or dotted key=value overrides):", ""]
    describe_fields(RunConfig, "", lines, parts=describe_all)
    return "\n".join(lines)
