"""scripts/speculation_ceiling.py: the ceiling arithmetic on hand-made costs, and a short
real measurement of a tiny int4 engine (llama.cpp rows left out with the reason)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("speculation_ceiling", ROOT / "scripts" / "speculation_ceiling.py")
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)


def _costs(target: dict, draft: float) -> dict:
    return dict(target={str(q): dict(median=v) for q, v in target.items()}, draft={"1": dict(median=draft)})


def test_medians_and_quartiles_per_key():
    s = [dict(t={"1": x}) for x in (1.0, 2.0, 3.0, 4.0, 100.0)]
    m = sc.medians(s)["t"]["1"]
    assert m == dict(median=3.0, q25=2.0, q75=4.0)


def test_ceiling_of_a_round_and_the_tokens_a_goal_needs():
    # target 2 ms at q=1, +1 ms per extra position; draft 0.5 ms; baseline 2 ms per token
    c = _costs({1: 2.0, 2: 3.0, 3: 4.0}, 0.5)
    L = {"k1": dict(tokens_per_pass=1.5), "k2": dict(tokens_per_pass=2.0)}
    r = sc.ceilings(c, L, [1, 2], baseline_ms=2.0)
    assert r["1"]["round_ms"] == pytest.approx(3.5)  # c_t(2) + 1 x c_d
    assert r["1"]["ceiling_tok_s"] == pytest.approx(2000 / 3.5)
    assert r["1"]["ceiling_vs_baseline"] == pytest.approx(2 * 2.0 / 3.5)
    assert r["1"]["at_measured_L_vs_baseline"] == pytest.approx(1.5 * 2.0 / 3.5)
    assert r["2"]["round_ms"] == pytest.approx(5.0)  # c_t(3) + 2 x c_d
    assert r["2"]["tokens_per_pass_for_1.5x"] == pytest.approx(1.5 * 5.0 / 2.0)  # 3.75 > k+1 = 3: out of reach


def test_min_q_widens_a_narrow_verification():
    # exact_min_q 2: a k=0-like 1-row round is paid at width 2 (and k=1 is unchanged)
    c = _costs({1: 1.0, 2: 3.0}, 0.0)
    assert sc.ceilings(c, None, [1], baseline_ms=1.0, min_q=2)["1"]["round_ms"] == pytest.approx(3.0)
    assert "at_measured_L_tok_s" not in sc.ceilings(c, None, [1], baseline_ms=1.0)["1"]


def test_a_short_run_on_int4_engines(int4_pair, tmp_path, capsys):
    out = tmp_path / "c.json"
    rec = sc.main(["--engines", str(int4_pair[2]), "--k", "1,2", "--rounds", "1", "--reps", "2", "--max-batch", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec))
    assert rec["llama_cpp"]["reason"].startswith("not measured: needs --llama-python")
    t = rec["specrt"]["costs_ms"]["target"]
    assert set(t) == {"1", "2", "3"} and all(v["median"] > 0 for v in t.values())
    assert set(rec["specrt"]["batched_tok_s"]) == {"1", "2"}
    assert rec["specrt"]["min_q"] >= 1 and rec["tokens_per_pass"] is None
