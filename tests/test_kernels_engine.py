"""An engine folder whose target runs on specrt's kernels: SmolLM2-135M-Instruct Q4_1 (a real
GGUF file the registry ships) exported int4, so the export writes the target's panels (and the
draft's, requantized to Q4_0: the same file drafts for itself) and the runtime takes the
``kernels`` backend on a CPU that runs them.

Oracles: the target alone (speculative == target-only, greedy, every width the loop makes,
prefix hits == cold runs); the manifest's files map (the panels are hashed at load); the
onnxruntime graph of the same folder (what a machine without the kernels runs, with a one-line
note saying why).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from specrt import Engine, GenerationConfig  # noqa: E402
from specrt.runtime import kernels as K  # noqa: E402
from specrt.runtime.errors import ExportError  # noqa: E402

if K.status() is not None:
    pytest.skip(f"kernels not available: {K.status()}", allow_module_level=True)

PROMPTS = ["def fibonacci(n):\n    ", "import os\n\ndef list_python_files(root):\n", "The three primary colours are"]


@pytest.fixture(scope="module")
def smol_gguf():
    from specrt.export.fetch import fetch

    try:
        return fetch("smollm2-135m-instruct-q4_1", log=lambda *_: None)
    except ExportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot fetch the SmolLM2 GGUF here: {e}")


@pytest.fixture(scope="module")
def folder(smol_gguf, tmp_path_factory):
    """The exported engine folder (int4: the target keeps the file's blocks; panels written)."""
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("smol_int4")
    lines: list[str] = []
    export_pair(smol_gguf, smol_gguf, root / "engine", k_max=4, max_ctx=512, log=lines.append, precision="int4", gguf_cache=root / "hf")
    assert any("kernels: target.panels" in x for x in lines), lines
    return root / "engine"


@pytest.fixture(scope="module")
def engine(folder):
    # named: which backend an unnamed load takes is the export's timing of both on this
    # machine (test_a_measured_slower_machine_keeps_the_onnx_graph), and a loaded machine may
    # time the ONNX graph faster
    return Engine(folder, backend="kernels")


def test_the_export_writes_checked_panels_and_their_timing(engine):
    m = engine.manifest
    rec = m.extra["kernels"]["target"]
    assert rec["file"] == "target.panels" and rec["file"] in m.files and m.files[rec["file"]].bytes > 0
    assert rec["dims"]["arch"] == "llama" and rec["rope_neox"] is False
    assert "gguf.dequantize" in rec["checked"]
    (t,) = rec["measured"]
    assert t["kernels_ms"] > 0 and t["ort_ms"] > 0 and t["isa"] == K.cpu_isa() and t["machine"]["cores"] >= 1


def test_the_engine_runs_the_target_on_the_kernels(engine):
    assert engine.backend == "kernels" and engine.width_exact and engine.min_q == 1
    t = engine.manifest.extra["kernels"]["target"]["measured"][0]
    if t["kernels_ms"] < t["ort_ms"]:  # an unnamed load takes the faster path the export timed
        assert Engine(engine.folder).backend == "kernels"
    assert type(engine.target).__name__ == "KernelModel" and type(engine.draft).__name__ == "KernelModel"
    d = engine.manifest.extra["kernels"]["draft"]
    assert d["file"] in engine.manifest.files and d["requantized"]["type"] == "Q4_0"
    assert "head" not in d  # SmolLM2's 49,152 ids are fewer than the 65,536 a draft head keeps
    assert [m["isa"] for m in d["measured"]] == list(K.ISAS[: K.ISAS.index(K.cpu_isa()) + 1])  # its step timed on every path
    assert all(m["step_ms"] > 0 and m["machine"]["cores"] >= 1 for m in d["measured"])
    assert engine.plan(engine.resolve(GenerationConfig())).min_q == 1


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_equals_target_only_on_the_kernels(engine, k):
    """Greedy speculative output == the target's own greedy output (1-row target-only steps,
    verification passes of every width up to k + 1)."""
    for p in PROMPTS:
        alone = engine.generate(p, GenerationConfig(max_new_tokens=40, speculative=False))
        spec = engine.generate(p, GenerationConfig(max_new_tokens=40, k_max=k, threshold=0.0))
        assert spec.tokens == alone.tokens, p
        assert spec.stats.target_calls < alone.stats.target_calls


def test_greedy_rounds_read_reduced_heads_and_equal_full_rows(engine, monkeypatch):
    """Plain greedy verification reads each row's token from the kernels' argmax head, and
    each draft step its token and confidence from the draft's reduced head (no logits row
    written); anything that reads rows (logprobs, sampling) gets full rows, and a logit bias
    (like a constraint) reduces the target's rows with its penalty rows while the draft's steps
    read full rows. Speculative output on reduced heads == target-only output on full logits
    rows, and target-only on argmax rows too."""
    from dataclasses import replace

    cfg = GenerationConfig(max_new_tokens=40, k_max=4, threshold=0.0)
    vocab = engine.manifest.vocab_size
    assert engine.plan(engine.resolve(cfg)).argmax == vocab
    for other in (replace(cfg, logprobs=0), replace(cfg, temperature=0.7, seed=1)):
        assert engine.plan(engine.resolve(other)).argmax == 0
    assert engine.plan(engine.resolve(replace(cfg, logit_bias={5: -1.0}))).argmax == vocab
    calls = []
    run_argmax = engine.target.run_argmax
    monkeypatch.setattr(engine.target, "run_argmax", lambda *a: calls.append(len(a[0])) or run_argmax(*a))
    steps = []
    run_top1 = engine.draft.run_top1
    monkeypatch.setattr(engine.draft, "run_top1", lambda *a: steps.append(a) or run_top1(*a))
    for p in PROMPTS:
        n, d = len(calls), len(steps)
        spec = engine.generate(p, cfg)
        assert len(calls) > n and max(calls[n:]) > 1, "verification passes read argmax rows"
        assert len(steps) > d, "draft steps read the reduced head"
        n, d = len(calls), len(steps)
        full = engine.generate(p, replace(cfg, logprobs=0))
        assert len(calls) == n and len(steps) == d, "logprobs read full rows"
        assert full.tokens == spec.tokens
        full = engine.generate(p, replace(cfg, speculative=False, logprobs=0))
        assert len(calls) == n, "logprobs read full rows"
        alone = engine.generate(p, replace(cfg, speculative=False))
        assert len(calls) > n, "target-only steps read argmax rows"
        assert spec.tokens == full.tokens == alone.tokens, p
        assert spec.text == full.text
    n, d = len(calls), len(steps)
    engine.generate(PROMPTS[0], replace(cfg, temperature=0.7, seed=1))
    assert (len(calls), len(steps)) == (n, d), "sampling reads full rows, the target's and the draft's"
    engine.generate(PROMPTS[0], replace(cfg, logit_bias={5: -1.0}))
    assert len(calls) > n and len(steps) == d, "a logit bias: the target's rows reduced with it, the draft's full"


def test_a_repeated_prompt_reuses_rows_and_equals_its_cold_run(folder):
    """Any layout is exact on the kernels: the second request reuses every row a call can."""
    e = Engine(folder, backend="kernels")
    cfg = GenerationConfig(max_new_tokens=24, logprobs=0)
    cold = Engine(folder, prefix_cache=False, backend="kernels").generate(PROMPTS[1], cfg)
    first = e.generate(PROMPTS[1], cfg)
    again = e.generate(PROMPTS[1], cfg)
    assert first.tokens == again.tokens == cold.tokens
    assert [x.logprob for x in again.logprobs] == [x.logprob for x in cold.logprobs]
    assert again.stats.cached_tokens == len(e.prompt_ids(PROMPTS[1])) - 1


def test_without_the_library_the_onnx_graph_runs_with_a_note(folder, monkeypatch, caplog):
    """A machine where the kernels were not built (no C compiler at install) loads the same
    folder on onnxruntime, saying so in one line."""
    import specrt.runtime.kernels as kern
    import specrt.runtime.target_path as tp

    monkeypatch.setattr(kern, "_find", lambda: None)
    monkeypatch.setattr(kern, "_state", {})
    monkeypatch.setattr(tp, "_SAID", set())
    with caplog.at_level(logging.WARNING, logger="specrt"):
        e = Engine(folder)
    assert e.backend == "ort-cpu" and not e.width_exact
    notes = [r.getMessage() for r in caplog.records if "not specrt's kernels" in r.getMessage()]
    assert len(notes) == 1 and "not built at install" in notes[0] and "\n" not in notes[0]
    alone = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16, speculative=False))
    assert e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=16)).tokens == alone.tokens
    from specrt.runtime.errors import BackendError

    with pytest.raises(BackendError, match="backend 'kernels' is unavailable here: specrt's kernels were not built"):
        Engine(folder, backend="kernels")


