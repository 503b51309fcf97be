"""scripts/flavor_quality.py: the default-flavor rule and the paired perplexity figures (issue 31.3)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from specrt.runtime.lab.quality import Scores

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("flavor_quality", REPO / "scripts" / "flavor_quality.py")
fq = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fq)


def test_choose_takes_the_fastest_flavor_within_the_bound_on_every_set():
    flavors = {
        "exact": dict(ppl_ratio={"code": 1.0, "prose": 1.0}, min_q=2, step_ms={"1": 50.0, "2": 100.0}),
        "requantize": dict(ppl_ratio={"code": 1.061, "prose": 1.086}, min_q=2, step_ms={"1": 40.0, "2": 80.0}),
        # fastest at 1 row, but its target-only decoding calls 2 rows
        "close": dict(ppl_ratio={"code": 1.009, "prose": 1.004}, min_q=2, step_ms={"1": 10.0, "2": 95.0}),
        "close, 1-row": dict(ppl_ratio={"code": 1.009, "prose": 1.004}, min_q=1, step_ms={"1": 90.0, "2": 70.0}),
        "close on code only": dict(ppl_ratio={"code": 1.001, "prose": 1.02}, min_q=1, step_ms={"1": 85.0}),
    }
    got = fq.choose(flavors, ["code", "prose"], 1.01)
    assert got["flavor"] == "close, 1-row"
    assert got["eligible"] == ["close", "close, 1-row", "exact"]
    # a looser bound lets the fastest in
    assert fq.choose(flavors, ["code", "prose"], 1.09)["flavor"] == "requantize"
    # nothing faster within the bound: the reference stays
    assert fq.choose({k: flavors[k] for k in ("exact", "requantize")}, ["code", "prose"], 1.01)["flavor"] == "exact"
    assert fq.choose({k: flavors[k] for k in ("exact", "close")}, ["code", "prose"], 1.01)["flavor"] == "close"
    with pytest.raises(ValueError, match="no flavor within"):
        fq.choose(flavors, ["code", "prose"], 0.99)


def test_paired_figures():
    ref = Scores(np.array([1, 2, 3, 4]), np.log(np.array([0.5, 0.25, 0.5, 0.125])))
    got = Scores(np.array([1, 2, 0, 4]), np.log(np.array([0.25, 0.25, 0.5, 0.125])))
    p = fq.paired(ref, got)
    assert p["top1_agreement"] == 0.75
    assert p["loss_delta"] == pytest.approx(math.log(2) / 4)
    assert p["ppl_ratio"] == pytest.approx(2**0.25)
    assert p["loss_delta_se"] == pytest.approx(np.std([math.log(2), 0, 0, 0], ddof=1) / 2)


def test_two_copies_of_an_engine_score_the_same_and_the_faster_is_chosen(tmp_path):
    """The whole script on the embedded pair: a copy of the engine scores bit-identically
    (ratio 1, agreement 1, as many positions as the llama.cpp protocol scores: windows x
    (n_ctx - 1 - n_ctx / 2)), and the record holds the timing the choice used."""
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "engines" / "default", copy)
    out = tmp_path / "fq.json"
    assert (
        fq.main(
            ["--engines", str(REPO / "engines" / "default"), "--engines", str(copy), "--windows", "2", "--n-ctx", "64", "--time-reps", "2", "--out", str(out)]
        )
        == 0
    )
    rec = json.loads(out.read_text())
    labels = list(rec["systems"])
    assert rec["reference"] == labels[0] and len(labels) == 2
    other = rec["systems"][labels[1]]
    for s in ("code", "prose"):
        assert other[s]["positions"] == 2 * (64 - 1 - 32)
        assert other[s]["vs_reference"]["ppl_ratio"] == 1.0
        assert other[s]["vs_reference"]["top1_agreement"] == 1.0
        assert rec["agreement"][s][labels[0]][labels[1]] == 1.0
        assert 1.0 < other[s]["ppl"] < 1e4
    for lab in labels:
        r = rec["systems"][lab]
        assert r["min_q"] >= 1 and str(r["min_q"]) in r["step_ms"] and "1" in r["step_ms"]
    steps = {lab: rec["systems"][lab]["step_ms"][str(rec["systems"][lab]["min_q"])] for lab in labels}
    assert rec["choice"]["flavor"] == min(steps, key=steps.get)


class Uniform:
    """A model whose logits are all equal: its perplexity is the vocabulary size exactly."""

    max_q = max_ctx = 1024

    def __init__(self, vocab: int):
        self.vocab = vocab

    def run(self, tokens, start):
        return np.zeros((len(tokens), self.vocab), np.float32)

    def close(self):
        pass


def test_a_uniform_model_scores_the_vocabulary_size_and_the_labels_must_differ(tmp_path, monkeypatch):
    """The protocol end to end on a model of known perplexity: a model with equal logits has
    perplexity = vocabulary size on every scored position; its agreement with the engine is
    the engine's argmax == 0 share; two folders of one name are refused."""
    from specrt.runtime.manifest import load_manifest

    eng = REPO / "engines" / "default"
    vocab = load_manifest(eng).vocab_size
    real = fq.cpu_model
    monkeypatch.setattr(fq, "cpu_model", lambda folder, *a, **k: Uniform(vocab) if Path(folder).name == "uniform" else real(folder, *a, **k))
    uni = tmp_path / "uniform"
    shutil.copytree(eng, uni)
    out = tmp_path / "u.json"
    assert fq.main(["--engines", str(eng), "--engines", str(uni), "--windows", "2", "--n-ctx", "64", "--time-reps", "0", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    ref, lab = list(rec["systems"])
    for s in ("code", "prose"):
        u = rec["systems"][lab][s]
        assert u["ppl"] == pytest.approx(vocab, rel=1e-9)
        assert u["vs_reference"]["ppl_ratio"] == pytest.approx(vocab / rec["systems"][ref][s]["ppl"], rel=1e-9)
        assert rec["agreement"][s][ref][lab] < 0.5
    twin = tmp_path / "b" / "default"
    shutil.copytree(eng, twin)
    with pytest.raises(SystemExit, match="both be labelled"):
        fq.main(["--engines", str(eng), "--engines", str(twin), "--windows", "2", "--n-ctx", "64", "--time-reps", "0"])
