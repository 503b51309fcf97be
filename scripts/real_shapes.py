"""Random-weight pairs at real shapes: build checkpoints, export, and measure what they cost.

No model hub: every checkpoint is built here from a config with the published shapes
(hidden size, layers, heads, KV heads, MLP width, vocabulary, tied embeddings) and random
weights, saved in bfloat16 as the published checkpoints are, with a synthetic word-level
tokenizer of the real vocabulary size (ids are all that matter for costs). Subcommands::

    python scripts/real_shapes.py build --preset qwen2.5-1.5b --out bench_out/real/ckpt/qwen2.5-1.5b
    python scripts/real_shapes.py export --draft D --target T --out E [--external-data] --json F
    python scripts/real_shapes.py load --engines E [--engines E2] --repeats 5 --json F
    python scripts/real_shapes.py costs --engines E --k-max 8 --reps 7 --json F
    python scripts/real_shapes.py host --engines E --k-max 8 --json F
    python scripts/real_shapes.py bound --costs F [--costs F2] --json F

Every timing is a median over interleaved repeats, with the 1-minute load average sampled
before and after (the machine is shared: 2 cores). docs/results/real-shapes.md holds the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from specrt.bench.common import emit

# Published shapes (config.json of each checkpoint on the Hugging Face hub, as of 2025):
# Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, meta-llama/Llama-3.2-1B. "tok" is the tokenizer's
# size (ids the tokenizer can produce), "vocab" the logits width (Qwen pads to 151,936).
PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        family="qwen2", vocab=151936, tok=151665, hidden=896, inter=4864, layers=24, heads=14, kv=2, tie=True, rope_theta=1e6, max_pos=32768, eps=1e-6
    ),
    "qwen2.5-1.5b": dict(
        family="qwen2", vocab=151936, tok=151665, hidden=1536, inter=8960, layers=28, heads=12, kv=2, tie=True, rope_theta=1e6, max_pos=32768, eps=1e-6
    ),
    "llama-3.2-1b": dict(
        family="llama",
        vocab=128256,
        tok=128256,
        hidden=2048,
        inter=8192,
        layers=16,
        heads=32,
        kv=8,
        tie=True,
        rope_theta=5e5,
        max_pos=131072,
        eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    # a small draft of the Llama family with Llama-3's vocabulary: the layer shapes of
    # JackFram/llama-68m (2 layers, hidden 768, 12 heads, MLP 3072), tied embeddings
    "llama-68m-128k": dict(
        family="llama", vocab=128256, tok=128256, hidden=768, inter=3072, layers=2, heads=12, kv=12, tie=True, rope_theta=5e5, max_pos=131072, eps=1e-5
    ),
    # the integrity/load-time case of issue 15: a ~714M-parameter Llama, 131,072 ids (untied)
    "llama-714m-131k": dict(
        family="llama", vocab=131072, tok=131072, hidden=2048, inter=5632, layers=4, heads=16, kv=8, tie=False, rope_theta=5e5, max_pos=8192, eps=1e-5
    ),
    "llama-tiny-131k": dict(
        family="llama", vocab=131072, tok=131072, hidden=64, inter=128, layers=1, heads=4, kv=2, tie=True, rope_theta=5e5, max_pos=8192, eps=1e-5
    ),
}


def load_average() -> float:
    """The 1-minute load average (``os.getloadavg``), rounded."""
    return round(os.getloadavg()[0], 2)


def synthetic_tokenizer(n: int):
    """A word-level ``tokenizers.Tokenizer`` with exactly ``n`` ids: ``<|endoftext|>`` (id 0)
    and the words ``w1 .. w{n-1}``, split on whitespace; unknown words map to id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0}
    for i in range(1, n):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    return tok


