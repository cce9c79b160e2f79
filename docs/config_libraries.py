"""Which of megatron-gspo's six config guarantees a config library keeps (docs/config.md),
measured on a tiny schema through each library's own loading path, with no glue code beyond
its documented API. Run it in a scratch venv, not the project's:

    python -m venv runs/config_libraries && runs/config_libraries/bin/pip install omegaconf \
        draccus tyro jsonargparse docstring-parser \
        && runs/config_libraries/bin/python docs/config_libraries.py

G1 unknown key: an error naming the key and the valid ones
G2 duplicate YAML key: an error
G3 malformed YAML: an error naming line and column
G4 `base: other.yaml` inheritance
G5 `a.b=c` overrides with YAML values (off stays the word 'off', 3e-4 is a float)
G6 a listing of every key with its default and docstring
"""
import contextlib
import io
import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class Train:
    steps: int = 20
    """Rollout batches per run."""
    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Routing Replay mode."""


@dataclass
class Loss:
    eps_low: Optional[float] = None
    """Lower clip range."""


@dataclass
class Cfg:
    run_dir: str = "runs/default"
    """Output directory."""
    train: Train = field(default_factory=Train)
    """RL loop."""
    loss: Loss = field(default_factory=Loss)
    """Policy loss."""


D = tempfile.mkdtemp()
FILES = {"unknown.yaml": "train:\n  stepz: 1\n",
         "dup.yaml": "train:\n  steps: 1\n  steps: 2\n",
         "bad.yaml": "train:\n  steps: [1\n",
         "base.yaml": "run_dir: runs/base\ntrain:\n  steps: 7\n",
         "child.yaml": "base: base.yaml\ntrain:\n  routing_replay: r2\n"}
for k, v in FILES.items():
    open(os.path.join(D, k), "w").write(v)
P = lambda name: os.path.join(D, name)


def one_line(e):
    return " ".join(f"{type(e).__name__}: {e}".split())[:230]


def attempt(fn):
    """(result, error text, captured stderr): argparse-style libraries print and exit."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return fn(), None, err.getvalue()
    except SystemExit as e:
        tail = " ".join(err.getvalue().split())[-230:]
        return None, f"SystemExit({e.code}) {tail}", err.getvalue()
    except Exception as e:
        return None, one_line(e), err.getvalue()


def report(lib, g, ok, detail):
    print(f"{lib:13s} {g}  {'kept ' if ok else 'BROKE'}  {detail}")


def check(lib, load_file, load_overrides, help_text):
    r, e, _ = attempt(lambda: load_file(P("unknown.yaml")))
    report(lib, "G1", bool(e) and "stepz" in e and "routing_replay" in e, e or f"loaded: {r}")
    r, e, _ = attempt(lambda: load_file(P("dup.yaml")))
    report(lib, "G2", bool(e) and "duplicate" in e, e or f"loaded silently: {r}")
    r, e, _ = attempt(lambda: load_file(P("bad.yaml")))
    report(lib, "G3", bool(e) and ("line 3" in e or ":3:" in e) and "column" in e, e)
    r, e, _ = attempt(lambda: load_file(P("child.yaml")))
    ok = r is not None and r.run_dir == "runs/base" and r.train.steps == 7 \
        and r.train.routing_replay == "r2"
    report(lib, "G4", ok, e or f"loaded: {r}")
    r, e, _ = attempt(lambda: load_overrides(["train.steps=5", "train.routing_replay=off",
                                              "loss.eps_low=3e-4"]))
    ok = r is not None and r.train.steps == 5 and r.train.routing_replay == "off" \
        and r.loss.eps_low == 3e-4
    report(lib, "G5", ok, e or f"got: {r}")
    text, e, _ = attempt(help_text)
    text = text or ""
    want = ["train.steps", "20", "Rollout batches per run.", "loss.eps_low", "Lower clip range."]
    report(lib, "G6", all(w in text for w in want),
           e or f"missing from the listing: {[w for w in want if w not in text]}")


# ------------------------------------------------------------------ OmegaConf structured configs
from omegaconf import OmegaConf

def oc_file(path):
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Cfg), OmegaConf.load(path)))

def oc_over(items):
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Cfg),
                                               OmegaConf.from_dotlist(items)))

def oc_help():  # OmegaConf has no help / listing: the closest is the YAML of the defaults
    return OmegaConf.to_yaml(OmegaConf.structured(Cfg))

check("omegaconf", oc_file, oc_over, oc_help)

# ------------------------------------------------------------------ draccus
import draccus

def dr_file(path):
    return draccus.parse(Cfg, config_path=path, args=[])

def dr_over(items):
    return draccus.parse(Cfg, args=["--" + i for i in items])

def dr_help():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            draccus.parse(Cfg, args=["--help"])
        except SystemExit:
            pass
    return out.getvalue()

check("draccus", dr_file, dr_over, dr_help)

# ------------------------------------------------------------------ tyro
import tyro

def ty_file(path):  # tyro's one YAML reader; a file's values become the defaults of the CLI
    return tyro.cli(Cfg, args=[], default=tyro.extras.from_yaml(Cfg, open(path)))

def ty_over_eq(items):
    return tyro.cli(Cfg, args=["--" + i for i in items])

def ty_help():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            tyro.cli(Cfg, args=["--help"], use_underscores=True)
        except SystemExit:
            pass
    return out.getvalue()

check("tyro", ty_file, ty_over_eq, ty_help)

# ------------------------------------------------------------------ jsonargparse
from jsonargparse import ArgumentParser, set_parsing_settings

set_parsing_settings(docstring_parse_attribute_docstrings=True)

def ja_parser():
    p = ArgumentParser(exit_on_error=False)
    p.add_class_arguments(Cfg)  # the dataclass's fields at the top level
    p.add_argument("--config", action="config")
    return p

def ja_file(path):
    ns = ja_parser().parse_args(["--config", path])
    return _as_cfg(ns)

def _as_cfg(ns):
    d = ns.as_dict()
    d.pop("config", None)
    return Cfg(run_dir=d["run_dir"], train=Train(**d["train"]), loss=Loss(**d["loss"]))

def ja_over(items):
    return _as_cfg(ja_parser().parse_args(["--" + i for i in items]))

def ja_help():
    return ja_parser().format_help()

check("jsonargparse", ja_file, ja_over, ja_help)
