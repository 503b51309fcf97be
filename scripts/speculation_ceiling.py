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

    python scripts/speculation_ceiling.py --engines engines/default \\
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
    cp = L.llama_context_default_params()
    cp.n_ctx = 4096; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = n_seq
    cp.n_threads = a["threads"]; cp.n_threads_batch = a["threads"]
    return model, L.llama_init_from_model(model, cp)

batch = L.llama_batch_init(512, 0, a["max_batch"])

def decode(ctx, toks, pos, seqs):
    batch.n_tokens = len(toks)
    for i, (t, p, s) in enumerate(zip(toks, pos, seqs)):
        batch.token[i] = t; batch.pos[i] = p; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = s; batch.logits[i] = 1
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    L.llama_synchronize(ctx)

def timed(ctx, mem, toks, pos, seqs, reps):
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter(); decode(ctx, toks, pos, seqs); out.append(time.perf_counter() - t0)
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
    """Median ms of specrt's target at widths 1..q_max, draft 1-token step and batched steps
    B = 1..max_batch, every call reading ``past`` KV rows (the Engine's own sessions)."""
    from specrt.runtime.serve.batching import measure_step_costs

    def timed(model, q):
        t = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            model.run([7] * q, past)
            t.append(time.perf_counter() - t0)
        return float(np.median(t[1:]) * 1e3)

    out = dict(target={str(q): timed(eng.target, q) for q in range(1, q_max + 1)}, draft={"1": timed(eng.draft, 1)})
    steps = measure_step_costs(batched, length=past, reps=reps, vocab=eng.manifest.vocab_size)
    out["batched"] = {str(b): steps.step_s[b] * 1e3 for b in range(1, max_batch + 1)}
    return out


def tokens_per_pass(eng, prompts: list[str], ks: list[int], new_tokens: int) -> dict:
    """Measured tokens per target pass L(k) at fixed k (threshold 0: every round drafts k),
    greedy, and the tuned defaults' (k_max, threshold); also their measured tokens/s."""
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
        out[name] = dict(tokens_per_pass=tok / passes, tokens_per_second=tok / sec, **kw)
    return out


def medians(samples: list[dict]) -> dict:
    """Per (table, key): median, 25th and 75th percentile over the repetitions (ms)."""
    out = {}
    for table in samples[0]:
        out[table] = {}
        for key in samples[0][table]:
            v = [s[table][key] for s in samples]
            out[table][key] = dict(median=float(np.median(v)), q25=float(np.percentile(v, 25)), q75=float(np.percentile(v, 75)))
    return out


def ceilings(costs: dict, L: dict | None, ks: list[int], baseline_ms: float, min_q: int = 1, goal: float = 1.5) -> dict:
    """Tokens/s ceilings (and at measured L) of speculation at each k from the median costs,
    their ratio to ``baseline_ms`` per token (a target-only system), and the tokens per pass
    a ``goal`` x speedup over that baseline would need (more than k+1: out of reach at k).

    Args:
        costs: :func:`medians` of one system's costs (``target`` widths, ``draft`` "1").
        L: :func:`tokens_per_pass` records (keys ``k<k>``) or None.
        ks: speculative factors; min_q: narrowest target call (specrt's ``exact_min_q``).
    """
    t = {int(q): v["median"] for q, v in costs["target"].items()}
    d = costs["draft"]["1"]["median"]
    rows = {}
    for k in ks:
        rnd = t[max(k + 1, min_q)] + k * d
        r = dict(round_ms=rnd, ceiling_tok_s=1e3 * (k + 1) / rnd, ceiling_vs_baseline=baseline_ms * (k + 1) / rnd)
        r[f"tokens_per_pass_for_{goal}x"] = goal * rnd / baseline_ms  # k+1 is the most a pass can give
        if L is not None:
            r["at_measured_L_tok_s"] = 1e3 * L[f"k{k}"]["tokens_per_pass"] / rnd
            r["at_measured_L_vs_baseline"] = baseline_ms * L[f"k{k}"]["tokens_per_pass"] / rnd
        rows[str(k)] = r
    return rows


