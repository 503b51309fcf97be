#!/usr/bin/env python
"""Load run against a specrt server on this machine (loopback only; bounded in count and time).

Either point it at a running server (``--url http://127.0.0.1:8000``) or let it start one
(``--engines DIR``: ``specrt serve`` on a free loopback port, stopped at the end). C client
threads (keep-alive connections) send N ``/v1/completions`` requests (``--chat``:
``/v1/chat/completions``, each prompt as one user message) in total, never more, and stop
issuing new ones after ``--max-seconds``. Prints (and writes with ``--out``) requests/s,
latency p50/p90/p99, time to first token (streamed), tokens/s, errors by status, and the
server's acceptance figures (from /metrics, before/after).

    python -m specrt.bench.load --engines engines/default --workers 2 --threads 1 \\
        --requests 200 --concurrency 8 --max-tokens 64 --out bench_out/load.json
    python -m specrt.bench.load --engines engines/default --workers 2 --threads 1 \\
        --requests 200 --concurrency 8 --max-tokens 64 --chat --out bench_out/load_chat.json
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

from specrt.bench.common import emit
from specrt.bench.servers import free_port
from specrt.runtime.stats import acceptance_rate, mean_accepted

MAX_REQUESTS = 100_000
MAX_SECONDS = 3600
PROMPTS = [
    "def add(a, b):",
    "for i in range(10):",
    "class Foo:",
    "import os\nimport sys\n",
    "def fib(n):",
    "if __name__ == '__main__':",
    "def __init__(self, x):",
    "print(",
    "return a +",
    "while True:",
]


def loopback_only(host: str) -> None:
    """Refuse any host that does not resolve only to loopback addresses (127.0.0.0/8, ::1)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise SystemExit(f"--url host {host!r} does not resolve ({e})") from None
    addrs = {info[4][0] for info in infos}
    bad = [a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if bad:
        raise SystemExit(f"--url host {host!r} resolves to {sorted(bad)}; this load test only targets loopback (127.0.0.1, ::1)")


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of ``xs``; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def read_metrics(host: str, port: int) -> dict[str, float]:
    """The server's /metrics as {sample name without labels: value summed over its label sets}; a
    sample with a ``mode`` label is also kept as ``name{mode="..."}`` (summed over its other labels)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            out[base] = out.get(base, 0.0) + float(value)
            m = re.search(r'mode="([^"]*)"', labels)
            if m:
                key = f'{base}{{mode="{m.group(1)}"}}'
                out[key] = out.get(key, 0.0) + float(value)
    return out


def start_server(args) -> tuple[subprocess.Popen, int]:
    """``specrt serve`` on a free loopback port; returns (process, port) once /health answers."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "specrt.cli",
        "serve",
        "--engines",
        args.engines,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(args.workers),
        "--max-queue",
        str(max(args.concurrency, 1) + 8),
        "--log-level",
        "warning",
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.max_batch:
        cmd += ["--max-batch", str(args.max_batch), "--batch-policy", args.batch_policy]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                conn.close()
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not come up in 180 s")


class Client(threading.Thread):
    """One client: a keep-alive connection sending requests while tickets and time last."""

    def __init__(self, host, port, body_for, tickets, deadline, stream, timeout, out, path="/v1/completions"):
        super().__init__(daemon=True)
        self.host, self.port, self.body_for, self.tickets, self.path = host, port, body_for, tickets, path
        self.deadline, self.stream, self.timeout, self.out = deadline, stream, timeout, out
        self.conn = None

    def _connect(self):
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def run(self):
        """Send requests until the tickets or the time run out; one record per request into ``out`` (status, latency s, TTFT s, tokens, text)."""
        self._connect()
        while time.perf_counter() < self.deadline:
            i = self.tickets.take()
            if i is None:
                break
            body = self.body_for(i)
            t0 = time.perf_counter()
            rec = {"i": i, "status": None, "latency": None, "ttft": None, "tokens": 0, "text": ""}
            try:
                self.conn.request("POST", self.path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                rec["status"] = r.status
                if r.status == 200 and self.stream:
                    for line in r:
                        if line.startswith(b"data: {"):
                            ev = json.loads(line[6:])
                            ch = ev.get("choices")
                            piece = (ch[0].get("text") or (ch[0].get("delta") or {}).get("content")) if ch else None
                            if piece:
                                rec["text"] += piece
                                if rec["ttft"] is None:
                                    rec["ttft"] = time.perf_counter() - t0
                            if ev.get("usage"):
                                rec["tokens"] = ev["usage"]["completion_tokens"]
                        elif line.startswith(b"data: [DONE]"):
                            break
                    r.read()
                else:
                    data = json.loads(r.read())
                    if r.status == 200:
                        rec["tokens"] = data["usage"]["completion_tokens"]
                        c0 = data["choices"][0]
                        rec["text"] = c0["message"]["content"] if "message" in c0 else c0["text"]
                rec["latency"] = time.perf_counter() - t0
            except (OSError, http.client.HTTPException, ValueError) as e:
                rec["status"] = f"{type(e).__name__}"
                self.conn.close()
                self._connect()
            self.out.append(rec)
        self.conn.close()


class Tickets:
    """A thread-safe countdown of request numbers 0..n-1."""

    def __init__(self, n):
        self._n, self._next, self._lock = n, 0, threading.Lock()

    def take(self):
        """The next request number, or None when all were handed out."""
        with self._lock:
            if self._next >= self._n:
                return None
            self._next += 1
            return self._next - 1


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module's docstring), checked against the bounds
    (argparse exits on a bad one)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running server, loopback only (http://127.0.0.1:PORT)")
    src.add_argument("--engines", help="start `specrt serve` on this engine folder for the run")
    ap.add_argument("--workers", type=int, default=2, help="with --engines: server workers")
    ap.add_argument("--threads", type=int, default=1, help="with --engines: onnxruntime threads per session")
    ap.add_argument("--max-batch", type=int, default=0, help="with --engines: serve --max-batch N (continuous batching; 0: --workers)")
    ap.add_argument("--batch-policy", default="auto", choices=["auto", "speculate", "batched"], help="with --engines and --max-batch: serve --batch-policy")
    ap.add_argument("--requests", type=int, default=200, help=f"requests in total (1..{MAX_REQUESTS})")
    ap.add_argument("--concurrency", type=int, default=8, help="client threads (1..256)")
    ap.add_argument("--max-seconds", type=float, default=120.0, help=f"stop issuing requests after this (<= {MAX_SECONDS})")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request socket timeout (s)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--stream", action="store_true", help="streamed requests (adds time to first token)")
    ap.add_argument("--chat", action="store_true", help="POST /v1/chat/completions, each prompt as one user message (the engine's chat template)")
    ap.add_argument("--prompts", help='JSONL with {"prompt": ...} per line (default: built-in code prompts)')
    ap.add_argument("--out", help="write the summary JSON here")
    ap.add_argument("--save-texts", action="store_true", help="keep every response's text in the summary (by request number)")
    ap.add_argument("--body", default="{}", help="JSON object merged into every request body, e.g. '{\"speculative\": false}' (target only)")
    args = ap.parse_args(argv)
    try:
        args.body = json.loads(args.body)
    except ValueError as e:
        ap.error(f"--body must be a JSON object: {e}")
    if not isinstance(args.body, dict):
        ap.error(f"--body must be a JSON object, got {type(args.body).__name__}")
    if {"stream", "stream_options"} & set(args.body):
        ap.error("--body cannot set stream or stream_options (the client reads the answer by --stream)")
    if not 1 <= args.requests <= MAX_REQUESTS:
        ap.error(f"--requests must be in 1..{MAX_REQUESTS}")
    if not 1 <= args.concurrency <= 256:
        ap.error("--concurrency must be in 1..256")
    if not 0 < args.max_seconds <= MAX_SECONDS:
        ap.error(f"--max-seconds must be in (0, {MAX_SECONDS}]")
    if args.url:
        u = urlparse(args.url)
        if u.scheme != "http" or not u.hostname:
            ap.error("--url must look like http://127.0.0.1:PORT")
    return args


def request_maker(args: argparse.Namespace, prompts: list[str]):
    """``body_for(i)``: the JSON body of request number ``i`` (prompt ``i % len(prompts)``;
    a seed ``i`` when sampling; streamed with usage when ``--stream``; then ``--body``'s fields)."""

    def body_for(i):
        p = prompts[i % len(prompts)]
        b = {"messages": [{"role": "user", "content": p}]} if args.chat else {"prompt": p}
        b.update(max_tokens=args.max_tokens, temperature=args.temperature)
        if args.temperature > 0:
            b["seed"] = i
        if args.stream:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        b.update(args.body)
        return b

    return body_for


def run_load(args: argparse.Namespace, host: str, port: int, prompts: list[str]) -> dict:
    """The clients' run: ``{"out": request records, "wall": seconds, "before"/"after":
    /metrics around it, "load_before": the 1-minute load average at the start}``."""
    before = read_metrics(host, port)
    load_before = os.getloadavg()[0]
    out: list[dict] = []
    tickets = Tickets(args.requests)
    t0 = time.perf_counter()
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    body_for = request_maker(args, prompts)
    clients = [Client(host, port, body_for, tickets, t0 + args.max_seconds, args.stream, args.timeout, out, path) for _ in range(args.concurrency)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(args.max_seconds + args.timeout + 10)
    wall = time.perf_counter() - t0
    return dict(out=out, wall=wall, before=before, after=read_metrics(host, port), load_before=load_before)


METRIC_DELTAS = (
    "specrt_draft_tokens_proposed_total",
    "specrt_draft_tokens_accepted_total",
    "specrt_verify_passes_total",
    "specrt_batch_size_sum",
    "specrt_batch_size_count",
    "specrt_tokens_per_forward_pass_sum",
    "specrt_tokens_per_forward_pass_count",
    'specrt_batch_iterations_total{mode="batched"}',
    'specrt_batch_iterations_total{mode="speculate"}',
)


def _finite(x: float, digits: int) -> float | None:
    """``x`` rounded, None when it is nan (a ratio over zero)."""
    return None if x != x else round(x, digits)


def _ratio(num: float, den: float, digits: int) -> float | None:
    """``num / den`` rounded, None when ``den`` is 0."""
    return round(num / den, digits) if den else None


def _batching(d: dict) -> dict | None:
    """The batch scheduler's figures from the /metrics deltas (None without batching)."""
    if not d["specrt_batch_size_count"]:
        return None
    return {
        "mean_batch_size": _ratio(d["specrt_batch_size_sum"], d["specrt_batch_size_count"], 3),
        "mean_tokens_per_forward_pass": _ratio(d["specrt_tokens_per_forward_pass_sum"], d["specrt_tokens_per_forward_pass_count"], 3),
        "iterations": {m: d[f'specrt_batch_iterations_total{{mode="{m}"}}'] for m in ("batched", "speculate")},
    }


def summarize(args: argparse.Namespace, run: dict) -> dict:
    """The summary of :func:`run_load`'s result: counts by status, throughput, latency and
    TTFT percentiles (s), the acceptance and batching figures of the /metrics deltas."""
    out, wall = run["out"], run["wall"]
    ok = [r for r in out if r["status"] == 200]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    statuses: dict[str, int] = {}
    for r in out:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    d = {k: run["after"].get(k, 0) - run["before"].get(k, 0) for k in METRIC_DELTAS}
    tokens = sum(r["tokens"] for r in ok)
    r4 = lambda v: round(v, 4) if v is not None else None
    return {
        "requests_sent": len(out),
        "ok": len(ok),
        "statuses": statuses,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": args.stream,
        "endpoint": "/v1/chat/completions" if args.chat else "/v1/completions",
        "body": args.body,
        "requests": args.requests,
        "max_seconds": args.max_seconds,
        "workers": args.workers if args.engines else None,
        "threads": args.threads if args.engines else None,
        "max_batch": args.max_batch if args.engines else None,
        "batch_policy": args.batch_policy if args.engines and args.max_batch else None,
        "batching": _batching(d),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "completion_tokens_per_s": round(tokens / wall, 1) if wall else None,
        "latency_s": {
            q: r4(v) for q, v in (("p50", percentile(lat, 50)), ("p90", percentile(lat, 90)), ("p99", percentile(lat, 99)), ("max", max(lat) if lat else None))
        },
        "ttft_s": {q: r4(v) for q, v in (("p50", percentile(ttft, 50)), ("p99", percentile(ttft, 99)))} if args.stream else None,
        # the one definition of each (runtime/stats.py), None where nothing was proposed
        "acceptance_rate": _finite(acceptance_rate(d["specrt_draft_tokens_accepted_total"], d["specrt_draft_tokens_proposed_total"]), 4),
        "mean_accepted_length": _finite(mean_accepted(d["specrt_draft_tokens_accepted_total"], d["specrt_verify_passes_total"]), 3),
        "cpu_count": os.cpu_count(),
        # other processes on the machine slow everything: the 1-minute load average at the
        # start and end of the run (2 cores: above 2 means the run did not have them alone)
        "load_avg_1m": [round(run["load_before"], 2), round(os.getloadavg()[0], 2)],
        # request i's prompt is prompts[i % len(prompts)]: greedy runs compare text by i
        "texts": {str(r["i"]): r["text"] for r in sorted(ok, key=lambda r: r["i"])} if args.save_texts else None,
    }


def main(argv=None) -> dict:
    """Run the load test; returns the summary dict (also printed as JSON, and written to ``--out``).

    Raises:
        SystemExit: bad arguments, a ``--url`` host that is not loopback, a server that
            does not come up.
    """
    args = parse_args(argv)
    prompts = PROMPTS
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    proc = None
    if args.url:
        u = urlparse(args.url)
        loopback_only(u.hostname)
        host, port = u.hostname, u.port or 80
    else:
        proc, port = start_server(args)
        host = "127.0.0.1"
    try:
        run = run_load(args, host, port, prompts)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return emit(summarize(args, run), args.out)


if __name__ == "__main__":
    main()
