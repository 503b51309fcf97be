"""specrt.bench.ceiling (bench/ceiling.py): the ceiling arithmetic on hand-made costs, and a short
real measurement of a tiny int4 engine (llama.cpp rows left out with the reason)."""

from __future__ import annotations

import json
import sys

import pytest

from specrt.bench import ceiling as sc


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
    # exact_min_q 3: a k = 1 round (2 positions) is paid at width 3
    c = _costs({1: 1.0, 2: 2.0, 3: 5.0}, 0.0)
    assert sc.ceilings(c, None, [1], baseline_ms=1.0, min_q=3)["1"]["round_ms"] == pytest.approx(5.0)
    assert sc.ceilings(c, None, [1], baseline_ms=1.0, min_q=1)["1"]["round_ms"] == pytest.approx(2.0)
    assert "at_measured_L_tok_s" not in sc.ceilings(c, None, [1], baseline_ms=1.0)["1"]


def test_best_picks_the_highest_ceiling_and_measured_rate():
    c = _costs({1: 1.0, 2: 2.0, 3: 2.2, 4: 6.0}, 0.0)
    L = {"k1": dict(tokens_per_pass=1.9), "k2": dict(tokens_per_pass=2.0)}
    b = sc.best(sc.ceilings(c, L, [1, 2, 3], baseline_ms=1.0))
    assert b["ceiling"] == dict(k=2, vs_baseline=pytest.approx(3 / 2.2))  # k3: 4 / 6.0 < 3 / 2.2
    assert b["at_measured_L"] == dict(k=1, vs_baseline=pytest.approx(1.9 / 2.0))  # k2: 2.0 / 2.2


def test_medians_refuses_no_samples():
    with pytest.raises(ValueError, match="no repetitions"):
        sc.medians([])


FAKE_LLAMA = """import json, sys
a = json.loads(sys.argv[1])
if a["target"] == "broken.gguf":
    sys.exit("llama.cpp cannot load broken.gguf")
print(json.dumps(dict(target={str(q): 1.0 + 0.5 * (q - 1) for q in range(1, a["q_max"] + 1)},
                      draft={"1": 0.25}, batched={str(b): 1.0 * b for b in range(1, a["max_batch"] + 1)})))
"""


@pytest.fixture(scope="module")
def short_run(int4_pair, tmp_path_factory):
    """One short run on a tiny int4 engine with a stand-in for llama-cpp-python's python
    that prints fixed costs (target 1 ms + 0.5 ms per extra position, draft 0.25 ms)."""
    d = tmp_path_factory.mktemp("ceiling")
    fake = d / "fake_llama.py"
    fake.write_text(FAKE_LLAMA)
    wrapper = d / "python"
    wrapper.write_text(f'#!/bin/sh\nshift\nshift\nexec {sys.executable} {fake} "$@"\n')  # drops '-c SNIPPET'
    wrapper.chmod(0o755)
    out = d / "c.json"
    args = ["--engines", str(int4_pair[2]), "--k", "1,2", "--rounds", "2", "--reps", "2", "--max-batch", "2", "--out", str(out)]
    rec = sc.main(args + ["--llama-python", str(wrapper), "--gguf-target", "t.gguf", "--gguf-draft", "d.gguf"])
    return rec, out, wrapper, args


def test_a_short_run_records_consistent_figures(short_run):
    rec, out, _, _ = short_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec))
    s = rec["specrt"]
    t = s["costs_ms"]["target"]
    assert set(t) == {"1", "2", "3"} and all(v["q25"] <= v["median"] <= v["q75"] for v in t.values())
    assert s["target_only_ms_per_token"] == t[str(s["min_q"])]["median"]
    for b, v in s["batched_tok_s"].items():
        assert v == pytest.approx(1e3 * int(b) / s["costs_ms"]["batched"][b]["median"])
    rows = s["speculation_vs_own_target_only"]["rows"]
    assert set(rows) == {"1", "2"}
    assert rows["2"]["round_ms"] == pytest.approx(t["3"]["median"] + 2 * s["costs_ms"]["draft"]["1"]["median"])


def test_llama_rows_from_the_stand_in(short_run):
    rec, *_ = short_run
    ll = rec["llama_cpp"]
    assert ll["target_only_ms_per_token"] == 1.0
    rows = ll["speculation_on_its_kernels_vs_its_target_only"]["rows"]
    assert rows["1"]["round_ms"] == pytest.approx(1.5 + 0.25)  # c(2) + 1 draft step
    assert rows["2"]["ceiling_vs_baseline"] == pytest.approx(3 * 1.0 / (2.0 + 0.5))
    assert ll["batched_tok_s"] == {"1": pytest.approx(1000.0), "2": pytest.approx(1000.0)}
    assert rec["specrt"]["speculation_vs_llama_cpp_target_only"]["rows"]["1"]["ceiling_vs_baseline"] > 0


def test_a_failing_llama_measurement_is_a_reason_not_a_crash(short_run):
    _, _, wrapper, args = short_run
    rec = sc.main(args + ["--llama-python", str(wrapper), "--gguf-target", "broken.gguf", "--gguf-draft", "d.gguf"])
    assert rec["llama_cpp"] == dict(reason="llama.cpp measurement failed (exit 1): llama.cpp cannot load broken.gguf")
    assert "speculation_vs_llama_cpp_target_only" not in rec["specrt"]


def test_without_llama_python_the_rows_say_why(short_run):
    _, _, _, args = short_run
    rec = sc.main(args)
    assert rec["llama_cpp"]["reason"].startswith("not measured: needs --llama-python")
    assert rec["tokens_per_pass"] is None and "batching" not in rec


def test_k_beyond_the_engines_is_refused(int4_pair, capsys):
    with pytest.raises(SystemExit):
        sc.main(["--engines", str(int4_pair[2]), "--k", "2,9", "--rounds", "1", "--reps", "1"])
    assert "--k 2,9: every k must be in 1..8 (these engines' k_max)" in capsys.readouterr().err
