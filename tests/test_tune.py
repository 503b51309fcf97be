"""``specrt tune`` (runtime/tune.py): writes defaults that generate then uses, runs from a
trace without models, keeps the manifest's hash checks, refuses bad inputs clearly."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from click.testing import CliRunner

from specrt import Engine, GenerationConfig
from specrt.cli import cli
from specrt.runtime.config import STRATEGIES
from specrt.runtime.errors import InputError
from specrt.runtime.lab.tune import check_grid
from specrt.runtime.machine import this_machine
from specrt.runtime.manifest import load_manifest, write_defaults

PROMPTS = ['{"prompt": "def add(a, b):"}', '{"prompt": "for i in range(10):\\n"}']


@pytest.fixture()
def folder(noisy_pair, tmp_path):
    """A private copy of the noisy engine folder (tune rewrites its manifest)."""
    dst = tmp_path / "engine"
    shutil.copytree(noisy_pair[1], dst)
    return dst


@pytest.fixture()
def prompts(tmp_path):
    p = tmp_path / "val.jsonl"
    p.write_text("\n".join(PROMPTS) + "\n")
    return p


def run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


@pytest.fixture(scope="module")
def tuned(noisy_pair, tmp_path_factory):
    """One real `specrt tune --calibrate` run on a copy of the noisy pair: (folder, out, result)."""
    root = tmp_path_factory.mktemp("tune")
    folder = root / "engine"
    shutil.copytree(noisy_pair[1], folder)
    (root / "val.jsonl").write_text("\n".join(PROMPTS) + "\n")
    out = root / "out"
    r = run(
        [
            "tune",
            "--engines",
            str(folder),
            "--prompts",
            str(root / "val.jsonl"),
            "--max-new-tokens",
            "16",
            "--k-max",
            "1",
            "--k-max",
            "3",
            "--threshold",
            "0",
            "--threshold",
            "0.4",
            "--strategy",
            "full",
            "--calibrate",
            "--cost-reps",
            "3",
            "--trace",
            str(root / "wide.jsonl"),
            "--out",
            str(out),
        ]
    )
    assert r.exit_code == 0, r.output
    return folder, out, json.loads((out / "tune.json").read_text()), r.output, root / "wide.jsonl"


def test_tune_writes_defaults_that_generate_uses(tuned):
    folder, out, result, output, _ = tuned
    chosen = result["chosen_defaults"]
    m = load_manifest(folder, verify_hashes=True)  # the file hashes still check
    for key, value in chosen.items():
        assert m.defaults[key] == value
    assert set(chosen) >= {"k_max", "threshold", "draft_confidence_temperature"}
    assert chosen["k_max"] in (1, 3) and chosen["threshold"] in (0.0, 0.4)
    assert m.extra["calibration"]["ece_before"] == result["calibration"]["ece_before"]
    assert m.extra["tune"]["chosen"] == chosen
    assert m.extra["tune"]["machine"] == this_machine().to_json()  # keyed by the CPU it was tuned on
    assert "machine: " + this_machine().describe() in output
    assert not list(folder.glob("*.tmp"))
    # the Engine reads them as its defaults ...
    cfg = Engine(folder).resolve(GenerationConfig())
    assert (cfg.k_max, cfg.threshold, cfg.confidence_temperature) == (chosen["k_max"], chosen["threshold"], chosen["draft_confidence_temperature"])
    # ... and so does `specrt generate`, unless told otherwise
    r = CliRunner().invoke(cli, ["generate", "--engines", str(folder), "--prompt", "def f(x):", "--max-new-tokens", "12"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output.strip().splitlines()[-1])
    assert len(stats["accepted_hist"]) == chosen["k_max"] + 1
    r = CliRunner().invoke(cli, ["generate", "--engines", str(folder), "--prompt", "def f(x):", "--max-new-tokens", "12", "--k-max", "2"])
    assert len(json.loads(r.output.strip().splitlines()[-1])["accepted_hist"]) == 3


def test_tune_reports_everything(tuned):
    _, out, result, output, wide = tuned
    labels = [r["label"] for r in result["rows"]]
    assert labels == ["k=1 th=0", "k=1 th=0.4", "k=3 th=0", "k=3 th=0.4"]
    for r in result["rows"]:
        assert r["tokens_per_second"] > 0 and r["speedup"] > 0
        assert r["equal_to_target"] == 2  # every output equals target-only
        p = r["predicted"]
        assert p["tokens_per_second"] > 0 and p["approximated"]["unknown_position"] == 0
        assert p["accepted_hist"] == r["accepted_hist"] + [0] * (len(p["accepted_hist"]) - len(r["accepted_hist"]))
    assert result["best"]["tokens_per_second"] == max(r["tokens_per_second"] for r in result["rows"])
    assert result["best_fixed"]["threshold"] == 0.0
    assert result["confirm"] is not None
    assert set(result["costs"]["target_s_by_q"]) == {str(q) for q in range(1, 10)}
    cal = result["calibration"]
    assert cal["ece_before"] >= 0 and cal["ece_after"] >= 0 and cal["temperature"] == result["confidence_temperature"]
    assert "chosen:" in output and "best fixed-k threshold-0 setting" in output and "ECE" in output
    pytest.importorskip("matplotlib")
    for name in ("speedup_vs_threshold.png", "accepted_hist_best.png", "reliability.png"):
        assert (out / name).stat().st_size > 1000
    assert wide.is_file()


def test_tune_from_trace_runs_without_models(tuned, tmp_path, monkeypatch):
    _, _, result, _, wide = tuned
    from specrt.runtime.backends import ort as ort_backend

    def no_models(*a, **k):
        raise AssertionError("tune --from-trace loaded a model")

    monkeypatch.setattr(ort_backend.OrtModel, "__init__", no_models)
    r = run(
        [
            "tune",
            "--from-trace",
            str(wide),
            "--k-max",
            "1",
            "--k-max",
            "2",
            "--k-max",
            "3",
            "--threshold",
            "0",
            "--threshold",
            "0.4",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert r.exit_code == 0, r.output
    assert "nothing was measured" in r.output
    res = json.loads((tmp_path / "o" / "tune.json").read_text())
    assert res["measured"] is False and res["costs_source"] == "trace header (measured)"
    assert all(row["tokens_per_second"] is None and row["predicted"]["tokens_per_second"] > 0 for row in res["rows"])
    # the same predictions as the models run's cost model for the same settings
    pred = {r["label"]: r["predicted"] for r in result["rows"]}
    for row in res["rows"]:
        if row["label"] in pred:
            assert row["predicted"]["accepted_hist"] == pred[row["label"]]["accepted_hist"]
            assert row["predicted"]["tokens_per_second"] == pytest.approx(pred[row["label"]]["tokens_per_second"])
    assert "wrote_manifest" not in res  # no --engines: nothing written


def test_tune_from_trace_writes_only_to_its_own_pair(tuned, folder, tmp_path):
    _, _, _, _, wide = tuned
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    raw = json.loads((other / "manifest.json").read_text())
    raw["target"]["sha256"] = raw["files"]["target.onnx"]["sha256"] = "0" * 64  # another pair as far as the trace's pair hash goes
    (other / "manifest.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(cli, ["tune", "--from-trace", str(wide), "--engines", str(other), "--threshold", "0", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "recorded on another pair" in r.output
    r = run(["tune", "--from-trace", str(wide), "--engines", str(folder), "--threshold", "0", "--threshold", "0.4", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "o" / "tune.json").read_text())
    m = load_manifest(folder)
    assert m.defaults["k_max"] == res["best"]["k_max"] and m.extra["tune"]["measured"] is False
    assert m.defaults["draft_confidence_temperature"] == res["confidence_temperature"]


def test_plots_need_matplotlib_but_json_is_written(tuned, tmp_path, monkeypatch):
    _, _, _, _, wide = tuned
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = CliRunner().invoke(cli, ["tune", "--from-trace", str(wide), "--threshold", "0", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "install specrt[tune] for the plots" in r.output
    assert (tmp_path / "o" / "tune.json").is_file() and not (tmp_path / "o" / "speedup_vs_threshold.png").exists()


def test_write_defaults_is_atomic_and_keeps_the_rest(folder):
    before = json.loads((folder / "manifest.json").read_text())
    write_defaults(folder, {"k_max": 2, "threshold": 0.25}, {"note": {"x": 1}})
    after = json.loads((folder / "manifest.json").read_text())
    assert after["defaults"]["k_max"] == 2 and after["defaults"]["threshold"] == 0.25 and after["extra"]["note"] == {"x": 1}
    for key in before:
        if key not in ("defaults", "extra"):
            assert after[key] == before[key]
    load_manifest(folder, verify_hashes=True)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in folder.iterdir() if not p.name.endswith(".tmp"))
    # a value the runtime refuses is caught when the engine resolves its config
    write_defaults(folder, {"threshold": 2.0})
    with pytest.raises(InputError, match="threshold=2.0"):
        Engine(folder).resolve(GenerationConfig())


# ---- bad inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--threshold", "1.5"], "threshold=1.5; threshold must be a number in [0, 1]"),
        (["--threshold", "-0.1"], "threshold=-0.1; threshold must be a number in [0, 1]"),
        (["--k-max", "9"], "k_max=9; k_max must be an integer in 1..8"),
        (["--k-max", "0"], "k_max=0; k_max must be an integer in 1..8"),
    ],
)
def test_bad_grid(folder, prompts, extra, needle, tmp_path):
    r = CliRunner().invoke(cli, ["tune", "--engines", str(folder), "--prompts", str(prompts), "--strategy", "full", "--out", str(tmp_path / "o"), *extra])
    assert r.exit_code == 1
    assert needle in r.output
    assert "Traceback" not in r.output
    assert load_manifest(folder).defaults == json.loads((folder / "manifest.json").read_text())["defaults"]


def test_bad_inputs(folder, prompts, tmp_path, tuned):
    def err(args):
        r = CliRunner().invoke(cli, ["tune", *args, "--out", str(tmp_path / "o")])
        assert r.exit_code == 1, r.output
        assert "Traceback" not in r.output
        return r.output

    assert "trace file" in err(["--from-trace", str(tmp_path / "missing.jsonl")]) and "does not exist" in err(["--from-trace", str(tmp_path / "missing.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(tuned[4].read_text().splitlines()[0] + "\nnot json\n")
    assert f"{bad}:2: not valid JSON" in err(["--from-trace", str(bad)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert f"{empty}: no prompts" in err(["--engines", str(folder), "--prompts", str(empty)])
    assert "--prompts VALIDATION.jsonl is required" in err(["--engines", str(folder)])
    assert "--from-trace predicts from the trace alone" in err(["--from-trace", str(tuned[4]), "--prompts", str(prompts)])
    assert "k_max=9; k_max must be an integer in 1..8" in err(["--from-trace", str(tuned[4]), "--k-max", "9"])
    costs = tmp_path / "c.json"
    costs.write_text('{"draft_s_per_call": 0}')
    assert "malformed costs" in err(["--from-trace", str(tuned[4]), "--costs", str(costs)])


def test_check_grid_and_strategies():
    assert "full" in STRATEGIES
    with pytest.raises(InputError, match="strategy='fast'; strategy must be one of full, chunked, lazy-head"):
        check_grid([1], [0.0], ["fast"], (1, 8))
    with pytest.raises(InputError, match="empty sweep grid"):
        check_grid([], [0.0], ["full"], (1, 8))


def test_tune_api_refuses_an_empty_prompt_set(noisy_pair):
    from specrt.runtime.lab.tune import tune

    with pytest.raises(InputError, match="empty prompt set"):
        tune(Engine(noisy_pair[1]), [], [1], [0.0])


def test_check_defaults_ranges():
    from specrt.runtime.config import check_defaults

    ok = check_defaults({"k_max": 3, "threshold": 0.3, "strategy": "chunked", "chunk_bound": 1, "draft_confidence_temperature": 0.25}, 8)
    assert ok == {"k_max": 3, "threshold": 0.3, "strategy": "chunked", "chunk_bound": 1.0, "draft_confidence_temperature": 0.25}
    bad = [
        ({"k_max": 9}, "k_max=9; k_max must be an integer in 1..8"),
        ({"k_max": True}, "k_max=True"),
        ({"threshold": 1.5}, "threshold=1.5; threshold must be a number in [0, 1]"),
        ({"strategy": "eager"}, "strategy='eager'; strategy must be one of full, chunked, lazy-head"),
        ({"chunk_bound": 0}, "chunk_bound=0; chunk_bound must be a number in (0, 1]"),
        ({"draft_confidence_temperature": 0}, "draft_confidence_temperature=0"),
        ({"k": 2}, "unknown default 'k'; allowed keys: k_max, threshold"),
        ([1, 2], "expected a JSON object"),
    ]
    for d, needle in bad:
        with pytest.raises(InputError, match=None) as e:
            check_defaults(d, 8, where="x.json")
        assert needle in str(e.value) and "x.json" in str(e.value)


def test_export_defaults_file_goes_into_the_manifest(tiny_pair, tmp_path):
    """`specrt export --defaults FILE` writes the tuned defaults (what `make export` does with
    models/tuned_defaults.json); a bad file is refused before anything is exported."""
    draft, target, _ = tiny_pair
    good = tmp_path / "d.json"
    good.write_text(json.dumps({"k_max": 3, "threshold": 0.2, "strategy": "chunked", "draft_confidence_temperature": 0.5}))
    out = tmp_path / "eng"
    r = CliRunner().invoke(
        cli,
        [
            "export",
            "--draft",
            str(draft),
            "--target",
            str(target),
            "--out",
            str(out),
            "--k-max",
            "4",
            "--max-ctx",
            "64",
            "--no-lazy-head",
            "--defaults",
            str(good),
        ],
    )
    assert r.exit_code == 0, r.output
    m = load_manifest(out)
    assert m.defaults["k_max"] == 3 and m.defaults["threshold"] == 0.2 and m.defaults["strategy"] == "chunked"
    assert m.defaults["draft_confidence_temperature"] == 0.5
    cfg = Engine(out).resolve(GenerationConfig())
    assert (cfg.k_max, cfg.threshold, cfg.strategy, cfg.confidence_temperature) == (3, 0.2, "chunked", 0.5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"k_max": 8}))
    r = CliRunner().invoke(
        cli,
        ["export", "--draft", str(draft), "--target", str(target), "--out", str(tmp_path / "eng2"), "--k-max", "4", "--no-lazy-head", "--defaults", str(bad)],
    )
    assert r.exit_code != 0 and "k_max=8; k_max must be an integer in 1..4" in r.output
    assert not (tmp_path / "eng2").exists()


def test_tune_keeps_the_previous_defaults_and_restores_them(tuned, noisy_pair, tmp_path):
    folder, _, result, output, _ = tuned
    original = load_manifest(noisy_pair[1], verify_hashes=False).defaults
    m = load_manifest(folder, verify_hashes=False)
    assert m.extra["previous_defaults"] == original != m.defaults
    assert f"(previous {original} kept in extra.previous_defaults)" in output
    assert "sweep: " in output and "(100%)" in output  # progress lines: CliRunner's stderr is not a terminal
    copy = tmp_path / "engine"
    shutil.copytree(folder, copy)
    r = run(["tune", "--engines", str(copy), "--restore-previous"])
    assert r.exit_code == 0, r.output
    back = load_manifest(copy, verify_hashes=True)
    assert back.defaults == original and back.extra["previous_defaults"] == m.defaults  # one more restore swaps them again
    r = CliRunner().invoke(cli, ["tune", "--engines", str(noisy_pair[1]), "--restore-previous"])
    assert r.exit_code == 1 and "keeps no previous defaults" in r.output


def test_tune_dry_run_changes_nothing(folder, prompts, tmp_path):
    before = (folder / "manifest.json").read_bytes()
    args = ["tune", "--engines", str(folder), "--prompts", str(prompts), "--max-new-tokens", "4", "--k-max", "2", "--threshold", "0"]
    args += ["--strategy", "full", "--cost-reps", "1", "--confirm-repeats", "0", "--out", str(tmp_path / "out"), "--dry-run"]
    r = run(args)
    assert r.exit_code == 0, r.output
    assert (folder / "manifest.json").read_bytes() == before
    chosen = json.loads((tmp_path / "out" / "tune.json").read_text())["chosen_defaults"]
    assert f"dry run: would write defaults {chosen} into {folder / 'manifest.json'}" in r.output and "manifest not changed" in r.output


def test_bench_prints_progress_lines_without_a_terminal(folder, prompts):
    r = run(["bench", "--engines", str(folder), "--prompts", str(prompts), "--max-new-tokens", "4", "--repeats", "3", "--no-fastest-baseline"])
    assert r.exit_code == 0, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("bench: ")]
    assert [x.split(",")[0] for x in lines] == ["bench: 10/12 (83%)", "bench: 12/12 (100%)"]  # 2 prompts x 2 rows x 3 repeats


def test_tune_sweeps_the_drafter_and_adaptive_k_and_writes_the_winner(folder, prompts, tmp_path):
    """--drafter/--adaptive are axes of the sweep (issue 31.4: the drafter and adaptive k
    chosen by measurement): one measured row per combination, the cost model's prediction
    only where it models the loop (the model drafter at a fixed k), the best fixed-k row
    among the plain ones, and the winner's drafter and adaptive written as defaults."""
    out = tmp_path / "out"
    args = ["tune", "--engines", str(folder), "--prompts", str(prompts), "--max-new-tokens", "8", "--k-max", "2", "--threshold", "0"]
    args += ["--strategy", "full", "--drafter", "model", "--drafter", "ngram", "--adaptive", "off", "--adaptive", "on"]
    r = run(args + ["--confirm-repeats", "0", "--cost-reps", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "tune.json").read_text())
    got = {(row["drafter"], row["adaptive"]): row for row in res["rows"]}
    assert set(got) == {("model", False), ("model", True), ("ngram", False), ("ngram", True)}
    assert [row["label"] for row in res["rows"]] == ["k=2 th=0 model", "k=2 th=0 model adaptive", "k=2 th=0 ngram", "k=2 th=0 ngram adaptive"]
    for key, row in got.items():
        assert row["equal_to_target"] == len(PROMPTS) and row["tokens_per_second"] > 0  # prompts whose output is the target's
        assert (row["predicted"] is not None) == (key == ("model", False))
    assert (res["best_fixed"]["drafter"], res["best_fixed"]["adaptive"]) == ("model", False)
    best = max(res["rows"], key=lambda row: row["tokens_per_second"])
    assert res["best"]["label"] == best["label"]
    assert res["chosen_defaults"]["drafter"] == best["drafter"] and res["chosen_defaults"]["adaptive"] == best["adaptive"]
    m = load_manifest(folder, verify_hashes=False)
    assert (m.defaults["drafter"], m.defaults["adaptive"]) == (best["drafter"], best["adaptive"])
    cfg = Engine(folder).resolve(GenerationConfig())
    assert (cfg.drafter, cfg.adaptive) == (best["drafter"], best["adaptive"])
