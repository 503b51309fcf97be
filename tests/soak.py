#!/usr/bin/env python3
"""Soak test: many generations in one process, mixed prompts and settings; reports RSS.

Issue 8: after the first ``--warmup`` generations (allocator pools, onnxruntime arenas and
the lazily allocated sampling buffers have settled) the process's peak RSS must stay within
``--max-ratio`` (default 1.05) of its value then, over ``--n`` generations (default 1000).

The mix: text prompts (code, unicode, special-token text) of many lengths and id prompts
(int32, int64, lists); greedy and sampled; speculative and target-only; k_max, threshold,
max_new_tokens, top-k/top-p, seeds, stop strings; ``generate`` and ``Engine.stream``
(some streams closed early); invalid calls that must raise ``SpecRTError``; and an
``Engine.fork()`` made and dropped every 100 generations.

Usage::

    python tests/soak.py --engines /tmp/sizes/engine            # prints a JSON report
    python tests/soak.py --engines engines/default --n 200 --out soak.json

Exit status 1 when the ratio exceeds ``--max-ratio``. CI runs a short soak on the tiny
pair (tests/test_soak.py); the 1,000-generation run takes minutes.

Two one-time RSS steps are not leaks, so the warm-up includes what causes them: onnxruntime's
CPU arena keeps the high-water mark of the shapes it has run (RSS steps up the first time a
longer context occurs; ``--cover``), and glibc raises its mmap threshold when a large mmapped
block is freed, so the buffers of the second fork made and dropped come from, and go back
to, the heap, which keeps them for reuse (one step of about one fork's buffers; later forks
reuse it). Measured on /tmp/sizes/engine: both are flat after their first occurrence.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path


def rss_kib() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in KiB, from /proc/self/status."""
    cur = peak = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            cur = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1])
    return cur, peak


BASE_PROMPTS = [
    "def add(a, b):",
    "for i in range(10):\n    print(i)\n",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n",
    "héllo wörld — ünïcode ✓ 日本語 😀",
    "<|endoftext|>import os\n",
    "x",
    'SELECT name FROM users WHERE age > 30;\n"""docstring"""\n',
]


MULTIPLIERS = [1, 1, 2, 5, 20]  # prompt = a base prompt repeated this often (ids cut at max_ctx // 2)
MAX_NEW = [1, 2, 8, 16, 32, 64]


