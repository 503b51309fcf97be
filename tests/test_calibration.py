"""Draft calibration (runtime/calibration.py): ECE against hand-computed values, the
temperature fit recovers a known temperature, the calibrated threshold never changes the
greedy output, T = 1 is bit-identical, teacher-forced labels agree with a trace."""

from __future__ import annotations

import numpy as np
import pytest

from specrt import Engine, GenerationConfig
from specrt.runtime.errors import InputError
from specrt.runtime.lab.calibration import (
    bin_index,
    binary_nll,
    calibrate,
    expected_calibration_error,
    fit_temperature,
    plot_reliability,
    reliability,
    teacher_forced,
    top1_confidences,
)
from specrt.runtime.lab.replay import position_views
from specrt.runtime.lab.trace import TraceWriter, load_trace
from specrt.runtime.speculative import top1

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "x", "import os\n"]


@pytest.fixture(scope="module")
def engine(noisy_pair):
    return Engine(noisy_pair[1])


# ---- pure functions -------------------------------------------------------------------------
def test_ece_hand_computed():
    # 10 bins ((m-1)/10, m/10]: one position per bin, |acc - conf| = .05 .85 .25 .15 .05
    conf = np.array([0.05, 0.15, 0.25, 0.85, 0.95])
    labels = np.array([0, 1, 0, 1, 1], bool)
    assert expected_calibration_error(conf, labels, 10) == pytest.approx((0.05 + 0.85 + 0.25 + 0.15 + 0.05) / 5)
    # three in bin 7 (0.6, 0.7]: mean conf 0.64666.., accuracy 2/3; one in bin 1: |0 - 0.05|
    conf = np.array([0.62, 0.68, 0.64, 0.05])
    labels = np.array([1, 0, 1, 0], bool)
    want = 3 / 4 * abs(2 / 3 - (0.62 + 0.68 + 0.64) / 3) + 1 / 4 * 0.05
    assert expected_calibration_error(conf, labels, 10) == pytest.approx(want)
    # one bin: |mean accuracy - mean confidence|
    assert expected_calibration_error(conf, labels, 1) == pytest.approx(abs(0.5 - conf.mean()))
    # perfectly calibrated within bins
    assert expected_calibration_error(np.array([0.5, 0.5]), np.array([1, 0], bool), 15) == pytest.approx(0.0)


def test_bins_are_right_closed():
    assert bin_index(np.array([0.0, 0.1, 0.1000001, 0.5, 1.0]), 10).tolist() == [0, 0, 1, 4, 9]
    r = reliability(np.array([0.05, 0.55, 0.58]), np.array([1, 0, 1], bool), 10)
    assert r["count"] == [1, 0, 0, 0, 0, 2, 0, 0, 0, 0]
    assert r["accuracy"][5] == 0.5 and r["mean_conf"][5] == pytest.approx(0.565)
    assert np.isnan(r["accuracy"][1])


def test_bad_calibration_inputs():
    with pytest.raises(InputError, match="no \\(confidence, label\\) pairs"):
        expected_calibration_error(np.array([]), np.array([], bool))
    with pytest.raises(InputError, match="must lie in \\[0, 1\\]"):
        expected_calibration_error(np.array([1.5]), np.array([True]))
    with pytest.raises(InputError, match="one length"):
        expected_calibration_error(np.array([0.5, 0.2]), np.array([True]))
    with pytest.raises(InputError, match="each must be a finite number > 0"):
        top1_confidences(np.zeros((2, 3)), [0.0])


def test_top1_confidences_match_the_runtime():
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(6, 50)) * 3).astype(np.float32)
    ids, conf = top1_confidences(logits, [0.5, 1.0, 2.0], vocab=40)
    for i, row in enumerate(logits):
        for g, t in enumerate((0.5, 1.0, 2.0)):
            tok, c = top1(row, 40, np.empty(50, np.float32), 1.0 / t)
            assert tok == ids[i]
            assert c == pytest.approx(conf[i, g], rel=1e-5)


def test_temperature_one_is_bit_identical():
    rng = np.random.default_rng(1)
    for _ in range(20):
        row = (rng.normal(size=300) * 4).astype(np.float32)
        scratch = np.empty(300, np.float32)
        assert top1(row, 300, scratch, 1.0) == top1(row, 300, scratch)
        assert top1(row, 300, None, 1.0) == top1(row, 300)
        tok_t, _ = top1(row, 300, scratch, 1 / 0.3)
        assert tok_t == top1(row, 300)[0]  # the proposal never changes


