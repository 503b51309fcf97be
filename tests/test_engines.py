"""Engine flavors (issue 14): int4/int8 onnxruntime-genai builder graphs driven by specrt's own
runtime, exactness by construction (no target call narrower than the measured exact width),
fp16 standard graphs, GPT-2 kept standard in an integer export, lazy-head weights stored
once, the bench's divergence report, and the clear errors around them.

Oracle: the same engine's target-only greedy output. Tiny random pairs (seconds each)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import make_tokenizer, save_family, save_llama

from specrt import Engine, GenerationConfig
from specrt.runtime.backends import cpu_model, refuse_builder_graphs
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.decode import call_start, chunk_bounds
from specrt.runtime.errors import BackendError, InputError
from specrt.runtime.lab.exactness import measure, pattern_bounds, run_pattern
from specrt.runtime.manifest import GRAPH_BUILDER, load_manifest, sha256_file

pytest.importorskip("torch")

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "x", "class Foo:\n    def __init__(self, x):\n        self.x = x\n" * 2]


def _prompts(engine: Engine, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    ids = [engine.prompt_ids(p) for p in PROMPTS]
    ids += [rng.integers(0, engine.manifest.vocab_size, size=n).tolist() for n in (1, 2, 3, 40)]  # 1-token prompts: shorter than min_q
    return ids


def _equal_everywhere(engine: Engine, ks=(1, 2, 4, 8), ths=(0.0, 0.5, 0.9), strategies=("full", "chunked"), new=24) -> int:
    """Speculative == target-only for every prompt and setting; returns the candidates proposed."""
    proposed = 0
    for ids in _prompts(engine):
        want = engine.generate(ids, GenerationConfig(max_new_tokens=new, speculative=False)).tokens
        for k in ks:
            for th in ths:
                for st in strategies:
                    res = engine.generate(ids, GenerationConfig(max_new_tokens=new, k_max=k, threshold=th, strategy=st))
                    assert res.tokens == want, (ids[:5], k, th, st)
                    proposed += res.stats.proposed
    return proposed


# ---- the decode loop's widening (pure functions) -------------------------------------------
def test_chunk_bounds_never_end_narrower_than_min_q():
    assert chunk_bounds(257, 256, 1) == [(0, 256), (256, 257)]
    assert chunk_bounds(257, 256, 2) == [(0, 255), (255, 257)]
    assert chunk_bounds(1, 256, 2) == [(0, 1)]  # nothing to widen with
    assert chunk_bounds(0, 8, 2) == []
    for n in range(1, 40):
        for step in (2, 3, 5, 8):
            b = chunk_bounds(n, step, 2)
            assert b[0][0] == 0 and b[-1][1] == n and all(hi - lo <= step for lo, hi in b)
            assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
            assert n < 2 or b[-1][1] - b[-1][0] >= 2
    with pytest.raises(ValueError):
        chunk_bounds(10, 1, 2)


def test_call_start_widens_left_only_over_valid_rows():
    assert call_start(10, 11, 10, 2) == 9  # target-only step: [previous, pending] at start - 1
    assert call_start(10, 15, 10, 2) == 10  # a verification pass is wide enough already
    assert call_start(10, 11, 10, 1) == 10
    assert call_start(3, 4, 0, 2) == 0  # rows not valid yet (short prompt): recompute from 0
    assert call_start(0, 1, 0, 2) == 0
    assert call_start(12, 13, 12, 4) == 9


# ---- int4 builder graphs ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int4(int4_pair):
    return Engine(int4_pair[2])


def test_int4_manifest_records_the_flavor(int4, int4_pair):
    m = int4.manifest
    assert m.precision == "int4"
    for e in (m.target, m.draft):
        assert e.graph == GRAPH_BUILDER and e.precision == "int4"
        assert e.quant["block_size"] == 16 and e.quant["accuracy_level"] == 4 and e.quant["version"] == "0.18.0"
        assert e.data_file == Path(e.file).name + ".data" and sha256_file(int4_pair[2] / e.data_file) == e.data_sha256
        assert all(np.isfinite(v) for v in e.parity.values())
    ex = m.target.exactness
    assert m.target.exact_min_q == ex["exact_min_q"] and m.min_q() == max(1, ex["exact_min_q"] or 1)
    assert ex["widths"] == list(range(1, m.k_max + 2)) and set(ex["models"]) == {"t1", "t2"}  # every width the loop calls
    # every width from the recorded one on is bit-identical to the reference
    assert all(v == 0.0 for k, v in ex["max_abs_diff"].items() if int(k[1:].split("+")[0].split(" ")[0]) >= m.target.exact_min_q)
    assert not (int4_pair[2] / "target_body.onnx").exists()
    # the wide widths (prefix reuse of any committed row): every width above the loop's up
    # to the widest prefill call the context allows, measured at the first call
    wide = ex["wide"]
    assert (wide["lo"], wide["hi"], wide["ref_q"]) == (m.k_max + 2, min(256, m.max_ctx), m.k_max + 1)
    assert wide["checked"]["o0"] == [wide["hi"] - wide["lo"] + 1, wide["hi"]]
    assert set(wide["inexact"]) == {int(k[1:].split("@")[0]) for k in wide["max_abs_diff"]}
    assert m.layout_avoid(256) == (None if wide["hi"] in wide["inexact"] else frozenset(wide["inexact"]))


def test_int4_speculative_equals_target_only(int4):
    assert int4.manifest.min_q() >= 2  # accuracy level 4: the q = 1 kernel rounds differently
    assert _equal_everywhere(int4) > 0


def test_int4_rows_are_bit_identical_in_both_modes(int4):
    """Exactness by construction, observed: the target's logits row behind every output
    token is the same float32 row, bit for bit, in speculative and target-only decoding
    (its log-probability and alternatives, read from that row, compare with ``==``), and no
    target call after the prefill is narrower than the measured exact width. Switching the
    construction off (``min_q`` forced to 1: target-only steps then run the q = 1 kernel,
    which rounds differently) fails here even where the greedy tokens happen to agree."""
    m = int4.manifest
    assert m.min_q() >= 2
    for ids in _prompts(int4)[:4]:
        base = int4.generate(ids, GenerationConfig(max_new_tokens=24, speculative=False, logprobs=3))
        for k in (1, 4):
            spec = int4.generate(ids, GenerationConfig(max_new_tokens=24, k_max=k, threshold=0.0, logprobs=3))
            assert spec.tokens == base.tokens
            assert [(e.logprob, e.top) for e in spec.logprobs] == [(e.logprob, e.top) for e in base.logprobs], (ids[:5], k)
        rounds = list(int4.rounds(ids, int4.resolve(GenerationConfig(max_new_tokens=24, speculative=False))))
        assert all(q >= m.min_q() for r in rounds[1:] for q, _, _ in r.calls if q > 0)


def test_int4_sampled_is_seeded(int4):
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=3, k_max=4)
    assert int4.generate("def f(", cfg).tokens == int4.generate("def f(", cfg).tokens


def test_bit_identity_property_on_the_exported_graphs(int4_pair, tiny_pair):
    """Fresh sequences, other offsets and thread counts: every call width >= the recorded
    exact_min_q gives bit-identical logits rows; the recorded q = 1 difference is real."""
    for folder in (int4_pair[2], tiny_pair[2]):
        m = load_manifest(folder)
        e = m.target
        q0 = e.exact_min_q
        assert q0 is not None
        models = [(f"t{t}", cpu_model(folder, e, 64, 24, ThreadConfig(t, False, t))) for t in (1, 2)]
        rec = measure(models, m.vocab_size, widths=(2, 3, 5, 9), offsets=(3, 5), length=50, sequences=2, seed=7)
        assert rec["exact_min_q"] == q0, rec
        if q0 > 1:
            assert rec["max_abs_diff"]["q1"] > 0.0
        rng = np.random.default_rng(1)
        seq = rng.integers(0, m.vocab_size, size=30).tolist()
        ref = run_pattern(models[0][1], seq, pattern_bounds(30, 9))
        for q in range(q0, 8):
            assert np.array_equal(run_pattern(models[1][1], seq, pattern_bounds(30, q, 1)), ref)


def test_gqa_model_binds_kv_once_and_in_place(int4_pair):
    m = load_manifest(int4_pair[2])
    t = cpu_model(int4_pair[2], m.target, 64, 16, ThreadConfig())
    t.run([1, 2, 3, 4, 5], 0)
    ptrs = t.output_pointers()
    for i in range(m.target.n_layers):
        assert ptrs[f"present.{i}.key"] == t.keys[i].ctypes.data and ptrs[f"present.{i}.value"] == t.values[i].ctypes.data
    assert ptrs["logits"] == t.logits.ctypes.data
    # rollback = a shorter mask: rewriting rows from an earlier start gives the same rows as a fresh run
    rng = np.random.default_rng(0)
    seq = rng.integers(0, m.vocab_size, size=20).tolist()
    fresh = cpu_model(int4_pair[2], m.target, 64, 16, ThreadConfig())
    want = run_pattern(fresh, seq, pattern_bounds(20, 4))
    t.run(seq[:8], 0)
    t.run(rng.integers(0, m.vocab_size, size=6).tolist(), 8)  # rows 8..13 garbage, then rolled back
    t.run(seq[8:12], 8)
    t.run(seq[12:16], 12)
    assert np.array_equal(t.run(seq[16:20], 16), want[16:20])
    # a fork has its own KV: running it leaves the parent's rows alone
    f = t.fork()
    before = t.keys[0].copy()
    f.run(seq[:10], 0)
    assert np.array_equal(t.keys[0], before) and f.keys[0].ctypes.data != t.keys[0].ctypes.data
    with pytest.raises(InputError):
        t.run([1] * 17, 0)
    with pytest.raises(InputError):
        t.run([1, 2], 63)


def test_builder_engine_refuses_lazy_head_and_gpu_backends(int4, int4_pair):
    with pytest.raises(InputError, match="builder graph") as ei:
        int4.generate("def f(", GenerationConfig(strategy="lazy-head"))
    assert ei.value.param == "strategy"
    for backend in ("ort-cuda", "tensorrt"):
        with pytest.raises(BackendError, match="standard graphs only") as ei:
            refuse_builder_graphs(backend, int4.manifest, int4_pair[2])
        assert ei.value.param == "backend" and "\n" not in str(ei.value)


def test_int4_export_refuses_lazy_head(int4_pair, tmp_path):
    from specrt.export.pipeline import export_pair
    from specrt.runtime.errors import PrecisionError

    with pytest.raises(PrecisionError, match="fp32"):
        export_pair(int4_pair[0], int4_pair[1], tmp_path / "e", precision="int4", lazy_head=True, log=lambda *_: None)


# ---- int8, and a GPT-2 draft in an integer export -----------------------------------------------
@pytest.fixture(scope="module")
def int8_gpt2(tmp_path_factory):
    """int8 export of a Llama target with a GPT-2 draft: the target a builder graph, the draft
    specrt's standard fp32 graph with a note (the builder has no GPT-2)."""
    pytest.importorskip("onnxruntime_genai")
    from specrt.export.builder import QuantOptions
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("int8")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=21, hidden=64, layers=2)
    save_family(root / "draft", tok, "gpt2", seed=22, n_layer=1)
    logs: list[str] = []
    export_pair(
        root / "draft", root / "target", root / "engine", k_max=4, max_ctx=128, log=logs.append, precision="int8", quant=QuantOptions("int8", 32), kernels=False
    )  # the builder graph is the subject (the kernels' checkpoint path: test_checkpoint_gguf.py)
    return Engine(root / "engine"), logs


