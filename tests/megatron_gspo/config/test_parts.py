"""megatron_gspo.config.parts: a part's own settings, read where its keys are (beside loss.name,
or the section rollout.<backend>), as strictly as a section's, saved spelled out, listed, and
their may_change marks honoured."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from megatron_gspo.config import parts
from megatron_gspo.config.fields import may_change
from megatron_gspo.config.loss import ClipRange
from megatron_gspo.config.schema import (config_from_dict, config_to_dict, describe_config,
                                         load_config, settings_may_change, value_at)
from megatron_gspo.errors import ConfigError


@dataclass(frozen=True)
class Widths:
    """toy's own settings."""

    width: int = 3
    """How wide."""
    label: str = may_change("w")
    """A label; a resume may change it."""


@dataclass(frozen=True)
class Scaled(ClipRange):
    """scaled's own settings: a clip range and a scale."""

    scale: float = 1.0
    """The scale."""


@pytest.fixture
def registered(monkeypatch):
    """A backend "toy" and a loss "scaled" that declare settings (the registry put back)."""
    monkeypatch.setitem(parts.SETTINGS, "backend", dict(parts.SETTINGS.get("backend", {})))
    monkeypatch.setitem(parts.SETTINGS, "loss", dict(parts.SETTINGS["loss"]))
    parts.register_settings("backend", "toy", Widths)
    parts.register_settings("loss", "scaled", Scaled, defaults={"eps_low": 0.1, "eps_high": 0.2})


def test_a_parts_settings_load_typed_and_strictly(registered):
    cfg = load_config(None, ["loss.name=scaled", "loss.scale=2", "rollout.backend=toy",
                             "rollout.toy.width=5"])
    assert cfg.loss.settings == Scaled(eps_low=0.1, eps_high=0.2, scale=2.0)
    assert cfg.loss.scale == 2.0 and type(cfg.loss.scale) is float  # read as its key is
    assert cfg.rollout.settings == {"toy": Widths(width=5)}
    assert parts.settings_of(cfg.rollout) == Widths(width=5) == value_at(cfg, "rollout.toy")
    assert value_at(cfg, "rollout.toy.width") == 5 and value_at(cfg, "loss.eps_low") == 0.1
    for override, says in [
            ("loss.scal=2", "unknown config key 'loss.scal'; valid keys of loss: name, kl_coef, "),
            ("rollout.toy.wide=2", "unknown config key 'rollout.toy.wide'; valid keys of "
                                   "rollout.toy: "),
            ("rollout.toy.width=wide", "rollout.toy.width=wide: expected int"),
            ("rollout.toys.width=2", "unknown config key 'rollout.toys' (not a backend that "
                                     "declares settings: is its plugin imported?); "),
            ("rollout.toy=2", "rollout.toy is a section; set one of its keys"),
            ("loss.scale.x=2", "loss.scale.x: not a key of loss or its part's settings")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, ["loss.name=scaled", "rollout.backend=toy", override])
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def test_defaults_are_none_and_saved_spelled_out(registered, tmp_path):
    """Settings at their part's defaults are None (derived at use, so a replaced name takes its
    own), a saved config spells them out, and loading it gives the same config."""
    cfg = load_config(None, ["loss.name=scaled", "loss.scale=1.0", "rollout.backend=toy"])
    assert cfg.loss.settings is None and cfg.rollout.settings == {}
    saved = config_to_dict(cfg)
    assert (saved["loss"]["scale"], saved["loss"]["eps_low"]) == (1.0, 0.1)
    assert saved["rollout"]["toy"] == {"width": 3, "label": "w"}
    assert config_from_dict(saved) == cfg
    given = load_config(None, ["loss.name=scaled", "loss.eps_low=0.3", "rollout.backend=toy",
                               "rollout.toy.label=x"])
    assert config_from_dict(config_to_dict(given)) == given
    assert settings_may_change(config_to_dict(given)) == ("rollout.toy.label",)


def test_the_listing_shows_each_parts_settings_with_its_defaults(registered):
    text = describe_config()
    loss = text[text.index("[loss, loss.name=scaled] the loss's own settings"):].splitlines()
    assert loss[1:3] == ["loss.eps_low: float = 0.1", "    Lower clip range, ratio >= 1 - "
                         "eps_low, in [0, 1); the paper's (sec. 5.1): 3e-4 for"]
    assert "loss.scale: float = 1.0" in loss[:12]
    assert "rollout.toy.label: str = 'w'  (a resume may change it)" in text.splitlines()


def test_a_settings_class_must_be_frozen_and_documented(registered):
    @dataclass
    class Loose:
        """Not frozen."""
        x: int = 1
        """An x."""

    @dataclass(frozen=True)
    class Bare:
        """An undocumented field."""
        x: int = 1

    for cls, defaults, says in [(Loose, None, "is not a frozen dataclass"),
                                (Bare, None, "fields without a docstring under them: ['x']"),
                                (Widths, {"wide": 1}, "defaults name no field: ['wide']")]:
        with pytest.raises(TypeError, match=says.replace("[", r"\[").replace("]", r"\]")):
            parts.register_settings("backend", "other", cls, defaults=defaults)
    with pytest.raises(TypeError, match="'toy' already declares settings"):
        parts.register_settings("backend", "toy", Widths)