@pytest.mark.parametrize("t_true", [0.4, 1.0, 2.5])
def test_fit_recovers_a_known_temperature(t_true):
    """Labels drawn as Bernoulli(conf at t_true): the NLL fit finds t_true (maximum likelihood)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(40000, 12)) * 2.0
    p = top1_confidences(logits, [t_true])[1][:, 0]
    labels = rng.random(len(p)) < p
    fit = fit_temperature(lambda g: top1_confidences(logits, g)[1], labels)
    assert fit.temperature == pytest.approx(t_true, rel=0.04)
    assert not fit.at_bound
    assert fit.nll <= fit.nll_at_1 + 1e-12
    # and calibration: ECE at the fitted T is small, at a wrong T larger
    c_fit = top1_confidences(logits, [fit.temperature])[1][:, 0]
    c_bad = top1_confidences(logits, [t_true * 3])[1][:, 0]
    assert expected_calibration_error(c_fit, labels) < 0.02 < expected_calibration_error(c_bad, labels)


def test_binary_nll():
    assert binary_nll(np.array([0.5, 0.5]), np.array([1, 0], bool)) == pytest.approx(np.log(2))
    two = binary_nll(np.array([[0.9, 0.5], [0.2, 0.5]]), np.array([1, 0], bool))
    assert two == pytest.approx([-(np.log(0.9) + np.log(0.8)) / 2, np.log(2)])


# ---- on an engine ------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.3, 0.5, 2.0])
def test_calibrated_threshold_keeps_greedy_output(engine, temperature):
    """Every strategy (chunked sizes its chunks from the same calibrated confidences)."""
    from specrt.runtime.config import STRATEGIES

    for prompt in PROMPTS:
        ids = engine.prompt_ids(prompt)
        base = engine.generate(ids, GenerationConfig(max_new_tokens=40, speculative=False))
        for strategy in STRATEGIES:
            for th in (0.1, 0.3, 0.6, 0.9):
                cfg = GenerationConfig(max_new_tokens=40, k_max=4, threshold=th, confidence_temperature=temperature, strategy=strategy)
                spec = engine.generate(ids, cfg)
                assert spec.tokens == base.tokens, (prompt, strategy, th)


def test_temperature_changes_only_the_confidence(engine):
    ids = engine.prompt_ids(PROMPTS[0])
    raw = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=4, threshold=0.3)).stats
    sharp = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=4, threshold=0.3, confidence_temperature=0.3)).stats
    assert sharp.proposed > raw.proposed  # sharper confidences pass the threshold more often
    one = engine.generate(ids, GenerationConfig(max_new_tokens=40, k_max=4, threshold=0.3, confidence_temperature=1.0)).stats
    assert (one.proposed, one.accepted_hist, one.draft_calls) == (raw.proposed, raw.accepted_hist, raw.draft_calls)


@pytest.mark.parametrize("bad", [0, -1.0, 0.001, 1000.0, float("nan"), True, "1"])
def test_bad_confidence_temperature(engine, bad):
    with pytest.raises(InputError, match=r"confidence_temperature=.*must be a number in \[0.01, 100\]"):
        engine.generate("x", GenerationConfig(confidence_temperature=bad))


def test_teacher_forced_labels_agree_with_a_trace(engine, tmp_path):
    ids = [engine.prompt_ids(p) for p in PROMPTS]
    path = tmp_path / "w.jsonl"
    with TraceWriter(path, engine) as tw:
        outs = [engine.generate(x, GenerationConfig(max_new_tokens=40, k_max=8, threshold=0.0), trace=tw).tokens for x in ids]
    tf = teacher_forced(engine, ids, outs)
    views = position_views(load_trace(path))
    match = np.concatenate([(v.on_tok == v.out)[1:] for v in views])
    conf = np.concatenate([v.on_conf[1:] for v in views])
    assert tf.labels.tolist() == match.tolist()
    assert np.allclose(tf.conf_at(np.array([1.0]))[:, 0], conf, atol=1e-5)


def test_calibrate_on_an_engine(engine, tmp_path):
    ids = [engine.prompt_ids(p) for p in PROMPTS]
    outs = [engine.generate(x, GenerationConfig(max_new_tokens=40)).tokens for x in ids]
    rep = calibrate(teacher_forced(engine, ids, outs))
    assert rep.n == sum(len(o) - 1 for o in outs) and rep.prompts == len(PROMPTS)
    assert 0.01 <= rep.temperature <= 100
    assert rep.nll_after <= rep.nll_before
    assert rep.ece_after < rep.ece_before  # this draft is under-confident at T = 1
    assert rep.ece_after_heldout is not None
    assert sum(rep.reliability_before["count"]) == rep.n
    assert "ECE" in rep.summary()
    pytest.importorskip("matplotlib")
    plot_reliability(rep, tmp_path / "rel.png")
    assert (tmp_path / "rel.png").stat().st_size > 1000
    with pytest.raises(InputError, match="two or more tokens"):
        teacher_forced(engine, ids[:1], [outs[0][:1]])