def preset_config(preset: str):
    """The Hugging Face config of ``preset`` (:data:`PRESETS`): Qwen2Config or LlamaConfig
    with the published shapes, BOS = EOS = id 0 (the synthetic tokenizer's only special)."""
    import transformers as tf

    p = PRESETS[preset]
    common = dict(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        intermediate_size=p["inter"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv"],
        max_position_embeddings=p["max_pos"],
        tie_word_embeddings=p["tie"],
        rms_norm_eps=p["eps"],
        bos_token_id=0,
        eos_token_id=0,
    )
    rope = dict(rope_type="default", rope_theta=p["rope_theta"])
    if "rope_scaling" in p:
        rope = dict(p["rope_scaling"], rope_theta=p["rope_theta"])
    if p["family"] == "qwen2":
        return tf.Qwen2Config(use_sliding_window=False, rope_parameters=rope, **common)
    return tf.LlamaConfig(rope_parameters=rope, **common)


def build(preset: str, out: Path, seed: int = 0) -> dict:
    """Write a random-weight bfloat16 checkpoint of ``preset`` (:data:`PRESETS`) with its
    synthetic tokenizer to ``out``; returns ``{"preset", "params", "bytes", "shape"}``."""
    import torch
    import transformers as tf

    p = PRESETS[preset]
    cfg = preset_config(preset)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # built and saved in bf16: no fp32 copy here
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok = synthetic_tokenizer(p["tok"])
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>").save_pretrained(out)
    n = sum(x.numel() for x in model.parameters())
    size = sum(f.stat().st_size for f in out.iterdir())
    return dict(preset=preset, params=int(n), bytes=int(size), shape=p)


def _cmd_build(a) -> dict:
    t0 = time.perf_counter()
    res = build(a.preset, Path(a.out), a.seed)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


# ---- engine load time ----------------------------------------------------------------------
# One child process per measurement (imports excluded from the timing); the file cache is
# warm after the first run (measurements are of hashing and session creation, not of disk).
LOAD_CHILD = r"""
import json, os, sys, time
from specrt import Engine
from specrt.runtime.integrity import Verification, sha256_file
from specrt.runtime.manifest import check_files, load_manifest
folder, mode = sys.argv[1], sys.argv[2]
info = {}
t0, c0 = time.perf_counter(), time.process_time()
if mode in ("default", "cold", "warm"):  # Engine(folder) as shipped; the parent chooses the digest cache
    e = Engine(folder)
    info = {k: len(v) for k, v in e.integrity.items()}
elif mode == "parallel":  # sizes, then every digest on worker threads (one per CPU), then the sessions
    load_manifest(folder, verify_hashes=False)
    m = load_manifest(folder, verify_hashes=False)
    check_files(m, folder, m.load_files(), True, "")
    Verification(folder, m.load_files(), "", workers=os.cpu_count()).wait()
    e = Engine(folder, verify_hashes=False)
elif mode == "overlap":  # sizes, then the digests on worker threads while the sessions are created
    m = load_manifest(folder, verify_hashes=False)
    check_files(m, folder, m.load_files(), True, "")
    v = Verification(folder, m.load_files(), "", workers=os.cpu_count())
    e = Engine(folder, verify_hashes=False)
    v.wait()
elif mode in ("sequential", "graphs-only"):
    m = load_manifest(folder, verify_hashes=False)
    names = m.load_files() if mode == "sequential" else {n: d for n, d in m.load_files().items() if not n.endswith(".data")}
    for n, d in names.items():  # one file after the other, then the sessions
        assert sha256_file(f"{folder}/{n}") == d, n
    e = Engine(folder, verify_hashes=False)
elif mode == "no-hash":
    e = Engine(folder, verify_hashes=False)
elif mode == "hash-only":
    load_manifest(folder, verify_hashes=True)
t1, c1 = time.perf_counter(), time.process_time()
print(json.dumps(dict(mode=mode, wall_s=t1 - t0, cpu_s=c1 - c0, **info)))
"""
LOAD_MODES = ("cold", "warm", "default", "parallel", "overlap", "sequential", "graphs-only", "no-hash", "hash-only")


def _child_env(mode: str, folder: str, cache_dir: Path) -> dict:
    """Environment of one load child: ``cold`` gets an empty digest cache (deleted before
    each run), ``warm`` one filled by an earlier load of the same folder, ``default`` the
    caller's setting; every other mode runs with the cache off (it measures hashing)."""
    env = dict(os.environ)
    if mode == "cold":
        p = cache_dir / "cold.json"
        p.unlink(missing_ok=True)
        env["SPECRT_DIGEST_CACHE"] = str(p)
    elif mode == "warm":
        p = cache_dir / f"warm-{abs(hash(folder))}.json"
        if not p.exists():  # filled once, by a load that hashes every file
            subprocess.run([sys.executable, "-c", LOAD_CHILD, folder, "hash-only"], env=dict(env, SPECRT_DIGEST_CACHE=str(p)), check=True, capture_output=True)
        env["SPECRT_DIGEST_CACHE"] = str(p)
    elif mode != "default":
        env["SPECRT_DIGEST_CACHE"] = "off"
    return env


def measure_load(folders: list[str], modes: list[str], repeats: int) -> dict:
    """Engine load time per (folder, mode): ``repeats`` rounds, the (folder, mode) order
    rotated every round; medians and quartiles of wall and process CPU seconds.

    Modes: ``cold`` (``Engine(folder)`` as shipped, digest cache empty: every file hashed,
    the digests recorded), ``warm`` (``Engine(folder)`` in a new process whose digest cache
    file was filled by an earlier load: no file read for hashing), ``default``
    (``Engine(folder)`` with the caller's cache setting), and, with the cache off:
    ``parallel`` (sizes, then the digests on worker threads, one per CPU, then the
    sessions), ``overlap`` (the digests on worker threads, one per CPU, while the sessions
    are created), ``sequential`` (every file the load opens hashed one after the other on
    one thread, then the sessions), ``graphs-only`` (as sequential without the
    external-data files: what the runtime hashed before the files map), ``no-hash``
    (sessions only: the floor), ``hash-only`` (the digests alone).
    """
    import tempfile

    cases = [(f, m) for f in folders for m in modes]
    runs: dict[tuple, list] = {c: [] for c in cases}
    loads = []
    with tempfile.TemporaryDirectory(prefix="specrt-load-") as tmp:
        for r in range(repeats):
            order = cases[r % len(cases) :] + cases[: r % len(cases)]
            for folder, mode in order:
                env = _child_env(mode, folder, Path(tmp))
                loads.append(load_average())
                out = subprocess.run([sys.executable, "-c", LOAD_CHILD, folder, mode], capture_output=True, text=True, check=True, env=env)
                runs[(folder, mode)].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"  round {r + 1}: {folder} {mode}: {runs[(folder, mode)][-1]['wall_s']:.2f} s", file=sys.stderr)
    rows = []
    for (folder, mode), rs in runs.items():
        w = np.array([x["wall_s"] for x in rs])
        c = np.array([x["cpu_s"] for x in rs])
        row = dict(
            engines=folder,
            mode=mode,
            wall_s_median=round(float(np.median(w)), 3),
            wall_s_q25=round(float(np.percentile(w, 25)), 3),
            wall_s_q75=round(float(np.percentile(w, 75)), 3),
            cpu_s_median=round(float(np.median(c)), 3),
            runs=[round(x, 3) for x in w],
        )
        if "hashed" in rs[0]:
            row["files_hashed"], row["files_cached"] = rs[0]["hashed"], rs[0]["cached"]
        rows.append(row)
    sizes = {f: sum(p.stat().st_size for p in Path(f).iterdir()) for f in folders}
    return dict(
        rows=rows,
        repeats=repeats,
        load_average=dict(min=min(loads), median=float(np.median(loads)), max=max(loads)),
        folder_bytes=sizes,
    )


