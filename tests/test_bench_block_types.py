"""The block-type matrix's harness (bench/block_types.py) and bench-real's llama-server arguments:
the draft-model mode names its type (``--spec-type draft-simple``; ``--spec-draft-model`` alone
never drafts in this llama.cpp), the combined row names both types in one flag, and the matrix's
ratios are the goals' (issue 52)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from specrt.bench import block_types as bt
from specrt.bench import real


def _ctx(draft_args: str = "", ngram_args: str = "") -> SimpleNamespace:
    a = SimpleNamespace(llama_server="srv", llama_draft_args=draft_args, llama_ngram_args=ngram_args, search_prompts=0, threads=2)
    return SimpleNamespace(a=a, py_ll="py", server="srv", srv=dict(threads=2), gguf=dict(draft="/m/d.gguf", target="/m/t.gguf"), skip=set())


def _spec_types(args: list) -> list[str]:
    return [args[i + 1] for i, x in enumerate(args) if x == "--spec-type"]


def test_llama_server_draft_rows_name_draft_simple_once():
    rows = real.llama_server_rows(_ctx(), real.search_llama_server(_ctx(), {}))
    args = {r["label"].split(" (")[0]: r["init"]["variant"]["args"] for r in rows}
    assert args["llama-server target-only"] == []
    assert _spec_types(args["llama-server draft"]) == ["draft-simple"]
    assert "/m/d.gguf" in args["llama-server draft"]
    assert _spec_types(args["llama-server n-gram"]) == ["ngram-simple"]
    both = args["llama-server n-gram + draft"]
    assert _spec_types(both) == ["ngram-simple,draft-simple"]
    assert both.count("--spec-draft-model") == 1


def test_fixed_llama_server_settings_replace_the_search():
    c = _ctx("--spec-type draft-simple --spec-draft-model DRAFT --spec-draft-n-max 8", "--spec-type ngram-mod")
    c.a.search_prompts = 2  # would search; both settings are given, so it must not start a server
    best = real.search_llama_server(c, {})
    assert best["draft"] == ["--spec-type", "draft-simple", "--spec-draft-model", "/m/d.gguf", "--spec-draft-n-max", "8"]
    assert best["ngram"] == ["--spec-type", "ngram-mod"]
    both = real.llama_server_rows(c, best)[-1]["init"]["variant"]["args"]
    assert _spec_types(both) == ["ngram-mod,draft-simple"] and both[both.index("--spec-draft-n-max") + 1] == "8"


def _bench(tps: dict, equal: int = 4) -> dict:
    rows = [dict(label=label, tokens_per_second=v) for label, v in tps.items()]
    for r in rows:
        if r["label"].startswith("specrt speculative"):
            r.update(equal_to_own_target_only=equal, acceptance_rate=0.8)
    return dict(rows=rows)


def test_matrix_row_ratios_are_over_llama_servers_target_only_and_fastest_row():
    b = _bench(
        {
            "specrt target-only (exact width)": 19.0,
            "specrt target-only (fastest width)": 26.0,
            "specrt speculative (k=8 th=0.3)": 40.0,
            "llama-server target-only": 20.0,
            "llama-server draft (--spec-type draft-simple ...)": 25.0,
            "llama-server n-gram (--spec-type ngram-simple)": 16.0,
            "llama-server n-gram + draft": 24.0,
        }
    )
    m = bt.matrix_row("Q8_0", b)
    assert m["specrt_target_only"] == 26.0 and m["specrt_target_only_exact"] == 19.0 and m["llama_draft"] == 25.0
    assert m["specrt_target_only_over_llama_target_only"] == 1.3
    assert m["specrt_speculative_over_llama_target_only"] == 2.0
    assert m["specrt_speculative_over_llama_fastest"] == 1.6
    assert m["specrt_speculative_equal"] == 4 and m["specrt_speculative_acceptance"] == 0.8
    table = bt.format_table([dict(m, bytes=1.6e9)])
    assert "| Q8_0 | 1600 | 26.0 | 40.0 | 20.0 | 25.0 | 16.0 | 24.0 | 4 | 1.30 | 2.00 | 1.60 |" in table
    assert table.splitlines()[1].count("---") == table.splitlines()[0].count("|") - 1


def test_a_missing_llama_server_row_gives_no_ratio():
    m = bt.matrix_row("F16", _bench({"specrt target-only (fastest width)": 10.0}))
    assert m["llama_target_only"] is None and "specrt_target_only_over_llama_target_only" not in m
    assert "| F16 | 1 | 10.0 | - | - |" in bt.format_table([dict(m, bytes=1e6)])


def test_the_source_type_is_the_file_itself_and_a_missing_quantizer_is_one_line(tmp_path):
    src = tmp_path / "t.gguf"
    src.write_bytes(b"x")
    assert bt.quantized_file(src, bt.SOURCE, tmp_path, Path("/nonexistent")) == (src, None)
    (tmp_path / "t-Q8_0.gguf").write_bytes(b"y")  # made before: reused
    assert bt.quantized_file(src, "Q8_0", tmp_path, Path("/nonexistent")) == (tmp_path / "t-Q8_0.gguf", None)
    with pytest.raises(SystemExit, match="no llama-quantize at /nonexistent"):
        bt.quantized_file(src, "Q2_K", tmp_path, Path("/nonexistent"))


def test_the_searched_winner_is_fixed_with_the_draft_as_draft():
    searched = [dict(args=["--spec-type", "draft-simple", "--spec-draft-model", "/x/d.gguf", "--spec-draft-n-max", 8]), dict(args=["slower"])]
    assert bt.winner(searched, Path("/y/d.gguf")) == "--spec-type draft-simple --spec-draft-model DRAFT --spec-draft-n-max 8"
    assert bt.winner(None, Path("/y/d.gguf")) == ""