def main(argv=None) -> dict:
    """Measure, compute the ceilings, print and (``--out``) write the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--llama-python", help="python of a venv with llama-cpp-python (llama.cpp rows)")
    ap.add_argument("--gguf-target")
    ap.add_argument("--gguf-draft")
    ap.add_argument("--prompts", help="JSONL of held-out prompts for the measured tokens per pass")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--past", type=int, default=200, help="KV rows every timed call reads")
    ap.add_argument("--k", default="1,2,3,4")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30, help="calls per cost per repetition")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repetitions (specrt, llama.cpp, ...)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (specrt: the Engine's defaults)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    from specrt import Engine
    from specrt.runtime.backends.ort_gqa_batch import BatchedGqaModel

    ks = [int(k) for k in a.k.split(",")]
    q_max = max(ks) + 1
    eng = Engine(a.engines)
    min_q = eng.manifest.min_q()
    batched = BatchedGqaModel(eng.target, a.max_batch, eng.target.max_q)
    for s in range(0, a.past, 16):  # the single-sequence sessions' past rows (values do not matter for timing)
        eng.target.run([1] * min(16, a.past - s), s)
        eng.draft.run([1] * min(16, a.past - s), s)
    llama_reason = None
    if not (a.llama_python and a.gguf_target and a.gguf_draft):
        llama_reason = "not measured: needs --llama-python, --gguf-target and --gguf-draft"
    load0 = os.getloadavg()
    ours, theirs = [], []
    for r in range(a.rounds):
        ours.append(specrt_costs(eng, batched, a.past, q_max, a.max_batch, a.reps))
        if llama_reason is None:
            arg = dict(target=a.gguf_target, draft=a.gguf_draft, past=a.past, q_max=q_max, max_batch=a.max_batch, reps=a.reps, threads=a.threads)
            p = subprocess.run([a.llama_python, "-c", LLAMA_SNIPPET, json.dumps(arg)], capture_output=True, text=True)
            if p.returncode != 0:
                llama_reason = f"llama.cpp measurement failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}"
            else:
                theirs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"repetition {r + 1}/{a.rounds} done", file=sys.stderr)
    load1 = os.getloadavg()
    ours_m = medians(ours)
    L = None
    if a.prompts:
        with open(a.prompts) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()][: a.limit]
        L = tokens_per_pass(eng, prompts, ks, a.new_tokens)

    rec = dict(
        command="python scripts/speculation_ceiling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        cpus=os.cpu_count(),
        load_avg_1min=[load0[0], load1[0]],
        past=a.past,
        rounds=a.rounds,
        reps=a.reps,
        specrt=dict(engines=a.engines, min_q=min_q, costs_ms=ours_m),
        tokens_per_pass=L,
    )
    spec_only_ms = ours_m["target"][str(min_q)]["median"]
    rec["specrt"]["target_only_ms_per_token"] = spec_only_ms
    rec["specrt"]["speculation_vs_own_target_only"] = ceilings(ours_m, L, ks, spec_only_ms, min_q)
    bat = {b: v["median"] for b, v in ours_m["batched"].items()}
    rec["specrt"]["batched_tok_s"] = {b: 1e3 * int(b) / ms for b, ms in bat.items()}
    if llama_reason is None:
        th = medians(theirs)
        ll1 = th["target"]["1"]["median"]
        rec["llama_cpp"] = dict(gguf_target=a.gguf_target, gguf_draft=a.gguf_draft, threads=a.threads, costs_ms=th, target_only_ms_per_token=ll1)
        rec["specrt"]["speculation_vs_llama_cpp_target_only"] = ceilings(ours_m, L, ks, ll1, min_q)
        rec["llama_cpp"]["speculation_on_its_kernels_vs_its_target_only"] = ceilings(th, L, ks, ll1)
        rec["llama_cpp"]["batched_tok_s"] = {b: 1e3 * int(b) / v["median"] for b, v in th["batched"].items()}
    else:
        rec["llama_cpp"] = dict(reason=llama_reason)
    if L is not None:
        one = max(v["tokens_per_second"] for v in L.values())
        rec["batching"] = dict(
            one_client_best_measured_tok_s=one,
            specrt_batched_ceiling_vs_one_client={b: v / one for b, v in rec["specrt"]["batched_tok_s"].items()},
            # a 3x goal at B rows needs one batched step to cost at most B / (3 x one client's rate)
            step_ms_for_3x={b: 1e3 * int(b) / (3 * one) for b in rec["specrt"]["batched_tok_s"]},
        )
    print(json.dumps(rec, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    return rec


if __name__ == "__main__":
    main()