def _cmd_load(a) -> dict:
    return measure_load(a.engines, a.modes or list(LOAD_MODES), a.repeats)


# ---- per-call costs -------------------------------------------------------------------------
def measure_costs(folder: str, k_max: int, past: int, reps: int, seed: int = 0) -> dict:
    """Per-call seconds of the engine's draft and target at q = 1..k_max+1 new tokens after
    ``past`` committed positions, on the Engine's own sessions and thread settings.

    All (model, q) cases run ``reps`` times each in a random order per repetition
    (interleaved, so load changes on the shared machine hit every case alike); medians
    and quartiles in milliseconds, with the 1-minute load average before and after.
    """
    from specrt import Engine

    eng = Engine(folder)
    rng = np.random.default_rng(seed)
    vocab = eng.manifest.vocab_size
    ids = rng.integers(1, vocab, size=past + k_max + 1).tolist()
    for mdl in (eng.draft, eng.target):  # fill KV rows [0, past) once (prefill), warm the sessions
        for lo in range(0, past, mdl.max_q):
            mdl.run(ids[lo : min(past, lo + mdl.max_q)], lo)
    cases = [(role, q) for role in ("draft", "target") for q in range(1, k_max + 2)]
    models = {"draft": eng.draft, "target": eng.target}
    for role, q in cases:  # one warm-up call per shape
        models[role].run(ids[past : past + q], past)
    times: dict[tuple, list] = {c: [] for c in cases}
    la0 = load_average()
    t_start = time.perf_counter()
    for _ in range(reps):
        for i in rng.permutation(len(cases)):
            role, q = cases[i]
            t0 = time.perf_counter()
            models[role].run(ids[past : past + q], past)
            times[(role, q)].append(time.perf_counter() - t0)
    rows = []
    for (role, q), ts in times.items():
        x = np.array(ts) * 1000
        rows.append(
            dict(
                model=role,
                q=q,
                median_ms=round(float(np.median(x)), 3),
                q25_ms=round(float(np.percentile(x, 25)), 3),
                q75_ms=round(float(np.percentile(x, 75)), 3),
            )
        )
    m = eng.manifest
    med = {(r["model"], r["q"]): r["median_ms"] for r in rows}
    return dict(
        engines=folder,
        past=past,
        reps=reps,
        k_max=k_max,
        seconds=round(time.perf_counter() - t_start, 1),
        load_average=dict(before=la0, after=load_average()),
        threads=dict(target=eng.target.session.get_session_options().intra_op_num_threads, draft=eng.draft.session.get_session_options().intra_op_num_threads),
        models={
            role: dict(params=e.params, n_layers=e.n_layers, hidden=e.hidden, vocab_size=e.vocab_size) for role, e in (("draft", m.draft), ("target", m.target))
        },
        tokenizer_vocab=m.vocab_size,
        c=round(med[("draft", 1)] / med[("target", 1)], 4),
        rows=rows,
    )


