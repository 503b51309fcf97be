"""The most speculation and batching can give on this machine, from measured per-call costs.

Speculative decoding pays when a verification pass over k+1 positions costs about one
decoding step (Leviathan et al. 2023, Section 3.4, assume exactly that). On a CPU whose
kernels are compute-bound at these sizes each extra position costs a near-constant amount,
and the ceiling is then set by the costs alone, whatever the draft's acceptance:

    round(k)      = c_t(k+1) + k c_d(1)          one verification pass + k draft steps
    ceiling(k)    = (k+1) / round(k)             tokens/s if every candidate is accepted
    at measured L = L(k) / round(k)              L(k): tokens per pass measured at fixed k

compared with a target-only step c_t(min_q) (specrt's exact target-only decoding) and with
llama.cpp's own 1-token step c_ll(1) (its target-only decoding: the fastest CPU system in
docs/bench/compare_int4_defaults.md). The same is computed for speculation driven over
llama.cpp's kernels (its widths and its draft), to show whether faster kernels would change
the answer. Batching: one batched step over B rows, c_b(B), gives at most B / c_b(B)
tokens/s, against one client's best speculative rate.

Every cost is a median over interleaved repetitions: specrt's sessions in this process
(the Engine's own thread settings), llama.cpp's through the low-level API of
llama-cpp-python in its own venv (``--llama-python``; a subprocess per repetition, one
after the other with specrt's), so load changes on a shared machine fall on both.

    python -m specrt.bench.ceiling --engines engines/default \\
        --llama-python /path/to/.venv-llamacpp/bin/python \\
        --gguf-target target-Q4_0.gguf --gguf-draft draft-Q4_0.gguf \\
        --prompts bench_out/test80.jsonl --out docs/bench/speculation_ceiling.json

Without ``--llama-python`` the llama.cpp rows are left out, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from specrt.bench.common import emit, say_machine

# Runs inside llama-cpp-python's venv: costs of one decode call at widths 1..q_max after
# `past` positions (all logits rows, as a verification needs), of the draft's 1-token step,
# and of one batched step of B sequences x 1 token (B = 1..max_batch), in milliseconds.
LLAMA_SNIPPET = r"""
import json, sys, time
import numpy as np
import llama_cpp as L
a = json.loads(sys.argv[1])
L.llama_backend_init()

def context(path, n_seq):
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp cannot load {path}")
    cp = L.llama_context_default_params()
    cp.n_ctx = 4096; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = n_seq
    cp.n_threads = a["threads"]; cp.n_threads_batch = a["threads"]
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"llama.cpp cannot make a context for {path}")
    return model, ctx

batch = L.llama_batch_init(512, 0, a["max_batch"])

def fill(toks, pos, seqs):
    batch.n_tokens = len(toks)
    for i, (t, p, s) in enumerate(zip(toks, pos, seqs)):
        batch.token[i] = t; batch.pos[i] = p; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = s; batch.logits[i] = 1

def run(ctx):
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    L.llama_synchronize(ctx)

def decode(ctx, toks, pos, seqs):
    fill(toks, pos, seqs); run(ctx)

def timed(ctx, mem, toks, pos, seqs, reps):
    out = []
    for _ in range(reps + 1):
        fill(toks, pos, seqs)  # outside the timing: only llama_decode is timed, as only run() is for specrt
        t0 = time.perf_counter(); run(ctx); out.append(time.perf_counter() - t0)
        for s in set(seqs):
            L.llama_memory_seq_rm(mem, s, a["past"], -1)
    return float(np.median(out[1:]) * 1e3)

P = a["past"]; res = {}
for role, path, n_seq in (("target", a["target"], a["max_batch"]), ("draft", a["draft"], 1)):
    model, ctx = context(path, n_seq)
    mem = L.llama_get_memory(ctx)
    for lo in range(0, P, 100):
        decode(ctx, [5] * min(100, P - lo), list(range(lo, min(lo + 100, P))), [0] * min(100, P - lo))
    widths = range(1, a["q_max"] + 1) if role == "target" else [1]
    res[role] = {str(q): timed(ctx, mem, [7] * q, list(range(P, P + q)), [0] * q, a["reps"]) for q in widths}
    if role == "target":
        for s in range(1, a["max_batch"]):
            L.llama_memory_seq_cp(mem, 0, s, -1, -1)
        res["batched"] = {str(b): timed(ctx, mem, [7] * b, [P] * b, list(range(b)), a["reps"]) for b in range(1, a["max_batch"] + 1)}
    L.llama_free(ctx); L.llama_model_free(model)
