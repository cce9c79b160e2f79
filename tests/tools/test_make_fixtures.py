"""tools/make_fixtures.py regenerates the committed fixture byte for byte."""

import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "make_fixtures.py")
_spec = importlib.util.spec_from_file_location("make_fixtures", _PATH)
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)

COMMITTED = os.path.join(os.path.dirname(__file__), "..", "fixtures", "gsm_tiny")


def test_regenerates_the_committed_fixture_bit_exactly(tmp_path):
    pytest.importorskip("tokenizers")
    paths = make_fixtures.write_fixtures(str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == sorted(os.listdir(COMMITTED))
    total = 0
    for path in paths:
        with open(path, "rb") as f, open(os.path.join(COMMITTED, os.path.basename(path)),
                                         "rb") as g:
            new, old = f.read(), g.read()
        assert new == old, f"{os.path.basename(path)} differs: rerun python tools/make_fixtures.py"
        total += len(new)
    assert total < 200_000


def test_rows_are_distinct_gsm8k_style_problems():
    rows = make_fixtures.make_rows(200, "train", seed=0)
    questions = [r["prompt"][0]["content"] for r in rows]
    assert len(set(questions)) == 200
    assert all(q.endswith(make_fixtures.INSTRUCTION) for q in questions)
    for r in rows:
        truth, solution = r["reward_model"]["ground_truth"], r["extra_info"]["answer"]
        assert solution.endswith(f"\n#### {truth}") and float(truth) >= 0
    # every template is used, and some answers are decimals (kind 5: a bill split four ways)
    assert {r["extra_info"]["index"] % 10 for r in rows} == set(range(10))
    assert any("." in r["reward_model"]["ground_truth"] for r in rows)
    # template 0 checked by hand: "Maya has 10 apples. Maya buys 9 packs with 8 apples ..."
    assert rows[0]["reward_model"]["ground_truth"] == str(10 + 9 * 8)
    assert json.loads(json.dumps(rows[0])) == rows[0]
