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
        "exact": dict(ppl_ratio={"code": 1.0, "prose": 1.0}, step_ms={"1": 100.0}),
        "requantize": dict(ppl_ratio={"code": 1.061, "prose": 1.086}, step_ms={"1": 80.0}),
        "close": dict(ppl_ratio={"code": 1.009, "prose": 1.004}, step_ms={"1": 90.0}),
        "close on code only": dict(ppl_ratio={"code": 1.001, "prose": 1.02}, step_ms={"1": 85.0}),
    }
    got = fq.choose(flavors, ["code", "prose"], 1.01)
    assert got["flavor"] == "close"
    assert got["eligible"] == ["close", "exact"]
    # a looser bound lets the fastest in
    assert fq.choose(flavors, ["code", "prose"], 1.09)["flavor"] == "requantize"
    # nothing faster within the bound: the reference stays
    assert fq.choose({k: flavors[k] for k in ("exact", "requantize")}, ["code", "prose"], 1.01)["flavor"] == "exact"


def test_paired_figures():
    ref = Scores(np.array([1, 2, 3, 4]), np.log(np.array([0.5, 0.25, 0.5, 0.125])))
    got = Scores(np.array([1, 2, 0, 4]), np.log(np.array([0.25, 0.25, 0.5, 0.125])))
    p = fq.paired(ref, got)
    assert p["top1_agreement"] == 0.75
    assert p["loss_delta"] == pytest.approx(math.log(2) / 4)
    assert p["ppl_ratio"] == pytest.approx(2 ** 0.25)
    assert p["loss_delta_se"] == pytest.approx(np.std([math.log(2), 0, 0, 0], ddof=1) / 2)


def test_two_copies_of_an_engine_score_the_same_and_the_faster_is_chosen(tmp_path):
    """The whole script on the embedded pair: a copy of the engine scores bit-identically
    (ratio 1, agreement 1, as many positions as the llama.cpp protocol scores: windows x
    (n_ctx - 1 - n_ctx / 2)), and the record holds the timing the choice used."""
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "engines" / "default", copy)
    out = tmp_path / "fq.json"
    assert fq.main(["--engines", str(REPO / "engines" / "default"), "--engines", str(copy), "--windows", "2", "--n-ctx", "64", "--time-reps", "2", "--out", str(out)]) == 0
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
    steps = {lab: rec["systems"][lab]["step_ms"]["1"] for lab in labels}
    assert rec["choice"]["flavor"] == min(steps, key=steps.get)
