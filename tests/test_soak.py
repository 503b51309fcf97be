"""A short soak (tests/soak.py, 120 generations) on the tiny pair: mixed prompts and settings, streams equal
to their results, invalid calls refused, forks made and dropped; the process's peak RSS
after the warm-up must stay within 5% (the 1,000-generation run: ``python tests/soak.py
--engines FOLDER``, docs/guide/hardening.md)."""

from __future__ import annotations

import json

import soak


def test_short_soak_holds_memory_and_outputs(tiny_pair, tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = soak.main(["--engines", str(tiny_pair[2]), "--n", "120", "--warmup", "30", "--threads", "1", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 0, rep
    assert rep["generations"] == 120 and rep["peak_ratio_end_over_warmup"] <= 1.05
    assert rep["modes"] and rep["finish_reasons"]  # the mix ran: several modes and endings