def _cmd_costs(a) -> dict:
    return measure_costs(a.engines, a.k_max, a.past, a.reps)


# ---- host-side work of a round -----------------------------------------------------------------
def _median_us(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(float(np.median(ts)) * 1e6, 2)


def measure_host(folder: str, k_values: list[int], new_tokens: int, reps: int, seed: int = 0) -> dict:
    """Host-side work of speculative rounds at the engine's real vocabulary.

    In the loop: rounds of ``Engine.rounds`` (greedy, threshold 0, so every round drafts
    k candidates unless the budget ends it) with onnxruntime's own ``run`` timed; host
    work = round wall time - time inside onnxruntime (the acceptance loop, the draft's
    confidence softmax, the target's argmax rows, the KV bindings, Python). Per k: the
    median per-round host seconds and share, and the totals.

    Alone (microbenchmarks on real logits rows, median of ``reps``): the draft's
    confidence (:func:`specrt.runtime.speculative.top1`: argmax + softmax over the whole
    vocabulary), one target row's argmax (:func:`argmax_token`), and a copy of a
    ``[k+1, vocab]`` float32 block (what a copying runtime would pay per round).
    """
    from specrt import Engine, GenerationConfig
    from specrt.runtime.speculative import argmax_token, top1

    eng = Engine(folder)
    m = eng.manifest
    ort_time = [0.0]
    for mdl in (eng.draft, eng.target):
        raw = mdl._run

        def timed(raw=raw):
            t0 = time.perf_counter()
            raw()
            ort_time[0] += time.perf_counter() - t0

        mdl._run = timed
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, m.vocab_size, size=64).tolist()
    out = dict(
        engines=folder, tokenizer_vocab=m.vocab_size, draft_width=m.draft.vocab_size, target_width=m.target.vocab_size, load_average=dict(before=load_average())
    )
    loop = []
    for k in k_values:
        cfg = eng.resolve(GenerationConfig(max_new_tokens=new_tokens, k_max=k, threshold=0.0, strategy="full"))
        walls, hosts = [], []
        rounds = eng.rounds(eng.prompt_ids(prompt), cfg)
        t_prev = time.perf_counter()
        first = True
        for _rec in rounds:
            now = time.perf_counter()
            if not first:  # the prefill record is not a round
                walls.append(now - t_prev)
                hosts.append(now - t_prev - ort_time[0])
            first = False
            ort_time[0] = 0.0
            t_prev = time.perf_counter()
        w, h = np.array(walls), np.array(hosts)
        loop.append(
            dict(
                k=k,
                rounds=len(w),
                round_ms_median=round(float(np.median(w)) * 1e3, 3),
                host_ms_median=round(float(np.median(h)) * 1e3, 3),
                host_share_median=round(float(np.median(h / w)), 5),
                host_share_total=round(float(h.sum() / w.sum()), 5),
            )
        )
    out["in_loop"] = loop
    # microbenchmarks on real rows: the draft's and the target's logits for the prompt
    d_rows = np.array(eng.draft.run(prompt[:8], 0))
    t_rows = np.array(eng.target.run(prompt[: max(k_values) + 1], 0))
    scratch = np.empty(m.draft.vocab_size, np.float32)
    kk = max(k_values)
    out["alone_us"] = dict(
        draft_confidence_top1=_median_us(lambda: top1(d_rows[-1], m.vocab_size, scratch), reps),
        target_argmax_row=_median_us(lambda: argmax_token(t_rows[0], m.vocab_size), reps),
        target_argmax_all_rows=_median_us(lambda: [argmax_token(r, m.vocab_size) for r in t_rows], reps),
        copy_block=_median_us(lambda: t_rows.copy(), reps),
        rows=int(t_rows.shape[0]),
        k=kk,
    )
    out["load_average"]["after"] = load_average()
    return out