def test_a_measured_slower_machine_keeps_the_onnx_graph(folder, tmp_path, caplog):
    """The export's timing on this kind of machine decides: where the graph measured faster,
    a folder loads on onnxruntime (one line), unless ``kernels`` is named."""
    import json

    import specrt.runtime.target_path as tp

    copy = tmp_path / "engine"
    shutil.copytree(folder, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["extra"]["kernels"]["target"]["measured"][0].update(kernels_ms=50.0, ort_ms=10.0)
    (copy / "manifest.json").write_text(json.dumps(m))
    tp._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="specrt"):
        assert Engine(copy, verify_hashes=False).backend == "ort-cpu"
    assert any("measured 10.0 ms against the kernels' 50.0 ms" in r.getMessage() for r in caplog.records)
    assert Engine(copy, verify_hashes=False, backend="kernels").backend == "kernels"


def test_altered_panels_are_refused_at_load(folder, tmp_path):
    from specrt.runtime.errors import EngineError

    copy = tmp_path / "engine"
    shutil.copytree(folder, copy)
    with open(copy / "target.panels", "r+b") as f:
        f.seek(4096 * 3 + 17)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(EngineError, match="target.panels"):
        Engine(copy, backend="kernels")


def test_adaptive_k_reuses_recorded_costs_of_its_own_backend_only(folder, tmp_path):
    """Costs ``specrt tune`` recorded on the ONNX graph (a record without ``backend``, or with
    another) would mislead adaptive k on the kernels: the Engine measures its own instead."""
    import json

    from specrt.runtime.machine import machine_record

    copy = tmp_path / "engine"
    shutil.copytree(folder, copy)
    m = json.loads((copy / "manifest.json").read_text())
    fake = {"draft_s_per_call": 9.0, "target_s_by_q": {str(q): 1.0 for q in range(1, 6)}, "machine": machine_record()}
    for backend, used in ((None, False), ("ort-cpu", False), ("kernels", True)):
        m["extra"]["tune"] = {"costs": {**fake, **({"backend": backend} if backend else {})}, "machine": fake["machine"]}
        (copy / "manifest.json").write_text(json.dumps(m))
        e = Engine(copy, verify_hashes=False)
        assert e.backend == "kernels"
        assert (e.adaptive_costs()[1] == 9.0) is used, backend