def test_int8_with_a_gpt2_draft(int8_gpt2):
    engine, logs = int8_gpt2
    m = engine.manifest
    assert m.target.graph == GRAPH_BUILDER and m.target.precision == "int8"
    assert m.draft.graph == "standard" and m.draft.precision == "fp32" and "gpt2" in m.draft.note
    assert any("note: gpt2" in line for line in logs)
    assert _equal_everywhere(engine, ks=(1, 4), ths=(0.0, 0.5), strategies=("full",)) >= 0


# ---- fp16 standard graphs ---------------------------------------------------------------------------
def test_fp16_standard_graphs_keep_the_guarantee(tiny_pair, tmp_path):
    """fp16 compute (float32 I/O), the rewrite TensorRT plans are built from, on the CPU."""
    from specrt.export.onnx_precision import write_variant
    from specrt.export.pipeline import measure_exactness

    folder = tmp_path / "fp16"
    shutil.copytree(tiny_pair[2], folder)
    raw = json.loads((folder / "manifest.json").read_text())
    for role in ("draft", "target"):
        f = folder / raw[role]["file"]
        write_variant(f, f, "fp16", 0)
        raw[role].update(precision="fp16", sha256=sha256_file(f))
        raw["files"][raw[role]["file"]].update(sha256=sha256_file(f), bytes=f.stat().st_size)  # the files map records it too
    raw["precision"] = "fp16"
    (folder / "manifest.json").write_text(json.dumps(raw))
    m = load_manifest(folder)
    rec = measure_exactness(folder, m.target, m.max_ctx, m.k_max, m.vocab_size)
    raw["target"].update(exact_min_q=rec["exact_min_q"], exactness=rec)
    (folder / "manifest.json").write_text(json.dumps(raw))
    engine = Engine(folder)
    assert engine.manifest.target.precision == "fp16"
    assert _equal_everywhere(engine, ks=(2, 8), ths=(0.0, 0.9)) > 0


