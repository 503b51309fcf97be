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
    assert rep["peak_ratio_end_over_warmup"] <= 1.05
    # the mix ran: every mode, every invalid call refused (and only those), a result with a
    # finish reason from every generate and stream, both endings
    modes, finish = rep["modes"], rep["finish_reasons"]
    assert min(modes[m] for m in ("generate", "stream", "stream-close", "invalid")) >= 1 and modes["forks"] >= 2, modes
    assert modes["refused"] == modes["invalid"], modes
    assert sum(finish.values()) == modes["generate"] + modes["stream"] and {"stop", "length"} <= set(finish), (finish, modes)
    # outputs as long as the mix asks: its budgets average 20 tokens (14 warm-up calls 64);
    # measured 2,634 over 112 results (AMD Zen 5, 2026-12-05); 1-token outputs give 14 x 64 + 98 = 994
    assert rep["new_tokens"] >= 15 * (modes["generate"] + modes["stream"]), rep["new_tokens"]