def make_call(rng: random.Random, engine, i: int, cover: int = 0):
    """One (prompt, config, mode) drawn at random; mode: generate | stream | stream-close | invalid.

    The first ``cover`` calls (i < cover) take the largest prompt of each base text and the
    longest output (greedy and sampled, speculative and target-only, in turn), so that the
    warm-up has met the largest shapes of the mix: onnxruntime's CPU arena keeps the high-water
    mark of the shapes it has run, so RSS steps up the first time a longer context occurs
    (then stays flat); that is not a leak, and the reference point should come after it.
    """
    from specrt import GenerationConfig

    m = engine.manifest
    import numpy as np

    if i < cover:
        ids = engine.codec.encode(BASE_PROMPTS[i % len(BASE_PROMPTS)] * MULTIPLIERS[-1])[: m.max_ctx // 2]
        cfg = GenerationConfig(
            max_new_tokens=MAX_NEW[-1],
            k_max=m.k_min + i % (m.k_max - m.k_min + 1),
            threshold=0.0,
            speculative=i % 4 != 3,
            temperature=0.0 if i % 2 == 0 else 1.0,
            seed=i,
        )
        return ids, cfg, "generate" if i % 3 else "stream"
    text = rng.choice(BASE_PROMPTS) * rng.choice(MULTIPLIERS)
    ids = engine.codec.encode(text)
    if rng.random() < 0.7 and len(ids) < m.max_ctx // 2:
        prompt = text
    else:  # id prompts, at most half the context
        ids = ids[: m.max_ctx // 2]
        prompt = rng.choice([ids, np.array(ids, np.int32), np.array(ids, np.int64)])
    sampled = rng.random() < 0.4
    cfg = GenerationConfig(
        max_new_tokens=rng.choice(MAX_NEW),
        k_max=rng.randint(m.k_min, m.k_max),
        threshold=rng.choice([0.0, 0.0, 0.3, 0.6, 0.9]),
        speculative=rng.random() < 0.85,
        temperature=rng.choice([0.5, 0.8, 1.0, 1.3]) if sampled else 0.0,
        top_k=rng.choice([0, 0, 5, 50]) if sampled else 0,
        top_p=rng.choice([1.0, 0.9, 0.5]) if sampled else 1.0,
        seed=rng.randrange(1 << 30) if sampled else None,
        stop=tuple(rng.sample(["\n", "  ", "e", "):", "日", "zz"], rng.randint(0, 3))),
    )
    r = rng.random()
    mode = "generate" if r < 0.55 else "stream" if r < 0.85 else "stream-close" if r < 0.95 else "invalid"
    if mode == "invalid":
        cfg = rng.choice(
            [GenerationConfig(k_max=m.k_max + 1), GenerationConfig(stop=("",)), GenerationConfig(temperature=-1.0), GenerationConfig(max_new_tokens=0)]
        )
        prompt = rng.choice([prompt, "", [m.vocab_size + 5]])
    return prompt, cfg, mode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/default", help="engine folder")
    ap.add_argument("--n", type=int, default=1000, help="generations in all")
    ap.add_argument("--warmup", type=int, default=50, help="generations before the reference RSS")
    ap.add_argument("--cover", type=int, default=14, help="warm-up calls that take the mix's largest shapes first (0 = purely random)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads per session")
    ap.add_argument("--max-ratio", type=float, default=1.05, help="fail when peak RSS at the end / peak RSS after warmup exceeds this")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)

    from specrt import Engine
    from specrt.runtime.backends.ort import ThreadConfig
    from specrt.runtime.errors import SpecRTError

    t0 = time.perf_counter()
    engine = Engine(args.engines, threads=ThreadConfig(intra_op=args.threads))
    rss_loaded = rss_kib()
    rng = random.Random(args.seed)
    counts = {"generate": 0, "stream": 0, "stream-close": 0, "invalid": 0, "refused": 0, "forks": 0}
    tokens = 0
    finish: dict[str, int] = {}
    rss_warm = None
    samples = []
    for i in range(args.n):
        if i % 100 == 0 or i in (2, 4):  # twice in the warm-up too (see the module docstring)
            f = engine.fork()  # made, used once, dropped: its buffers must be freed
            f.generate("def f():")
            del f
            counts["forks"] += 1
        prompt, cfg, mode = make_call(rng, engine, i, min(args.cover, args.warmup))
        counts[mode] += 1
        try:
            if mode == "generate":
                res = engine.generate(prompt, cfg)
            elif mode == "stream":
                st = engine.stream(prompt, cfg)
                text = "".join(st)
                res = st.result
                assert text == res.text, "stream pieces differ from the result text"
            elif mode == "stream-close":
                st = engine.stream(prompt, cfg)
                next(st, None)
                st.close()
                res = None
            else:
                res = engine.generate(prompt, cfg)
                raise AssertionError(f"invalid call was accepted: {prompt!r} {cfg}")
        except SpecRTError:
            counts["refused"] += 1
            if mode != "invalid":
                raise
            res = None
        if res is not None:
            tokens += len(res.tokens)
            finish[res.finish_reason] = finish.get(res.finish_reason, 0) + 1
        if i + 1 == args.warmup:
            gc.collect()
            rss_warm = rss_kib()
        if (i + 1) % 100 == 0:
            cur, peak = rss_kib()
            samples.append({"after": i + 1, "rss_mib": round(cur / 1024, 1), "peak_rss_mib": round(peak / 1024, 1)})
            print(f"[soak] {i + 1}/{args.n} rss {cur / 1024:.1f} MiB peak {peak / 1024:.1f} MiB", file=sys.stderr, flush=True)
    gc.collect()
    rss_end = rss_kib()
    if rss_warm is None:
        rss_warm = rss_end
    ratio = rss_end[1] / rss_warm[1]
    report = {
        "engines": str(args.engines),
        "generations": args.n,
        "warmup": args.warmup,
        "cover": min(args.cover, args.warmup),
        "modes": counts,
        "finish_reasons": finish,
        "new_tokens": tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "rss_after_load_mib": round(rss_loaded[0] / 1024, 1),
        "rss_after_warmup_mib": round(rss_warm[0] / 1024, 1),
        "peak_rss_after_warmup_mib": round(rss_warm[1] / 1024, 1),
        "rss_end_mib": round(rss_end[0] / 1024, 1),
        "peak_rss_end_mib": round(rss_end[1] / 1024, 1),
        "peak_ratio_end_over_warmup": round(ratio, 4),
        "max_ratio": args.max_ratio,
        "ok": ratio <= args.max_ratio,
        "samples": samples,
    }
    out = json.dumps(report, indent=1)
    print(out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(out)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
