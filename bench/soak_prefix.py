"""Prefix-cache soak: random multi-turn chats against ``specrt serve`` with several workers
and a prefix-cache budget, for a set time; samples the server's RSS and checks that no
request is lost.

``--clients`` threads each hold a conversation (a random code prompt, then each turn adds
the reply and another prompt; a conversation restarts when it would not fit the context, or
at random) and send it to ``/v1/completions`` (greedy or sampled, speculative or
target-only, at random). Every 10 s the server process's RSS (``/proc/PID/status`` VmRSS)
is sampled, with where it is (:func:`memory_parts`: heap, anonymous mappings, file pages;
the record keeps that at the peak). Reports: requests sent, answered (200) and lost (no
answer, or a 5xx), the cache hits and evictions (``/metrics``), RSS after the warm-up and its
peak after it, and the bound "RSS <= RSS after warm-up x 1.10" with the prefix cache's tokens
(the ``specrt_prefix_cache_tokens`` gauge, sampled with the RSS) never above ``--budget``
(``holds``; with ``--cache-ram N`` the host prompt cache's N MiB are added to the RSS bound,
and its bytes gauge at the end is reported; by default the soak turns it off). Beside it (reported, not part of ``holds``), the peak against "model weights +
the budget's KV bytes" (the weights: the folder's ONNX files on disk; the budget's bytes:
``--budget`` tokens at the manifest's KV bytes per token, draft and target), "RSS once loaded
+ the budget's KV bytes", "RSS once loaded + the KV buffers of every worker or slot at
``max_ctx``" and, with ``--in-flight`` (the server's ``--max-tokens-in-flight``), "RSS once
loaded + (budget + in-flight) tokens of KV": the budget bounds the rows idle slots keep
resident (the rest are released), the in-flight limit the rows running requests hold; a
running prefill's logits rows and onnxruntime's intermediates come on top. ``--max-batch N``
serves through N continuous-batching slots instead of ``--workers``. Prints JSON and writes
it to ``--out``.

The phases end on time (``--warmup-minutes``, ``--minutes``) or, for runs that must measure
the same work on any machine (the tests: a machine 2-3x slower, or loaded, would otherwise
take its "warm" reading before the cache filled), on what they measure: the warm-up ends at
the first sample after ``--warmup-requests`` answers once the prefix cache has served
``--warmup-cached`` prompt tokens in all, and the run after ``--requests`` more answers
(``--minutes`` then only caps it).

    python -m specrt.bench.soak_prefix --engines engines/default --workers 4 --minutes 30 --out bench_out/soak_prefix.json
    python -m specrt.bench.soak_prefix --engines engines/qwen2.5-coder --max-batch 4 --threads 2 --budget 8192 --max-chars 9000 --out bench_out/soak_real.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from specrt.bench.common import command, emit
from specrt.bench.servers import free_port, post, read_metrics, start, stop_all
from specrt.runtime.machine import machine_record

ROOT = Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` now, MiB (``/proc/PID/status`` VmRSS; NaN when absent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_parts(pid: int, largest: int = 8) -> dict:
    """Where process ``pid``'s resident memory is now (``/proc/PID/smaps``), MiB: ``heap``
    (the ``[heap]`` mapping: glibc's small allocations, onnxruntime's prepacked weights),
    ``anon`` (other anonymous mappings: weights onnxruntime copied, KV and logits buffers,
    large arrays), ``file`` (file-backed pages: the ONNX data files, libraries), and
    ``largest_anon``: ``[size, resident]`` of the ``largest`` anonymous mappings by resident
    size (a KV or logits buffer is one mapping). Empty dict when the file cannot be read."""
    parts, anon = {"heap": 0, "anon": 0, "file": 0}, []
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return {}
    kind = size = None
    for line in text.splitlines():
        head = line.split(None, 5)
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            name = head[5] if len(head) > 5 else ""
            kind, size = ("heap" if name == "[heap]" else "anon" if not name or name.startswith("[") else "file"), (hi - lo) >> 20
        elif head[0] == "Rss:" and kind is not None:
            kb = int(head[1])
            parts[kind] += kb
            if kind == "anon":
                anon.append([size, kb >> 10])
    out = {k: round(v / 1024, 1) for k, v in parts.items()}
    out["largest_anon"] = sorted(anon, key=lambda x: -x[1])[:largest]
    return out


def _on_kernels(engines: Path) -> set:
    """The roles the server runs on specrt's kernels (the folder's default backend:
    :func:`specrt.runtime.target_path.choose_backend`; the draft with the target where it
    has panels)."""
    from specrt.runtime.manifest import load_manifest
    from specrt.runtime.target_path import choose_backend

    m = load_manifest(engines, verify_hashes=False)
    if choose_backend(None, m) != "kernels":
        return set()
    return {r for r in ("target", "draft") if (m.extra.get("kernels") or {}).get(r)}


def kv_bytes_per_token(engines: Path) -> int:
    """KV-cache bytes one token occupies in the draft and the target together (bytes): per
    model ``n_layers x 2 (K, V) x n_kv_heads x head_dim x itemsize``, from the folder's
    ``manifest.json``: the manifest's ``kv_dtype`` on onnxruntime, f16 (2 bytes) on specrt's
    kernels. Raises OSError/KeyError for a folder without a manifest."""
    m = json.loads((engines / "manifest.json").read_text())
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[m["kv_dtype"]]
    kern = _on_kernels(engines)
    return sum(m[k]["n_layers"] * 2 * m[k]["n_kv_heads"] * m[k]["head_dim"] * (2 if k in kern else itemsize) for k in ("draft", "target"))


def memory_sizes(engines: Path, budget: int, slots: int) -> tuple[float, float, float]:
    """(the budget's KV, the KV buffers of ``slots`` workers or slots at ``max_ctx``, the
    weights the server maps: each model's ONNX files, or its kernel panels where it runs on
    them), MiB (:func:`kv_bytes_per_token`'s errors)."""
    per_token = kv_bytes_per_token(engines)
    max_ctx = json.loads((engines / "manifest.json").read_text())["max_ctx"]
    kern = _on_kernels(engines)
    weights = sum(
        f.stat().st_size
        for f in engines.iterdir()
        if (f.name.split(".")[0] in kern and f.suffix == ".panels") or (f.name.split(".")[0] not in kern and ".onnx" in f.name)
    )
    return budget * per_token / 2**20, slots * max_ctx * per_token / 2**20, weights / 2**20


def client(port: int, prompts: list[str], seed: int, stop: float, max_chars: int, out: dict, lock: threading.Lock, done: threading.Event | None = None) -> None:
    """One client thread until the time ``stop`` (or ``done`` is set): a conversation of
    random turns (random budget, greedy or sampled, speculative or not), restarted past
    ``max_chars`` or at random; counts sent, answered, lost and cached tokens into ``out``
    under ``lock``."""
    rng = random.Random(seed)
    text = rng.choice(prompts)
    while time.time() < stop and not (done is not None and done.is_set()):
        body = dict(prompt=text, max_tokens=rng.choice([8, 16, 32]), temperature=rng.choice([0, 0, 0.8]), seed=rng.randrange(1000))
        if rng.random() < 0.3:
            body["speculative"] = False
        try:
            status, resp, _ = post(port, body, 600, path="/v1/completions")
        except OSError as e:
            status, resp = 0, {"error": str(e)}
        with lock:
            out["sent"] += 1
            out["ok"] += status == 200
            out["lost"] += status == 0 or status >= 500  # a 4xx (a prompt past max_ctx) is an answer
            if status != 200:
                out["errors"].append(str(resp)[:200])
        if status == 200:
            out_text = resp["choices"][0]["text"]
            with lock:
                out["cached"] += resp["usage"]["prompt_tokens_details"]["cached_tokens"]
            text += out_text + "\n" + rng.choice(prompts)
        if status != 200 or len(text) > max_chars or rng.random() < 0.05:
            text = rng.choice(prompts)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring); exits with a usage error for ``--in-flight``
    without ``--max-batch``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=0, help="> 0: continuous batching with this many slots (--workers ignored)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--budget", type=int, default=2048, help="--prefix-cache-tokens")
    ap.add_argument(
        "--cache-ram",
        type=int,
        default=0,
        help="the server's --cache-ram MiB (default 0: the host prompt cache off, so the bound is the slots' budget alone; N > 0 adds N MiB to the RSS bound)",
    )
    ap.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="> 0 (with --max-batch): --max-tokens-in-flight, so the KV the running requests hold is bounded too; the record then checks the peak against RSS once loaded + (budget + in-flight) tokens of KV",
    )
    ap.add_argument("--minutes", type=float, default=30, help="the run's length (with --requests: its cap)")
    ap.add_argument("--warmup-minutes", type=float, default=2, help="the warm-up's length (unless --warmup-requests)")
    ap.add_argument(
        "--warmup-requests", type=int, default=0, help="> 0: the warm-up ends once this many requests were answered and the cache used (--warmup-cached)"
    )
    ap.add_argument("--warmup-cached", type=int, default=0, help="with --warmup-requests: prompt tokens the prefix cache must have served in all first")
    ap.add_argument("--requests", type=int, default=0, help="> 0 (with --warmup-requests): stop once this many more requests were answered after the warm-up")
    ap.add_argument("--sample-every", type=float, default=10, help="seconds between RSS samples")
    ap.add_argument("--max-chars", type=int, default=2400, help="restart a conversation beyond this many characters")
    ap.add_argument("--prompts", default="data/humaneval_dev.jsonl")
    ap.add_argument("--out", default="bench_out/soak_prefix.json")
    a = ap.parse_args(argv)
    if a.in_flight > 0 and a.max_batch <= 0:
        ap.error("--in-flight needs --max-batch (the tokens-in-flight limit is the batch scheduler's)")
    if a.requests > 0 and a.warmup_requests <= 0:
        ap.error("--requests needs --warmup-requests (phases end on work, not time)")
    return a


