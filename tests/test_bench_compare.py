"""specrt.bench.compare (bench/compare.py): the analytic bound, and one small run (specrt + transformers rows) on a tiny pair."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bc():
    from specrt.bench import compare

    return compare


def test_bound_formula(bc):
    # alpha = 0: every round costs k draft steps + one verification and yields one token
    assert bc.bound_formula(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    # Leviathan et al. 2023, Theorem 3.8
    assert bc.bound_formula(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    # alpha -> 1: k+1 tokens per round
    assert bc.bound_formula(1.0, 4, 0.0) == pytest.approx(5.0)
    assert bc.bound_formula(0.999999, 4, 0.0) == pytest.approx(5.0, rel=1e-4)


def test_analyse_row_alpha_estimates(bc):
    costs = {"rows": [{"model": "draft", "q": 1, "median_ms": 1.0}] + [{"model": "target", "q": q, "median_ms": 10.0} for q in range(1, 6)]}
    # k = 4, threshold 0: 10 passes, 6 accepted all 4, 4 rejected at the first candidate
    row = dict(accepted_hist=[4, 0, 0, 0, 6], accepted=24, proposed=40, passes=10, draft_calls=40, new_tokens=35, runs=1)
    b = bc.analyse_row(row, costs, 0.0, 4, 2.0, 2.2)
    assert b["alpha_naive"] == pytest.approx(0.6)
    assert b["alpha_geometric"] == pytest.approx(24 / 28)
    assert b["c"] == pytest.approx(0.1)
    assert b["bound_formula"] == pytest.approx(bc.bound_formula(24 / 28, 4, 0.1))
    # counters x costs: 34 decode tokens at 10 ms vs 40 draft calls at 1 ms + 10 passes at 10 ms
    assert b["bound_counts"] == pytest.approx(340 / 140)
    assert b["decode_over_bound_formula"] == pytest.approx(2.2 / b["bound_formula"])


def test_pyspy_breakdown_parses_native_and_python_stacks(tmp_path):
    from specrt.bench.workers import specrt_worker as sw

    line = sw._raw_run_line()
    assert line is not None
    ob = "/x/runtime/backends/ort.py"
    base = "<module> (w.py:1);_profiled_section (w.py:5);one_round (/x/runtime/decode.py:190)"
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "\n".join(
            [
                f"{base};OrtModel.run (/x/runtime/backends/ort.py:170);_raw_binding.<locals>.run ({ob}:{line});pthread_cond_signal (libc.so.6) 30",
                f"{base};OrtModel.run (/x/runtime/backends/ort.py:170);_raw_binding.<locals>.run ({ob}:{line});0x7f01 (onnxruntime/capi/x.so) 50",
                f"{base};OrtModel.run (/x/runtime/backends/ort.py:168);_raw_binding.<locals>.bind_in ({ob}:63) 10",
                f"{base};top1 (/x/runtime/speculative.py:46) 5",
                f"{base} 5",
                "<module> (w.py:1);load (w.py:3) 99",  # outside the marker: ignored
            ]
        )
    )
    b = sw.pyspy_breakdown(str(raw))
    assert b["samples"] == 100
    cats = {k: v["samples"] for k, v in b["categories"].items()}
    assert cats["ort: thread hand-over (pthread_cond/futex: wake and wait for pool threads)"] == 30
    assert cats["ort: kernels and executor (onnxruntime .so, stripped)"] == 50
    assert cats["binding (bind_input/bind_output)"] == 10
    assert cats["token selection (numpy calls in speculative.py)"] == 5
    assert cats["Python (loop, bookkeeping, calls)"] == 5
    assert b["inside_run_with_iobinding_share"] == pytest.approx(0.8)


def test_small_run_specrt_and_transformers(tiny_pair, tmp_path, bc):
    """Workers start, run interleaved, and transformers' greedy output equals specrt's."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    draft, target, engine = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def add(a, b):", "hello world")) + "\n")
    out = tmp_path / "out"
    rc = bc.main(
        [
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--engines",
            str(engine),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--systems",
            "specrt,hf",
            "--spec-k",
            "3",
            "--spec-threshold",
            "0.2",
            "--sweep-k",
            "2",
            "--sweep-thresholds",
            "0,0.5",
            "--sweep-limit",
            "1",
            "--cost-reps",
            "3",
            "--profile-prompts",
            "1",
            "--no-pyspy",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads((out / "compare.json").read_text())
    rows = {x["label"]: x for x in r["rows"]}
    assert set(rows) == {
        "specrt target-only",
        "specrt spec best (k=3 th=0.2)",
        "specrt spec fixed k=3 (th=0)",
        "HF generate (PyTorch)",
        "HF assisted (defaults)",
        "HF assisted (k=3 th=0.2)",
    }
    for x in rows.values():
        assert x["status"] == "ok", x
        assert x["runs"] == 2 and x["tokens_per_second"] > 0 and x["peak_rss_mb"] > 0
        assert x["ttft_ms"]["median"] is not None
    # greedy everywhere: every system reproduces specrt target-only's tokens
    for lab in rows:
        assert rows[lab]["equal_to_target"] == 2, lab
    assert rows["HF assisted (defaults)"]["info"]["assistant_settings"]["num_assistant_tokens"] == 20
    assert rows["HF assisted (k=3 th=0.2)"]["info"]["assistant_settings"] == {
        "num_assistant_tokens": 3,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.2,
    }
    assert r["costs"]["rows"][0]["model"] == "draft"
    assert [x["label"] for x in r["sweep"]["rows"]] == ["target-only", "k=2 th=0", "k=2 th=0.5"]
    assert r["profile_cprofile"]["categories"]
    assert any(b["label"] == "specrt spec fixed k=3 (th=0)" for b in r["analytic"]["rows"])
    for name in ("tokens_per_second", "threshold_sweep"):
        assert Path(r["plots"][name]).exists()
    assert "specrt target-only" in (out / "table.md").read_text()
    assert not math.isnan(rows["specrt spec fixed k=3 (th=0)"]["ratio_to_specrt_target_only"])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="VmHWM is Linux's /proc")
def test_a_workers_peak_rss_is_its_own_not_its_parents(tmp_path):
    """A bench worker started by a big parent (fork + exec, as specrt.bench.compare starts every
    worker) reports its own peak RSS: the kernel carries the parent's high-water mark into
    ru_maxrss across exec (issue 31: every specrt and onnxruntime-genai row once showed
    the bench parent's 2,626 MiB)."""
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import json, subprocess, sys\n"
        "big = bytearray(600 * 2**20)\n"
        "big[:: 4096] = b'x' * len(big[:: 4096])  # touch every page: 600 MiB resident\n"
        "child = 'import json, resource, sys; sys.path.insert(0, sys.argv[1]); import _protocol; "
        "print(json.dumps([_protocol.peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))'\n"
        "print(subprocess.run([sys.executable, '-c', child, sys.argv[1]], capture_output=True, text=True, check=True).stdout)\n"
    )
    import subprocess

    out = subprocess.run([sys.executable, str(parent), str(REPO / "bench" / "workers")], capture_output=True, text=True, check=True).stdout
    own, ru_maxrss = json.loads(out)
    assert ru_maxrss > 600  # what the old reading reported: the parent's
    assert own < 200, own  # a bare python with the stdlib protocol module