def _cmd_host(a) -> dict:
    return measure_host(a.engines, a.k, a.new_tokens, a.reps)


# ---- the analytic bound ------------------------------------------------------------------------
def bound(alpha: float, k: int, c: float, verify: float = 1.0) -> float:
    """Expected walltime improvement factor of speculative decoding (Leviathan et al. 2023,
    section 3.4, Theorem 3.8): ``(1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))``, with ``c`` =
    draft call / target call. ``verify`` replaces the ``1`` (one target call) by the
    measured cost of the verification call at q = k+1 relative to q = 1 (the paper assumes
    1: a parallel call costs one serial call, which holds on accelerators with idle
    compute, not on a 2-core CPU)."""
    tokens = (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + verify)


def alpha_from_mean_tokens(tau: float, k: int) -> float:
    """The per-token acceptance rate alpha whose i.i.d. model gives ``tau`` tokens per round
    at k candidates: solves ``(1 - alpha^(k+1)) / (1 - alpha) = tau`` (bisection)."""
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def predict(costs: dict, alphas: dict[str, float], ks: list[int]) -> dict:
    """Predicted speedups of one pair from its measured per-call costs (:func:`measure_costs`):
    per alpha, per k, the paper's formula (verify = 1) and the measured-verify variant, and
    the best k of each."""
    med = {(r["model"], r["q"]): r["median_ms"] for r in costs["rows"]}
    t1 = med[("target", 1)]
    c = med[("draft", 1)] / t1
    out = {"c": round(c, 4), "target_q1_ms": t1, "draft_q1_ms": med[("draft", 1)], "alphas": {}}
    for name, a in alphas.items():
        rows = []
        for k in ks:
            v = med[("target", k + 1)] / t1
            rows.append(dict(k=k, paper=round(bound(a, k, c), 3), measured_verify=round(bound(a, k, c, v), 3), verify_ratio=round(v, 3)))
        best_p = max(rows, key=lambda r: r["paper"])
        best_m = max(rows, key=lambda r: r["measured_verify"])
        out["alphas"][name] = dict(
            alpha=round(a, 4),
            by_k=rows,
            best_paper=dict(k=best_p["k"], speedup=best_p["paper"]),
            best_measured_verify=dict(k=best_m["k"], speedup=best_m["measured_verify"]),
        )
    return out


# Published acceptance figures used for the predictions (docs/results/real-shapes.md cites them):
# zxpmail, "I Benchmarked Speculative Decoding - a = 3.5 Wasn't Enough" (dev.to, 2025):
# Qwen2.5-0.5B-Instruct drafting for Qwen2.5-1.5B-Instruct, greedy, k = 5, 5 prompts x 32
# tokens per task; mean tokens per round a = 3.50 (JSON), 3.00 (code), 2.11 (story).
# alpha below solves the i.i.d. model for those a at k = 5.
PUBLISHED = {
    "qwen": {
        "source": "zxpmail (dev.to, 2025), Qwen2.5-0.5B-Instruct -> Qwen2.5-1.5B-Instruct, greedy, k=5: mean tokens per round a",
        "tokens_per_round": {"json": 3.50, "code": 3.00, "story": 2.11},
        "k": 5,
    },
}


