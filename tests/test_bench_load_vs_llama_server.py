"""bench.load_vs_llama_server's pure parts: the interleaved schedule, the ratios it reports
(to the fastest llama-server mode and to specrt's single-request target-only), its mode flags."""

import pytest

from specrt.bench.load_vs_llama_server import schedule, summarize
from specrt.bench.servers import llama_mode_flags


def test_schedule_runs_each_system_once_per_step_rotating_and_the_baseline_at_one_request():
    order = schedule(["S", "L"], [2, 4], 2, "B")
    assert len(order) == 2 * (2 + 2) + 2
    for r in range(2):
        for c in (2, 4):
            assert sorted(n for rr, cc, n in order if rr == r and cc == c) == ["L", "S"]
        assert [cc for rr, cc, n in order if rr == r and n == "B"] == [1]
    for c in (2, 4):  # at one C, who goes first changes from one repeat to the next
        firsts = [next(n for rr, cc, n in order if rr == r and cc == c) for r in range(2)]
        assert firsts[0] != firsts[1], (c, firsts)
    for levels in ([1, 2, 4, 8], [4, 8]):  # also when the systems' count divides the levels'
        order = schedule(["S", "L"], levels, 2, None)
        for c in levels:
            assert len({next(n for rr, cc, n in order if rr == r and cc == c) for r in range(2)}) == 2, (levels, c)
    assert all(n != "B" for *_, n in schedule(["S"], [1], 1, None))


def test_summarize_takes_medians_and_ratios_to_the_fastest_mode_and_the_baseline():
    tps = {("S", 1): [40, 44, 42], ("S", 4): [120, 100, 110], ("L1", 1): [30, 30, 30], ("L1", 4): [35, 35, 35]}
    tps |= {("L2", 1): [20, 20, 20], ("L2", 4): [50, 55, 60], ("B", 1): [25, 26, 24]}
    runs = [dict(system=n, concurrency=c, repeat=i, summary=dict(completion_tokens_per_s=v)) for (n, c), vs in tps.items() for i, v in enumerate(vs)]
    out = summarize(runs, [1, 4], "S", ["L1", "L2"], "B")
    assert out["completion_tokens_per_s"]["S"] == {"1": 42, "4": 110}
    assert out["completion_tokens_per_s"]["B"] == {"1": 25}
    assert out["specrt_ratios"]["1"] == dict(fastest_llama_server="L1", vs_fastest_llama_server=1.4, vs_single_request_target_only=1.68)
    assert out["specrt_ratios"]["4"] == dict(fastest_llama_server="L2", vs_fastest_llama_server=2.0, vs_single_request_target_only=4.4)
    assert summarize(runs[:-3], [1, 4], "S", ["L1"], None)["specrt_ratios"]["4"]["vs_single_request_target_only"] is None
    only4 = summarize([r for r in runs if r["concurrency"] == 4 or r["system"] == "B"], [4], "S", ["L1", "L2"], "B")
    assert only4["completion_tokens_per_s"]["B"] == {"1": 25}  # the baseline at one request, C = 1 not asked for
    assert only4["specrt_ratios"]["4"]["vs_single_request_target_only"] == 4.4


def test_an_empty_mode_list_is_refused_before_any_server_starts(capsys):
    from specrt.bench.load_vs_llama_server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--gguf", "t.gguf", "--llama-server", "ls", "--out", "o.json", "--llama-modes", ","])
    assert "--llama-modes names no mode" in capsys.readouterr().err


def test_llama_modes_give_their_flags_and_refuse_what_they_cannot_run():
    assert llama_mode_flags("target-only", None, 2) == []
    assert llama_mode_flags("ngram-simple", None, 2) == ["--spec-type", "ngram-simple"]
    draft = llama_mode_flags("draft-simple", "d.gguf", 2)
    assert draft[:2] == ["--spec-type", "draft-simple"] and draft[draft.index("--spec-draft-model") + 1] == "d.gguf"
    with pytest.raises(SystemExit, match="needs --draft-gguf"):
        llama_mode_flags("draft-simple", None, 2)
    with pytest.raises(SystemExit, match="allowed: target-only, ngram-simple, draft-simple"):
        llama_mode_flags("ngram", None, 2)