def server_command(a: argparse.Namespace, port) -> list:
    """``specrt serve`` with the soak's settings (:func:`parse_args`'s namespace)."""
    cmd = [sys.executable, "-m", "specrt.cli", "serve", "--engines", a.engines, "--port", port, "--workers", a.workers, "--threads", a.threads]
    cmd += ["--prefix-cache-tokens", a.budget, "--cache-ram", a.cache_ram, "--log-level", "warning", "--max-queue", 256] + (
        ["--max-batch", a.max_batch] if a.max_batch > 0 else []
    )
    return cmd + (["--max-tokens-in-flight", a.in_flight] if a.in_flight > 0 else [])


class Phases:
    """When the warm-up and the run end: on time (``warmup_s``), or on work: the first sample
    with at least ``warmup_requests`` answers and ``cached`` prompt tokens served from the
    prefix cache in all starts the measured phase, and ``requests`` answers after it end the
    run (``done`` set).

    Attributes:
        warm_from: index of the first sample of the measured phase (None: not reached).
    """

    def __init__(self, warmup_s: float, warmup_requests: int = 0, cached: int = 0, requests: int = 0):
        self.warmup_s, self.warmup_requests, self.cached, self.requests = warmup_s, warmup_requests, cached, requests
        self.warm_from: int | None = None
        self._ok_at_warm = 0
        self.done = threading.Event()

    def observe(self, samples: list[dict]) -> None:
        """Update the phases with the newest sample (``t``, ``answered``, ``cached``)."""
        s = samples[-1]
        if self.warm_from is None:
            if self.warmup_requests > 0:
                warm = s["answered"] >= self.warmup_requests and s["cached"] >= self.cached
            else:
                warm = s["t"] >= self.warmup_s
            if warm:
                self.warm_from, self._ok_at_warm = len(samples) - 1, s["answered"]
        if self.warm_from is not None and self.requests > 0 and s["answered"] - self._ok_at_warm >= self.requests:
            self.done.set()

    def warm(self, samples: list[dict]) -> list[dict]:
        """The samples of the measured phase."""
        return [] if self.warm_from is None else samples[self.warm_from :]


