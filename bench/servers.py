"""Servers on loopback for the benches: a free port, a server process started and waited
for, stopped; JSON POSTs and ``/metrics`` read back. Only 127.0.0.1 is ever addressed."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
from pathlib import Path

HOST = "127.0.0.1"

# llama-server's draft-model mode: in this llama.cpp ``--spec-draft-model`` alone loads the
# draft and never drafts (``--spec-type`` defaults to none); the type must be named
DRAFT_SIMPLE = ["--spec-type", "draft-simple"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the call (the OS's choice)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_up(proc: subprocess.Popen, port: int, path: str, log: Path, limit: float = 300) -> None:
    """Poll ``GET path`` on ``port`` every 0.5 s until it answers 200.

    Raises:
        RuntimeError: the process exited first, or ``limit`` seconds passed (see ``log``).
    """
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {log}")
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on {port} did not come up; see {log}")


def start(cmd: list, port: int, health: str, log: Path, env: dict) -> subprocess.Popen:
    """Start ``cmd`` (items turned into strings) with stdout and stderr in ``log``, and wait
    until ``health`` answers (:func:`wait_up`, whose errors it raises)."""
    f = open(log, "w")
    proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    wait_up(proc, port, health, log)
    return proc


def stop_all(procs) -> None:
    """Terminate the server processes, then wait for each (killed after 20 s)."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


# llama-server's modes by name (llama_mode_flags)
LLAMA_MODES = ("target-only", "ngram-simple", "draft-simple")


def llama_mode_flags(mode: str, draft_gguf: str | None, threads: int) -> list[str]:
    """llama-server's flags for ``mode`` (one of LLAMA_MODES): none for target-only,
    ``--spec-type ngram-simple``, or draft-simple with the draft GGUF (n-max 16, p-min 0.5:
    its best draft setting in make bench-real).

    Raises:
        SystemExit: an unknown mode, or draft-simple without ``draft_gguf``.
    """
    if mode == "target-only":
        return []
    if mode == "ngram-simple":
        return ["--spec-type", "ngram-simple"]
    if mode == "draft-simple":
        if not draft_gguf:
            raise SystemExit("llama-server's draft-simple mode needs --draft-gguf (the draft's GGUF)")
        return [
            *DRAFT_SIMPLE,
            "--spec-draft-model",
            str(draft_gguf),
            "--spec-draft-n-max",
            "16",
            "--spec-draft-p-min",
            "0.5",
            "--spec-draft-threads",
            str(threads),
        ]
    raise SystemExit(f"unknown llama-server mode {mode!r}; allowed: {', '.join(LLAMA_MODES)}")


def start_llama_servers(
    binary: str, target_gguf: str, draft_gguf: str, threads: int, ctx: int, out: Path, env: dict, procs: dict, ports: dict, extra=()
) -> None:
    """llama-server three times on the target GGUF, one slot each, loopback: ``llama``
    (target-only), ``llama-draft`` (the draft GGUF, n-max 16, p-min 0.5: its best draft
    setting in make bench-real) and ``llama-ngram`` (ngram-simple). Each process and port
    goes into ``procs`` and ``ports`` as soon as it is up (so a caller's ``finally`` stops
    those started before a failure); logs ``out/NAME.log``; ``extra`` flags follow ``-m``.
    Raises what :func:`start` raises."""
    common = [binary, "-m", target_gguf, *extra, "-t", threads, "-tb", threads, "-c", ctx, "-np", 1, "--host", HOST]
    for name, mode in (("llama", "target-only"), ("llama-draft", "draft-simple"), ("llama-ngram", "ngram-simple")):
        args = llama_mode_flags(mode, draft_gguf, threads)
        ports[name] = free_port()
        procs[name] = start(common + ["--port", ports[name], *args], ports[name], "/health", out / f"{name}.log", env)


def post(port: int, body: dict, timeout: float, path: str = "/v1/chat/completions") -> tuple[int, dict, float]:
    """POST ``body`` as JSON to ``path``; (HTTP status, parsed JSON answer, seconds of the call).

    Raises ``OSError`` (connection, timeout) and ``ValueError`` for an answer that is not JSON."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        return r.status, json.loads(data), time.perf_counter() - t0
    finally:
        conn.close()


def stream(port: int, path: str, body: dict, timeout: float) -> dict:
    """POST a streamed completion or chat completion; ``{"ttft", "seconds", "text", "usage",
    "timings"}`` (times in s; ``ttft`` is the first non-empty piece's, or the whole time when
    none came; a piece is a completion's ``text`` or a chat chunk's ``delta.content``).

    Raises:
        RuntimeError: the server answered other than 200 (its first 300 bytes in the message).
    """
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
    ttft, text, usage, extra = None, [], {}, {}
    try:
        conn.request("POST", path, json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            choice = ev["choices"][0] if ev.get("choices") else {}
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
            usage = ev.get("usage") or usage
            extra = ev.get("timings") or extra
    finally:
        conn.close()
    dt = time.perf_counter() - t0
    return dict(ttft=ttft if ttft is not None else dt, seconds=dt, text="".join(text), usage=usage, timings=extra)


def read_metrics(port: int, timeout: float = 30) -> dict[str, float]:
    """The server's ``/metrics`` as {sample name with its labels, ``model_name`` left out: value}.

    Raises ``OSError`` when the server does not answer and ``RuntimeError`` on a non-200 answer."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        text = r.read().decode()
        if r.status != 200:
            raise RuntimeError(f"/metrics answered {r.status}")
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if "{" in name:
                base, labels = name[:-1].split("{", 1)
                kept = ",".join(p for p in labels.split(",") if not p.startswith("model_name="))
                name = f"{base}{{{kept}}}" if kept else base
            out[name] = float(value)
    return out