# ---- continuous batching on the kernels (issue 45): rows of a batched call are batch-1 rows -----


def test_a_batched_call_gives_every_row_its_batch1_bits(engine):
    """KernelBatch: rows of several slots in one call (q = 1 each, and a slot with two rows
    beside others) equal the same rows of a batch-1 model alone, bit for bit; an exchange
    moves a slot's cache whole; bad rows are refused in one line."""
    import numpy as np

    from specrt.runtime.backends import batched_model
    from specrt.runtime.errors import InputError

    rng = np.random.default_rng(3)
    V = engine.manifest.vocab_size
    seqs = [rng.integers(0, V, size=n).tolist() for n in (9, 3, 17, 6)]
    ref = []
    for s in seqs:
        alone = engine.target.fork()
        alone.run(s[:-2], 0)
        ref.append(alone.run(s[-2:], len(s) - 2).copy())  # rows of the last two positions
        alone.close()
    b = batched_model(engine.target, 4)
    assert type(b).__name__ == "KernelBatch" and b.exact
    try:
        for j, s in enumerate(seqs):
            b.slots[j].run(s[:-2], 0)
        got = b.step([s[-2] for s in seqs], [len(s) - 2 for s in seqs]).copy()
        for i in range(4):
            assert np.array_equal(got[i], ref[i][0]), i
        # slot 2's last row beside a 2-row... after the exchange slot 0 holds slot 2's cache
        b.exchange(0, 2)
        got = b.rows([0, 1, 3], [seqs[2][-1], seqs[1][-1], seqs[3][-1]], [len(seqs[2]) - 1, len(seqs[1]) - 1, len(seqs[3]) - 1]).copy()
        assert np.array_equal(got[0], ref[2][1]) and np.array_equal(got[1], ref[1][1]) and np.array_equal(got[2], ref[3][1])
        with pytest.raises(InputError, match="one \\(slot, position\\) twice"):
            b.rows([1, 1], [1, 2], [4, 4])
        with pytest.raises(InputError, match="slots 0..3"):
            b.rows([4], [1], [0])
        with pytest.raises(InputError, match="positions must be in"):
            b.rows([0], [1], [engine.manifest.max_ctx])
    finally:
        b.close()