def sample_while(threads: list, port, pid: int, t0: float, stats: dict, phases: Phases | None = None, every: float = 10) -> list[dict]:
    """Every ``every`` seconds until the client ``threads`` end: the server's RSS (MiB), where
    it is (:func:`memory_parts`), requests sent and answered, and the prefix cache's token
    gauge (None when the busy server did not answer /metrics in time); each sample goes to
    ``phases`` (which may end the run). Printed and returned."""
    samples = []
    while any(t.is_alive() for t in threads):
        time.sleep(every)
        try:
            held = read_metrics(port).get("specrt_prefix_cache_tokens")
        except (OSError, RuntimeError):  # a busy server may not answer in time: a missing sample
            held = None
        samples.append(
            dict(
                t=round(time.time() - t0, 1),
                rss_mib=round(rss_mib(pid), 1),
                sent=stats["sent"],
                answered=stats["ok"],
                cached=stats["cached"],
                cache_tokens=held,
                memory=memory_parts(pid),
            )
        )
        print(json.dumps(samples[-1]), flush=True)
        if phases is not None:
            phases.observe(samples)
    return samples


def main(argv=None) -> int:
    """Serve, run the clients for ``--minutes`` while sampling the RSS, stop; print and write
    the record. Returns 0 when the bound holds (nothing lost, RSS after the warm-up within
    10%, the prefix cache's tokens never above the budget), else 1."""
    a = parse_args(argv)
    prompts = [json.loads(x)["prompt"] for x in (ROOT / a.prompts).read_text().splitlines() if x.strip()]
    port = free_port()
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    proc = start(server_command(a, port), port, "/health", out_path.with_suffix(".log"), dict(os.environ))
    rss_loaded = rss_mib(proc.pid)
    budget_mib, kv_alloc_mib, weights_mib = memory_sizes(Path(a.engines), a.budget, a.max_batch if a.max_batch > 0 else a.workers)
    # idle records (the budget) + the running requests' rows (the in-flight limit): every KV row resident
    kv_bound_mib = (a.budget + a.in_flight) * kv_bytes_per_token(Path(a.engines)) / 2**20
    stop = (t0 := time.time()) + 60 * a.minutes
    stats = {"sent": 0, "ok": 0, "lost": 0, "cached": 0, "errors": []}
    lock = threading.Lock()
    phases = Phases(60 * a.warmup_minutes, a.warmup_requests, a.warmup_cached, a.requests)
    threads = [threading.Thread(target=client, args=(port, prompts, i, stop, a.max_chars, stats, lock, phases.done), daemon=True) for i in range(a.clients)]
    for t in threads:
        t.start()
    try:
        samples = sample_while(threads, port, proc.pid, t0, stats, phases, a.sample_every)
        metrics = read_metrics(port)
    finally:
        stop_all([proc])
    warm = phases.warm(samples)
    rss_warm = warm[0]["rss_mib"] if warm else float("nan")
    peak = max(s["rss_mib"] for s in warm) if warm else float("nan")
    max_held = max((s["cache_tokens"] for s in samples if s["cache_tokens"] is not None), default=0)  # the gauge, every 10 s
    result = dict(
        command=command(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        machine=machine_record(),
        settings=vars(a),
        requests_sent=stats["sent"],
        requests_ok=stats["ok"],
        requests_lost=stats["lost"],
        errors=stats["errors"][:10],
        cached_tokens=stats["cached"],
        prefix_cache_hits=metrics.get("specrt_prefix_cache_hits_total"),
        prefix_cache_evictions=metrics.get('specrt_prefix_cache_evictions_total{reason="budget"}'),
        rss_loaded_mib=round(rss_loaded, 1),
        budget_kv_mib=round(budget_mib, 1),
        rss_after_warmup_mib=rss_warm,
        rss_peak_after_warmup_mib=peak,
        peak_over_warm=peak / rss_warm if warm else None,
        weights_mib=round(weights_mib, 1),
        peak_over_weights_plus_budget=peak / (weights_mib + budget_mib) if warm else None,
        peak_over_loaded_plus_budget=peak / (rss_loaded + budget_mib) if warm else None,
        kv_bound_mib=round(kv_bound_mib, 1) if a.in_flight > 0 else None,
        peak_over_loaded_plus_kv_bound=peak / (rss_loaded + kv_bound_mib) if warm and a.in_flight > 0 else None,
        memory_at_peak=max(warm, key=lambda s: s["rss_mib"])["memory"] if warm else {},
        kv_allocated_mib=round(kv_alloc_mib, 1),
        peak_over_loaded_plus_allocated=peak / (rss_loaded + kv_alloc_mib) if warm else None,
        cache_tokens_max=max_held,
        cache_tokens_samples_missing=sum(s["cache_tokens"] is None for s in samples),
        requests_after_warmup=samples[-1]["answered"] - warm[0]["answered"] if warm else 0,
        warmup_ended_s=warm[0]["t"] if warm else None,
        host_cache_bytes=metrics.get("specrt_host_cache_bytes"),
        holds=bool(warm) and stats["lost"] == 0 and peak <= 1.10 * rss_warm + a.cache_ram and max_held <= a.budget,
        samples=samples,
    )
    emit(result, out_path, hide=("samples",))
    return 0 if result["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