print(json.dumps(res))
"""


def specrt_costs(eng, batched, past: int, q_max: int, max_batch: int, reps: int) -> dict:
    """One repetition of specrt's per-call costs, on the Engine's own sessions: the tuner's
    :func:`~specrt.runtime.costs.measure_costs` (cases in random order; a width below the
    engine's ``exact_min_q`` is timed as the wider call the decode loop makes) and the batch
    scheduler's :func:`~specrt.runtime.costs.measure_step_costs`.

    Args:
        eng: a :class:`specrt.Engine`; batched: a
            :class:`~specrt.runtime.backends.ort_gqa_batch.BatchedGqaModel` over it.
        past: KV rows every timed call reads; q_max: widest target call timed.
        max_batch: batched steps timed for B = 1..max_batch; reps: calls per cost.

    Returns:
        ``{"target": {"q": ms}, "draft": {"1": ms}, "batched": {"B": ms}}``: medians of
        ``reps`` calls in milliseconds.

    Raises:
        InputError: a width outside 1..k_max+1 or ``past + q > max_ctx`` (measure_costs);
        ValueError: no row left for the batched step (measure_step_costs).
    """
    from specrt.runtime.costs import measure_costs, measure_step_costs

    c = measure_costs(eng, range(1, q_max + 1), past, reps=reps)
    out = dict(target={str(q): s * 1e3 for q, s in c.target_s_by_q.items()}, draft={"1": c.draft_s_per_call * 1e3}, batched={})
    if batched is not None:
        steps = measure_step_costs(batched, length=past, reps=reps, vocab=eng.manifest.vocab_size)
        out["batched"] = {str(b): steps.step_s[b] * 1e3 for b in range(1, max_batch + 1)}
    return out


def llama_bench_costs(bench: str, target: str, draft: str, past: int, q_max: int, threads: int) -> dict:
    """llama.cpp's costs from its ``llama-bench`` (no llama-cpp-python needed): ms of a call
    of q = 1..q_max tokens at depth ``past`` on the target, and of a 1-token call on the draft;
    no batched steps (``{"target", "draft", "batched": {}}``)."""
    from specrt.bench.kernel_step import llama_round

    t = llama_round(bench, target, past, threads, [])
    d = llama_round(bench, draft, past, threads, [])
    return dict(target={str(q): v for q, v in t["calls_ms"].items() if q <= q_max}, draft={"1": d["calls_ms"][1]}, batched={})


def tokens_per_pass(eng, prompts: list[str], ks: list[int], new_tokens: int) -> dict:
    """Measured tokens per target pass L(k), greedy, on ``prompts``.

    Args:
        eng: a :class:`specrt.Engine`; prompts: texts; ks: fixed k values (threshold 0:
            every round drafts k); new_tokens: tokens per prompt (>= 2).

    Returns:
        ``{"k<k>": {...}, "defaults": {...}}`` (``defaults``: the manifest's decoding
        defaults), each with ``tokens_per_pass`` (decoded tokens / target passes, the
        prefill's token excluded) and ``tokens_per_second`` (decoding time only).

    Raises:
        ValueError: no target pass was made (``new_tokens < 2`` or no prompts).
    """
    from specrt import GenerationConfig

    out = {}
    cases = [(f"k{k}", dict(k_max=k, threshold=0.0)) for k in ks] + [("defaults", {})]
    for name, kw in cases:
        tok = passes = sec = 0.0
        for p in prompts:
            st = eng.generate(p, GenerationConfig(max_new_tokens=new_tokens, **kw)).stats
            tok += st.new_tokens - 1  # the prefill's token costs no decoding pass
            passes += st.passes
            sec += st.total_seconds - st.prefill_seconds
        if not passes:
            raise ValueError(f"{name}: no target pass in {len(prompts)} prompts x {new_tokens} tokens; need prompts and --new-tokens >= 2")
        out[name] = dict(tokens_per_pass=tok / passes, tokens_per_second=tok / sec, **kw)
    return out


def medians(samples: list[dict]) -> dict:
    """Median and quartiles over repetitions.

    Args:
        samples: one ``{table: {key: ms}}`` per repetition, all with the same keys.

    Returns:
        ``{table: {key: {"median", "q25", "q75"}}}`` in the samples' unit (ms).

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("no repetitions to summarise")
    out = {}
    for table in samples[0]:
        out[table] = {}
        for key in samples[0][table]:
            v = [x[table][key] for x in samples]
            out[table][key] = dict(median=float(np.median(v)), q25=float(np.percentile(v, 25)), q75=float(np.percentile(v, 75)))
    return out


def ceilings(costs: dict, L: dict | None, ks: list[int], baseline_ms: float, min_q: int = 1, goal: float = 1.5) -> dict:
    """Speculation's ceiling at each k from median per-call costs.

    A round of k candidates costs ``c_t(max(k+1, min_q)) + k c_d(1)`` (one verification
    pass, k draft steps; host work and prefill left out, which only raises the ceiling) and
    yields at most k+1 tokens (Leviathan et al. 2023, Algorithm 1).

    Args:
        costs: :func:`medians` of one system (``target`` widths ``"1".."q_max"``, ``draft``
            ``"1"``), in ms.
        L: :func:`tokens_per_pass` records or None; a k without a ``k<k>`` record gets no
            measured-L fields.
        ks: speculative factors (each needs ``max(k+1, min_q) <= q_max``).
        baseline_ms: ms per token of the target-only system compared with.
        min_q: narrowest target call (specrt's ``exact_min_q``; 1 for other systems).
        goal: speedup whose required tokens per pass is reported.

    Returns:
        ``{"k": {"round_ms", "ceiling_tok_s", "ceiling_vs_baseline",
        "tokens_per_pass_for_<goal>x"[, "at_measured_L_tok_s", "at_measured_L_vs_baseline"]}}``;
        a required tokens per pass above k+1 means the goal is out of reach at that k.

    Raises:
        KeyError: a width the costs do not hold.
    """
    t = {int(q): v["median"] for q, v in costs["target"].items()}
    d = costs["draft"]["1"]["median"]
    rows = {}
    for k in ks:
        rnd = t[max(k + 1, min_q)] + k * d
        r = dict(round_ms=rnd, ceiling_tok_s=1e3 * (k + 1) / rnd, ceiling_vs_baseline=baseline_ms * (k + 1) / rnd)
        r[f"tokens_per_pass_for_{goal}x"] = goal * rnd / baseline_ms
        if L is not None and f"k{k}" in L:
            r["at_measured_L_tok_s"] = 1e3 * L[f"k{k}"]["tokens_per_pass"] / rnd
            r["at_measured_L_vs_baseline"] = baseline_ms * L[f"k{k}"]["tokens_per_pass"] / rnd
        rows[str(k)] = r
    return rows


def best(rows: dict) -> dict:
    """The k with the highest ceiling and the k with the highest rate at measured L (where
    measured) of a :func:`ceilings` table: ``{"ceiling": {"k", "vs_baseline"},
    "at_measured_L": {...} or None}``."""
    k1 = max(rows, key=lambda k: rows[k]["ceiling_vs_baseline"])
    out = dict(ceiling=dict(k=int(k1), vs_baseline=rows[k1]["ceiling_vs_baseline"]), at_measured_L=None)
    measured = [k for k in rows if "at_measured_L_vs_baseline" in rows[k]]
    if measured:
        k2 = max(measured, key=lambda k: rows[k]["at_measured_L_vs_baseline"])
        out["at_measured_L"] = dict(k=int(k2), vs_baseline=rows[k2]["at_measured_L_vs_baseline"])
    return out


def llama_costs(python: str, arg: dict, timeout: float = 600.0) -> tuple[dict | None, str | None]:
    """One repetition of llama.cpp's costs: :data:`LLAMA_SNIPPET` run by ``python``.

    Returns:
        ``(costs, None)`` with the snippet's ``{"target", "draft", "batched"}`` ms, or
        ``(None, reason)`` when it failed, timed out or printed no JSON (never raises).
    """
    try:
        p = subprocess.run([python, "-c", LLAMA_SNIPPET, json.dumps(arg)], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"llama.cpp measurement failed: {type(e).__name__}: {e}"
    if p.returncode != 0:
        return None, f"llama.cpp measurement failed (exit {p.returncode}): {' '.join((p.stderr or p.stdout).strip().splitlines()[-1:])}"
    try:
        return json.loads(p.stdout.strip().splitlines()[-1]), None
    except (IndexError, ValueError):
        return None, "llama.cpp measurement printed no JSON"


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the command line (see the module's docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--llama-python", help="python of a venv with llama-cpp-python (llama.cpp rows)")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench: its call costs without llama-cpp-python (no batched rows)")
    ap.add_argument("--gguf-target")
    ap.add_argument("--gguf-draft")
    ap.add_argument("--prompts", help="JSONL of held-out prompts for the measured tokens per pass")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--past", type=int, default=200, help="KV rows every timed call reads")
    ap.add_argument("--k", default="1,2,3,4", help="k values whose tokens per pass are measured; ceilings for every k up to the largest")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30, help="calls per cost per repetition")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repetitions (specrt, llama.cpp, ...)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (specrt: the Engine's defaults)")
    ap.add_argument("--out")
    return ap, ap.parse_args(argv)


def measure_rounds(a: argparse.Namespace, eng, batched, q_max: int) -> tuple[list, list, str | None]:
    """``--rounds`` interleaved repetitions of specrt's costs and (when asked) llama.cpp's;
    (specrt samples, llama.cpp samples, why llama.cpp was not measured or None)."""
    llama_reason = None
    if not ((a.llama_python or a.llama_bench) and a.gguf_target and a.gguf_draft):
        llama_reason = "not measured: needs --llama-python (or --llama-bench), --gguf-target and --gguf-draft"
    ours, theirs = [], []
    for r in range(a.rounds):
        ours.append(specrt_costs(eng, batched, a.past, q_max, a.max_batch, a.reps))
        if llama_reason is None and a.llama_bench and not a.llama_python:
            theirs.append(llama_bench_costs(a.llama_bench, a.gguf_target, a.gguf_draft, a.past, q_max, a.threads))
        elif llama_reason is None:
            arg = dict(target=a.gguf_target, draft=a.gguf_draft, past=a.past, q_max=q_max, max_batch=a.max_batch, reps=a.reps, threads=a.threads)
            got, llama_reason = llama_costs(a.llama_python, arg)
            if got is not None:
                theirs.append(got)
        print(f"repetition {r + 1}/{a.rounds} done", file=sys.stderr)
    return ours, theirs, llama_reason


def add_llama_cpp(rec: dict, a: argparse.Namespace, ours_m: dict, theirs: list, L, all_k: list[int], min_q: int, llama_reason) -> None:
    """``rec["llama_cpp"]``: llama.cpp's costs and ceilings (speculation on specrt's costs
    against its target-only step, and on its own kernels), or the reason it is absent."""
    if not (llama_reason is None and theirs):
        rec["llama_cpp"] = dict(reason=llama_reason)
        return
    tm = medians(theirs)
    ll1 = tm["target"]["1"]["median"]
    rec["llama_cpp"] = dict(gguf_target=a.gguf_target, gguf_draft=a.gguf_draft, threads=a.threads, costs_ms=tm, target_only_ms_per_token=ll1)
    rows = ceilings(ours_m, L, all_k, ll1, min_q)
    rec["specrt"]["speculation_vs_llama_cpp_target_only"] = dict(rows=rows, best=best(rows))
    rows = ceilings(tm, L, all_k, ll1)
    rec["llama_cpp"]["speculation_on_its_kernels_vs_its_target_only"] = dict(rows=rows, best=best(rows))
    rec["llama_cpp"]["batched_tok_s"] = {b: 1e3 * int(b) / v["median"] for b, v in tm.get("batched", {}).items()}


def add_batching(rec: dict, L: dict) -> None:
    """``rec["batching"]``: the batched ceiling against one client's best measured rate."""
    # the best of the measured settings (fixed k and the defaults): a slight upward bias on a noisy machine
    one = max(v["tokens_per_second"] for v in L.values())
    rec["batching"] = dict(
        one_client_best_measured_tok_s=one,
        specrt_batched_ceiling_vs_one_client={b: v / one for b, v in rec["specrt"]["batched_tok_s"].items()},
        # a 3x goal at B rows needs one batched step to cost at most B / (3 x one client's rate)
        step_ms_for_3x={b: 1e3 * int(b) / (3 * one) for b in rec["specrt"]["batched_tok_s"]},
    )


def main(argv=None) -> dict:
    """Measure, compute the ceilings, print and (``--out``) write the JSON record.

    Raises:
        SystemExit: bad arguments (argparse).
    """
    ap, a = parse_args(argv)

    from dataclasses import asdict

    from specrt import Engine
    from specrt.runtime.backends.base import ThreadConfig
    from specrt.runtime.backends.ort_gqa import OrtGqaModel
    from specrt.runtime.backends.ort_gqa_batch import BatchedGqaModel
    from specrt.runtime.machine import machine_record

    say_machine()
    ks = [int(k) for k in a.k.split(",")]
    tc = ThreadConfig()  # the runtime's defaults (target 2 threads, draft 1, no spinning)
    eng = Engine(a.engines, threads=tc)
    min_q = eng.min_q  # the Engine's: 1 on a width-exact target (specrt's kernels)
    q_max = max(max(ks) + 1, min_q)
    all_k = list(range(1, max(ks) + 1))
    if not 1 <= min(ks) or max(ks) > eng.manifest.k_max:
        ap.error(f"--k {a.k}: every k must be in 1..{eng.manifest.k_max} (these engines' k_max)")
    # the batched step exists for onnxruntime's builder graphs only (not on the kernels yet)
    batched = BatchedGqaModel(eng.target, a.max_batch, eng.target.max_q) if a.max_batch > 0 and isinstance(eng.target, OrtGqaModel) else None
    load0 = os.getloadavg()
    ours, theirs, llama_reason = measure_rounds(a, eng, batched, q_max)
    load1 = os.getloadavg()
    ours_m = medians(ours)
    L = None
    if a.prompts:
        with open(a.prompts) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()][: a.limit]
        L = tokens_per_pass(eng, prompts, ks, a.new_tokens)

    rec = dict(
        command="python -m specrt.bench.ceiling " + " ".join(argv if argv is not None else sys.argv[1:]),
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        cpus=os.cpu_count(),
        machine=machine_record(),
        load_avg_1min=[load0[0], load1[0]],
        past=a.past,
        rounds=a.rounds,
        reps=a.reps,
        specrt=dict(engines=a.engines, backend=eng.backend, min_q=min_q, k_max=eng.manifest.k_max, threads=asdict(tc), costs_ms=ours_m),
        tokens_per_pass=L,
    )
    spec_only_ms = ours_m["target"][str(min_q)]["median"]
    rec["specrt"]["target_only_ms_per_token"] = spec_only_ms
    rows = ceilings(ours_m, L, all_k, spec_only_ms, min_q)
    rec["specrt"]["speculation_vs_own_target_only"] = dict(rows=rows, best=best(rows))
    rec["specrt"]["batched_tok_s"] = {b: 1e3 * int(b) / v["median"] for b, v in ours_m["batched"].items()}
    add_llama_cpp(rec, a, ours_m, theirs, L, all_k, min_q, llama_reason)
    if L is not None and rec["specrt"]["batched_tok_s"]:
        add_batching(rec, L)
    return emit(rec, a.out)


if __name__ == "__main__":
    main()