@pytest.mark.parametrize("policy", ["batched", "auto"])
def test_batched_serving_on_the_kernels_equals_each_request_alone(folder, policy):
    """BatchPool over the kernels: greedy and seeded sampled requests, with logprobs, run
    together through batched steps (and, under auto, speculative rounds) equal each request
    alone bit for bit (tokens, text, logprobs); the rows batched steps wrote stay reusable."""
    from test_batching import flat_costs, submit_together

    from specrt.runtime.constraints import Constraint
    from specrt.runtime.serve.batching import BatchPool

    e = Engine(folder, backend="kernels")
    cold = Engine(folder, prefix_cache=False, backend="kernels")
    prompts = PROMPTS + ["def add(a, b):\n", "A JSON object with a count:"]
    schema = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"], "additionalProperties": False}
    cfgs = [
        dict(max_new_tokens=28, logprobs=2),
        dict(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=7, logprobs=1),
        # Algorithm 1 under a seed: its draws depend on the round, so it never takes a batched step
        dict(max_new_tokens=24, temperature=1.0, seed=11, sampler="rejection"),
        dict(max_new_tokens=16, k_max=2, logprobs=0),
        # forced tokens reach the KV in the row's next verification call (its catch-up rows)
        dict(max_new_tokens=24, constraint=Constraint.json_schema(schema)),
    ]
    # costs that make a batched step the cheaper choice under auto too
    pool = BatchPool(e, 4, policy=policy, costs=flat_costs(4, 1e-6))
    try:
        jobs = submit_together(pool, e, prompts, cfgs)
        results = [ev.result(timeout=120) for _, ev in jobs]
        assert pool.steps["batched"] > 0, pool.steps
        for p, c, r in zip(prompts, cfgs, results):
            alone = cold.generate(p, GenerationConfig(**c))
            assert r.tokens == alone.tokens and r.text == alone.text, (p, c)
            if c.get("logprobs") is not None:
                assert [(x.token, x.logprob, x.top) for x in r.logprobs] == [(x.token, x.logprob, x.top) for x in alone.logprobs]
        assert results[4].stats.forced > 0  # the fifth waited for a slot, then had tokens forced
        # a follow-up whose prompt is the first request's whole sequence reuses the rows its
        # batched steps computed (before: a batched row ended the reusable prefix)
        follow = prompts[0] + results[0].text
        ((job, ev),) = submit_together(pool, e, [follow], [dict(max_new_tokens=8)])
        r = ev.result(timeout=120)
        assert r.stats.cached_tokens > len(e.prompt_ids(prompts[0])) + 10
        assert r.tokens == cold.generate(follow, GenerationConfig(max_new_tokens=8)).tokens
    finally:
        pool.close()


