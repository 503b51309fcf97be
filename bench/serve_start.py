"""Start times of ``specrt serve --target T.gguf [--draft D.gguf]`` (issue 52): cold (an empty
engine cache and digest cache: the GGUF files are hashed and the folder is built) and warm
(the folder reused), each to the first streamed token of one chat request and to the end of
its answer, and with ``--llama-server`` llama-server's starts on the same files; the build's
peak RSS and the folder's size against the GGUF files, from its manifest.

The GGUF files sit in the page cache in both (they were read before); a cold start on a
machine that has not read them adds the disk's time to read 1.6 GB.

    python -m specrt.bench.serve_start --target T.gguf --draft D.gguf --out docs/bench/gguf_start/RUN.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specrt.runtime.machine import this_machine

from .common import command, emit, say_machine
from .servers import DRAFT_SIMPLE, free_port, stop_all, stream, wait_up

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def first_token(port: int, model: str, max_tokens: int = 32) -> tuple[float, float, str]:
    """``(seconds to the first streamed content, seconds to the end, text)`` of one greedy
    chat request to ``model`` (:func:`~specrt.bench.servers.stream`).

    Raises:
        RuntimeError: the server answered other than 200, or sent no content."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0}
    r = stream(port, "/v1/chat/completions", body, 600)
    if not r["text"]:
        raise RuntimeError("the stream held no content")
    return r["ttft"], r["seconds"], r["text"]


def one_start(args, cache: Path, digests: Path, log: Path, llama: bool = False) -> dict:
    """Start the server (specrt's on the cache, or ``args.llama_server`` on the same files
    with its draft-model mode), time it to its first token and answer, stop it."""
    port = free_port()
    env = {**os.environ, "SPECRT_ENGINE_CACHE": str(cache), "SPECRT_DIGEST_CACHE": str(digests)}
    if llama:
        cmd = [args.llama_server, "-m", args.target, "--port", str(port), "-t", str(args.threads), "-tb", str(args.threads), "-c", "4096", "-np", "1"]
        cmd += [*DRAFT_SIMPLE, "--spec-draft-model", args.draft] if args.draft else []
    else:
        cmd = [sys.executable, "-m", "specrt.cli", "serve", "--target", args.target, "--port", str(port), "--threads", str(args.threads)]
        cmd += ["--draft", args.draft] if args.draft else []
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        wait_up(proc, port, "/health" if llama else "/v1/models", log, limit=900)
        up = time.perf_counter() - t0
        ttft, total, text = first_token(port, Path(args.target).stem)
        return {"up_s": round(up, 2), "first_token_s": round(up + ttft, 2), "answer_s": round(up + total, 2), "text": text}
    finally:
        stop_all([proc])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", type=int, default=3, help="warm starts after the cold one")
    ap.add_argument("--llama-server", default=None, help="also start llama-server on the same files (its draft-model mode), as many times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    say_machine()
    root = Path(tempfile.mkdtemp(prefix="specrt_start_"))
    try:
        cache, digests = root / "engines", root / "digests.json"
        runs = [{"kind": "cold", **one_start(args, cache, digests, root / "cold.log")}]
        runs += [{"kind": "warm", **one_start(args, cache, digests, root / f"warm{i}.log")} for i in range(args.warm)]
        if args.llama_server:  # its first start reads files the page cache holds already, as specrt's
            runs += [{"kind": "llama-server", **one_start(args, cache, digests, root / f"llama{i}.log", llama=True)} for i in range(1 + args.warm)]
        (folder,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "ranks"]
        m = json.loads((folder / "manifest.json").read_text())
        gguf_bytes = sum(Path(p).stat().st_size for p in (args.target, args.draft) if p)
        folder_bytes = sum(p.stat().st_size for p in folder.iterdir())
        result = {
            "command": command(),
            "machine": this_machine().describe(),
            "target": Path(args.target).name,
            "draft": Path(args.draft).name if args.draft else None,
            "threads": args.threads,
            "load": os.getloadavg(),
            "runs": runs,
            "build": m["extra"]["build"],
            "folder_over_gguf": round(folder_bytes / gguf_bytes, 3),
            "folder_mb": round(folder_bytes / 1e6, 1),
            "gguf_mb": round(gguf_bytes / 1e6, 1),
            "torch_importable": _torch_importable(),
        }
        return emit(result, args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _torch_importable() -> bool:
    """Whether torch could be imported in this environment (the server never imports it)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None


if __name__ == "__main__":
    main()