def _real_ctx(tmp_path, py_ov):
    from types import SimpleNamespace

    a = SimpleNamespace(openvino_python="/nowhere/python", ov_group_size=128, ov_threshold=0.4)
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    hf = dict(target=str(tmp_path / "t.hf"), draft=str(tmp_path / "d.hf"))
    return SimpleNamespace(a=a, py_ov=py_ov, out=tmp_path, logs=logs, hf=hf, env={}, common=dict(threads=2), k=8)


def test_bench_real_openvino_rows_say_why_they_cannot_run(tmp_path):
    """make bench-real's OpenVINO GenAI rows (issue 31.6): three rows (target-only, k, threshold)
    against its own target-only row; no venv, or a failed IR build, leaves every row not
    started with the reason (the build's own error text), never a silent skip."""
    from specrt.bench import real

    rows = real.openvino_rows(_real_ctx(tmp_path, None), {})
    assert [r["label"] for r in rows] == [
        "OpenVINO int4 target-only",
        "OpenVINO int4 speculative (k=8)",
        "OpenVINO int4 speculative (th=0.4)",
    ]
    assert [r["own_base"] for r in rows] == [None, "OpenVINO int4 target-only", "OpenVINO int4 target-only"]
    assert all("no python at /nowhere/python" in r["error"] for r in rows)
    assert rows[1]["init"]["variant"] == dict(speculative=True, num_assistant_tokens=8)
    assert rows[2]["init"]["variant"] == dict(speculative=True, assistant_confidence_threshold=0.4)
    # a build whose target failed: its error reaches every row; the record is kept
    fake = tmp_path / "fake_python"
    fake.write_text('#!/bin/sh\necho \'{"target": {"ok": false, "error": "group size 128 does not divide 200"}, "draft": {"ok": true}}\'\n')
    fake.chmod(0o755)
    result: dict = {}
    rows = real.openvino_rows(_real_ctx(tmp_path, str(fake)), result)
    assert result["openvino_build"]["target"]["ok"] is False
    assert all(r["error"] == "optimum-cli export openvino failed: target: group size 128 does not divide 200" for r in rows)
    # both built: the rows run, on the IR folders the build wrote
    fake.write_text('#!/bin/sh\necho \'{"target": {"ok": true}, "draft": {"ok": true}}\'\n')
    rows = real.openvino_rows(_real_ctx(tmp_path, str(fake)), {})
    assert [r["error"] for r in rows] == [None, None, None]
    assert rows[1]["init"]["target_dir"] == str((tmp_path / "anchors" / "openvino-int4" / "target").resolve())