def test_bf16_graph_is_refused_on_the_cpu_in_one_line(tiny_pair, tmp_path):
    folder = tmp_path / "bf16"
    shutil.copytree(tiny_pair[2], folder)
    raw = json.loads((folder / "manifest.json").read_text())
    raw["target"]["precision"] = "bf16"
    (folder / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(BackendError, match="bf16") as ei:
        Engine(folder)
    assert ei.value.param == "backend"


# ---- lazy-head weights stored once ------------------------------------------------------------
def test_lazy_head_graphs_share_one_weight_file(noisy_pair):
    import onnx

    folder = noisy_pair[1]
    m = load_manifest(folder)
    rec = m.extra["lazy_head"]
    assert m.target.data_file == rec["data_file"] == "target.onnx.data"
    data = (folder / "target.onnx.data").stat().st_size
    for name in ("target.onnx", "target_body.onnx", "target_head.onnx"):
        g = onnx.load(str(folder / name), load_external_data=False)
        inline = sum(len(t.raw_data) for t in g.graph.initializer)
        ext = [t for t in g.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert inline < 0.05 * data, name  # the weights are not in the graph files
        assert {kv.value for t in ext for kv in t.external_data if kv.key == "location"} == {"target.onnx.data"}
    total = sum((folder / n).stat().st_size for n in ("target.onnx", "target_body.onnx", "target_head.onnx", "target.onnx.data"))
    assert total < 1.1 * data + 3e5  # stored once (not three times)


# ---- the bench reports divergences --------------------------------------------------------------
def test_divergence_report_names_position_and_margin(int4):
    from specrt.runtime.lab.bench import divergences, top2_margin

    ids = [int4.prompt_ids("def add(a, b):")]
    base = int4.generate(ids[0], GenerationConfig(max_new_tokens=12, speculative=False)).tokens
    assert divergences(int4, ids, {0: base}, {0: list(base)}) == []
    got = list(base)
    got[5] = (got[5] + 1) % int4.manifest.vocab_size
    (d,) = divergences(int4, ids, {0: base}, {0: got})
    assert d["prompt"] == 0 and d["position"] == 5 and d["target_only_token"] == base[5] and d["token"] == got[5]
    from specrt.runtime.decode import feed

    row = feed(int4.target, ids[0] + base[:5], 0, int4.manifest.min_q())[-1]
    assert d["target_top2_margin"] == pytest.approx(top2_margin(row, int4.manifest.vocab_size)) and d["target_top2_margin"] >= 0
    assert int(row[: int4.manifest.vocab_size].argmax()) == base[5]


def test_bench_rows_carry_divergences(int4):
    from specrt.runtime.lab.bench import BenchConfig, format_table, run_bench

    cfgs = [BenchConfig("target-only", GenerationConfig(max_new_tokens=10, speculative=False)), BenchConfig("k4", GenerationConfig(max_new_tokens=10, k_max=4))]
    res = run_bench(int4, [{"prompt": p} for p in PROMPTS[:2]], cfgs)
    assert res["rows"][1]["divergences"] == [] and res["rows"][1]["equal_to_target"] == 2
    assert "DIVERGENCE" not in format_table(res)


# ---- CLI ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--precision", "fp32", "--block-size", "32"], "apply to --precision int8|int4"),
        (["--precision", "int4", "--block-size", "24"], "power of two"),
        (["--precision", "int4", "--accuracy-level", "7"], "accuracy_level"),
        (["--precision", "int8", "--lazy-head"], "--lazy-head needs --precision fp32"),
        (["--precision", "int3"], "int3"),
    ],
)
def test_cli_export_refuses_bad_flavor_options(tiny_pair, tmp_path, args, needle):
    from click.testing import CliRunner

    from specrt.cli import cli

    d, t, _ = tiny_pair
    r = CliRunner().invoke(cli, ["export", "--draft", str(d), "--target", str(t), "--out", str(tmp_path / "x"), *args])
    assert r.exit_code != 0 and needle in r.output
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_export_quality_record(int4_pair):
    """The quality record the int4 pair's export wrote (conftest: 2 held-out windows of 32, 2
    prompts of 8 new tokens) has the runtime scorer's figures and leaves no scratch folder
    (that the figures are the exported target's against the fp32 target's:
    test_quality.py::test_export_quality_record_scores_the_export_against_fp32_pytorch)."""
    from specrt.export.quality import holds

    rec = load_manifest(int4_pair[2]).extra["quality"]
    h, e = rec["heldout_stdlib"], rec["humaneval"]
    assert h["positions"] == 64 and e["positions"] == 16 and e["prompts"] == 2
    for s in (h, e):
        assert 0.0 <= s["top1_agreement"] <= 1.0 and s["loss"] > 0 and s["loss_delta"] == pytest.approx(s["loss"] - s["loss_reference"])
    assert rec["holds"] == holds(rec)
    assert not (int4_pair[2] / ".quality_reference").exists()


def test_old_manifest_without_the_new_fields_loads_with_min_q_1(tiny_pair, tmp_path):
    folder = tmp_path / "old"
    shutil.copytree(tiny_pair[2], folder)
    raw = json.loads((folder / "manifest.json").read_text())
    for role in ("draft", "target"):
        for k in ("graph", "precision", "quant", "data_file", "data_sha256", "exact_min_q", "exactness", "note"):
            raw[role].pop(k, None)
    raw.pop("precision", None)
    (folder / "manifest.json").write_text(json.dumps(raw))
    m = load_manifest(folder)
    assert m.target.graph == "standard" and m.min_q() == 1 and m.precision == "fp32"
    assert replace(m.target, exact_min_q=2).exact_min_q == 2