def _cmd_bound(a) -> dict:
    out = {
        "formula": "(1 - alpha^(k+1)) / ((1 - alpha) (k c + v)); paper: v = 1 (Leviathan et al. 2023, Thm 3.8); measured_verify: v = t_target(q=k+1) / t_target(q=1)"
    }
    for spec in a.costs:
        name, path = spec.split("=", 1)
        costs = json.loads(Path(path).read_text())
        alphas = {f"alpha={x:g}": x for x in (0.5, 0.6, 0.7, 0.8, 0.9)}
        pub = PUBLISHED.get(name)
        if pub:
            for task, tau in pub["tokens_per_round"].items():
                alphas[f"{task} (a={tau})"] = alpha_from_mean_tokens(tau, pub["k"])
        out[name] = dict(costs=path, published=pub, prediction=predict(costs, alphas, list(range(1, costs["k_max"] + 1))))
    return out


# ---- export record ---------------------------------------------------------------------------
def export_summary(folder: str) -> dict:
    """What ``specrt export`` recorded for an engine folder: sizes of every file, the
    export's peak RSS (overall and per phase, from ``extra["export"]``), parity figures and
    parameter counts (read from the manifest; nothing is loaded)."""
    m = json.loads((Path(folder) / "manifest.json").read_text())
    return dict(
        engines=folder,
        format_version=m["format_version"],
        files={n: dict(bytes=r["bytes"], external=r["external"]) for n, r in m["files"].items()},
        total_bytes=sum(r["bytes"] for r in m["files"].values()),
        export=m["extra"].get("export"),
        models={
            role: dict(
                params=m[role]["params"],
                n_layers=m[role]["n_layers"],
                hidden=m[role]["hidden"],
                vocab_size=m[role]["vocab_size"],
                max_parity=max(m[role]["parity"].values()),
            )
            for role in ("draft", "target")
        },
        tokenizer_vocab=m["vocab_size"],
        k_max=m["k_max"],
        max_ctx=m["max_ctx"],
    )


def _cmd_summary(a) -> dict:
    return export_summary(a.engines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="random-weight bf16 checkpoint at a preset's shape")
    b.add_argument("--preset", choices=sorted(PRESETS), required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(fn=_cmd_build)
    ld = sub.add_parser("load", help="engine load time: digest cache cold vs warm, hashing strategies, the no-hash floor")
    ld.add_argument("--engines", action="append", required=True)
    ld.add_argument("--mode", dest="modes", action="append", choices=LOAD_MODES)
    ld.add_argument("--repeats", type=int, default=5)
    ld.set_defaults(fn=_cmd_load)
    co = sub.add_parser("costs", help="per-call costs of draft and target at q = 1..k_max+1 (interleaved, medians)")
    co.add_argument("--engines", required=True)
    co.add_argument("--k-max", type=int, default=8)
    co.add_argument("--past", type=int, default=256, help="committed positions before the measured call")
    co.add_argument("--reps", type=int, default=7)
    co.set_defaults(fn=_cmd_costs)
    ho = sub.add_parser("host", help="host-side work of a round (in the loop and alone) at the engine's vocabulary")
    ho.add_argument("--engines", required=True)
    ho.add_argument("--k", type=int, action="append", required=True)
    ho.add_argument("--new-tokens", type=int, default=48)
    ho.add_argument("--reps", type=int, default=200)
    ho.set_defaults(fn=_cmd_host)
    bo = sub.add_parser("bound", help="speedups the analytic bound predicts from measured costs")
    bo.add_argument("--costs", action="append", required=True, help="NAME=costs.json (NAME 'qwen' also gets the published alphas)")
    bo.set_defaults(fn=_cmd_bound)
    su = sub.add_parser("export-summary", help="file sizes and the export's peak RSS from an engine's manifest")
    su.add_argument("--engines", required=True)
    su.set_defaults(fn=_cmd_summary)
    for p in sub.choices.values():
        p.add_argument("--json", default=None, help="write the result here too")
    a = ap.parse_args(argv)
    res = a.fn(a)
    res.setdefault("host", dict(machine=platform.machine(), cpus=os.cpu_count(), python=sys.version.split()[0]))
    emit(res, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
