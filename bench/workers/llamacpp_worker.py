"""Benchmark worker: llama.cpp, through llama-cpp-python (built from its source package) and
through the native ``llama-server`` built with cmake from the same source's vendor/llama.cpp.

Runs in its own venv (.venv-llamacpp: llama-cpp-python, torch + transformers for the GGUF
converter). Two modes:

``--build --target DIR --draft DIR --out DIR --src LLAMA_CPP_DIR``
    converts both checkpoints to GGUF (f32) with the ``convert_hf_to_gguf.py`` shipped in
    the source package. That script refuses the default pair's byte-level BPE pre-tokenizer
    as unrecognised (it knows pre-tokenizers by a hash of the tokens of a test string), so it
    is run through :func:`convert` with its ``get_vocab_base_pre`` told to answer ``gpt-2``
    for a hash it does not know (the pair's tokenizer is GPT-2's byte-level BPE scheme).
    Then quantizes each with ``llama_cpp.llama_model_quantize`` to Q8_0, Q4_K_M and Q4_0
    (rows not divisible by the k-quant super-block, e.g. 1408 or 192, fall back inside
    llama.cpp). Prints one JSON line: per file ok/error, seconds. Cached by a stamp.

worker (default), ``init["variant"]["kind"]``:

* ``python``: ``llama_cpp.Llama(gguf, n_threads=T, n_threads_batch=T, n_ctx=1024)``;
  greedy (``top_k=1, temp=0``) through ``Llama.generate`` on the prompt's token ids, up
  to N tokens or EOS; with ``prompt_lookup`` the library's prompt-lookup decoding
  (``LlamaPromptLookupDecoding(num_pred_tokens=k)``).
* ``server``: starts ``llama-server -m gguf -t T -tb T -c 1024 -np 1`` plus the variant's
  ``args`` (draft model, ``--spec-draft-n-max``, ``--spec-draft-p-min``, ``--spec-type
  ngram-simple``) on a free loopback port, and per prompt POSTs ``/completion`` with the
  token ids (``n_predict`` N, ``temperature`` 0, ``top_k`` 1, ``cache_prompt`` false,
  ``return_tokens`` true), timing the HTTP call (its time to first token is the server's own
  ``timings.prompt_ms``).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

try:  # imported as specrt.bench.workers.llamacpp_worker (the harness, the tests)
    from ._protocol import peak_rss_mb, send, serve, set_thread_env
except ImportError:  # run as a file by a venv's python: Python puts this folder first on sys.path
    from _protocol import peak_rss_mb, send, serve, set_thread_env

QUANTS = {"Q8_0": 7, "Q4_K_M": 15, "Q4_0": 2}  # llama_ftype values (llama.h)


def convert(src: str, out: Path, llama_cpp_dir: str) -> None:
    """``convert_hf_to_gguf.py --outtype f32 --outfile out src``, with an unknown BPE
    pre-tokenizer hash treated as ``gpt-2`` (see the module docstring)."""
    import runpy

    sys.path.insert(0, llama_cpp_dir)
    sys.path.insert(1, str(Path(llama_cpp_dir) / "gguf-py"))
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", "--outtype", "f32", "--outfile", str(out), str(src)]
    try:
        runpy.run_path(str(Path(llama_cpp_dir) / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.argv = argv


def build_main(a) -> int:
    """The ``--build`` mode: GGUF files (f32 conversion, then each quantization) of both checkpoints; prints one JSON line with each artifact's ok/error."""
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    res: dict = {}
    for role, src in (("target", a.target), ("draft", a.draft)):
        f32 = root / f"{role}-f32.gguf"
        stamp = root / f"{role}.stamp.json"
        st = {n: [(Path(src) / n).stat().st_size, int((Path(src) / n).stat().st_mtime)] for n in ("config.json", "model.safetensors")}
        t0 = time.perf_counter()
        if not (f32.exists() and stamp.exists() and json.loads(stamp.read_text()) == st):
            p = subprocess.run([sys.executable, __file__, "--convert", src, str(f32), a.src], capture_output=True, text=True)
            sys.stderr.write((p.stdout + p.stderr)[-3000:])
            if p.returncode != 0 or not f32.exists():
                tail = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()][-5:]
                res[f"{role}-f32"] = dict(ok=False, error="\n".join(tail) or f"exit {p.returncode}")
                continue
            stamp.write_text(json.dumps(st))
            for q in QUANTS:
                (root / f"{role}-{q}.gguf").unlink(missing_ok=True)
        res[f"{role}-f32"] = dict(ok=True, seconds=time.perf_counter() - t0)
        import llama_cpp

        for q, ftype in QUANTS.items():
            dst = root / f"{role}-{q}.gguf"
            if dst.exists():
                res[f"{role}-{q}"] = dict(ok=True, cached=True)
                continue
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = 2
            t1 = time.perf_counter()
            rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(dst).encode(), params)
            res[f"{role}-{q}"] = dict(
                ok=rc == 0 and dst.exists(), seconds=time.perf_counter() - t1, error=None if rc == 0 else f"llama_model_quantize returned {rc}"
            )
    try:
        import llama_cpp

        res["llama_cpp_python"] = llama_cpp.__version__
    except Exception as e:  # noqa: BLE001
        res["llama_cpp_python"] = f"{type(e).__name__}: {e}"
    send(res)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def setup_server(init: dict):
    """The protocol's setup for ``variant.kind == "server"``: start llama-server on loopback with the variant's flags; returns (generate, info, extra ops)."""
    import urllib.request

    v = init["variant"]
    threads = int(init["threads"])
    port = _free_port()
    cmd = [init["server"], "-m", init["gguf"], "-t", str(threads), "-tb", str(threads), "-c", "1024", "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    cmd += [str(x) for x in v.get("args", [])]
    log = open(Path(init["log_dir"]) / f"llama-server-{port}.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)} (log {log.name})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.perf_counter() - t0 > 300:
            proc.kill()
            raise RuntimeError("llama-server did not become healthy in 300 s")
        time.sleep(0.2)
    load_s = time.perf_counter() - t0
    clock = time.perf_counter

    def generate(ids, max_new_tokens):
        body = dict(prompt=list(ids), n_predict=max_new_tokens, temperature=0.0, top_k=1, cache_prompt=False, return_tokens=True, stream=False)
        t = clock()
        r = _post(port, "/completion", body)
        seconds = clock() - t
        tim = r.get("timings", {})
        extra = {k: tim.get(k) for k in ("prompt_ms", "predicted_ms", "predicted_n", "draft_n", "draft_n_accepted")}
        if tim.get("draft_n"):
            extra["proposed"], extra["accepted"] = tim.get("draft_n"), tim.get("draft_n_accepted")
        ttft = tim["prompt_ms"] / 1000 if tim.get("prompt_ms") is not None else None
        return [int(x) for x in r.get("tokens", [])], seconds, ttft, extra

    for ids in init.get("warmup", [])[:2]:
        generate(ids, 8)
    import atexit

    atexit.register(lambda: (proc.terminate(), proc.wait(10)))
    info = dict(system="llama.cpp (llama-server)", load_seconds=load_s, variant=v, threads=threads, cmd=" ".join(cmd))

    def rss(_msg):
        # the model runs in the server process: its peak RSS (VmHWM), not this HTTP client's
        hwm = None
        try:
            for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if ln.startswith("VmHWM:"):
                    hwm = int(ln.split()[1]) / 1024
        except OSError:
            pass
        return {"peak_rss_mb": hwm, "client_peak_rss_mb": peak_rss_mb(), "measured": "llama-server VmHWM"}

    return generate, info, {"rss": rss}


def setup_python(init: dict):
    """The protocol's setup for llama-cpp-python in this process (optionally prompt-lookup decoding); returns (generate, info, extra ops)."""
    threads = int(init["threads"])
    set_thread_env(threads)
    import llama_cpp

    v = init["variant"]
    kw = {}
    if v.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=int(v["prompt_lookup"]))
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(init["gguf"], n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False, **kw)
    load_s = time.perf_counter() - t0
    eos = llm.token_eos()
    clock = time.perf_counter

    def generate(ids, max_new_tokens):
        out, ttft = [], None
        t = clock()
        for tok in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if ttft is None:
                ttft = clock() - t
            out.append(int(tok))
            if tok == eos or len(out) >= max_new_tokens:
                break
        return out, clock() - t, ttft, {}

    for ids in init.get("warmup", [])[:2]:
        generate(ids, 8)
    info = dict(system="llama.cpp (llama-cpp-python)", llama_cpp_python=llama_cpp.__version__, load_seconds=load_s, variant=v, threads=threads)
    return generate, info, {}


def setup(init: dict):
    """The protocol's setup: :func:`setup_server` or :func:`setup_python` by ``init["variant"]["kind"]``."""
    return setup_server(init) if init["variant"]["kind"] == "server" else setup_python(init)


if __name__ == "__main__":
    if "--convert" in sys.argv:
        i = sys.argv.index("--convert")
        src, out, lcpp = sys.argv[i + 1 : i + 4]
        convert(src, Path(out), lcpp)
        raise SystemExit(0)
    if "--build" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--build", action="store_true")
        ap.add_argument("--target", required=True)
        ap.add_argument("--draft", required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--src", required=True, help="the source package's vendor/llama.cpp")
        raise SystemExit(build_main(ap.parse_args()))
    raise SystemExit(serve(setup))