# ---- one Engine from several threads, closed Engines (issue 51) ------------------------------


def _without_recorded_costs(folder, tmp_path):
    """A copy of the folder whose manifest has no recorded costs: adaptive k measures them on
    the Engine's own models at its first plan."""
    import json

    copy = tmp_path / "engine"
    shutil.copytree(folder, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["extra"].pop("tune", None)
    (copy / "manifest.json").write_text(json.dumps(m))
    return copy


def test_two_threads_on_one_engine_with_adaptive_k_equal_serial_runs(folder, tmp_path):
    """A generation holds the Engine while another thread's first adaptive plan measures the
    call costs: the measurement (calls at 256 rows of past, on the Engine's own models) waits
    for the lock, so the running generation (a prompt past 256 tokens: the rows the
    measurement writes) keeps its KV and gives its serial output, tokens and logprobs bit for
    bit. Before, the measurement ran beside it and overwrote its rows."""
    import threading

    copy = _without_recorded_costs(folder, tmp_path)
    serial = Engine(copy, backend="kernels")
    long_prompt = ""
    for i in range(100):  # past the 256 rows the measurement writes, inside the 512-row context with its 48 new tokens
        long_prompt += f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n"
        if len(serial.prompt_ids(long_prompt)) > 300:
            break
    assert 300 < len(serial.prompt_ids(long_prompt)) < 400
    # long enough to be running while the measurement would (150 target-only steps), and with
    # logprobs: a KV row changed under it changes them even where the greedy token holds
    cfg_a = GenerationConfig(max_new_tokens=150, speculative=False, logprobs=0)
    cfg_b = GenerationConfig(max_new_tokens=24, k_max=4, threshold=0.0, adaptive=True)
    alone = serial.generate(long_prompt, cfg_a)
    want_a = (alone.tokens, [lp.logprob for lp in alone.logprobs])
    want_b = serial.generate(PROMPTS[0], cfg_b).tokens
    shared = Engine(copy, backend="kernels")
    assert shared._adaptive is None
    got: dict = {}
    started = threading.Event()

    def a():
        stream = shared.stream(long_prompt, cfg_a)
        got["a"] = [next(iter(stream))]  # the lock is held from the first piece on
        started.set()
        got["a"] += list(stream)
        got["a_tokens"] = (stream.result.tokens, [lp.logprob for lp in stream.result.logprobs])

    def b():
        started.wait(60)
        got["b"] = shared.generate(PROMPTS[0], cfg_b).tokens

    ts = [threading.Thread(target=f) for f in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert not any(t.is_alive() for t in ts)
    assert got["a_tokens"] == want_a, "the running generation's KV was overwritten (its tokens or logprobs changed)"
    assert got["b"] == want_b
    assert shared._adaptive is not None


def test_a_closed_engine_refuses_every_call_in_one_line(engine):
    """Engine.close() frees the models' buffers: a generation, a cost measurement or a fork
    after it raises a specrt error, never reaches C."""
    from specrt.runtime.costs import measure_costs
    from specrt.runtime.errors import EngineError

    e = engine.fork()
    e.close()
    with pytest.raises(EngineError, match="closed"):
        e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=4))
    with pytest.raises(EngineError, match="closed"):
        measure_costs(e, [1, 2], 10, reps=1)
    with pytest.raises(EngineError, match="closed"):
        e.fork()
    assert engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=4)).tokens  # the weights live on for the parent
