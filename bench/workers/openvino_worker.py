"""Benchmark worker: OpenVINO GenAI (``LLMPipeline``) on int4 IR, target-only or with its
draft-model speculative decoding (fixed k, or its confidence threshold), greedy.

Runs in its own venv (.venv-openvino: openvino-genai, optimum-intel with nncf, torch==2.13.0
CPU without torchvision for the export). Two modes:

``--build --target DIR --draft DIR --out DIR [--group-size 64]``
    ``optimum-cli export openvino --model DIR --task text-generation-with-past
    --weight-format int4 --group-size G --ratio 1.0 OUT/{target,draft}`` (all layers int4,
    symmetric off = optimum's default asymmetric). G must divide every layer's input width:
    the default draft's 192-wide layers rule out optimum's default 128, so 64 (divides 192,
    512 and 1408). Prints one JSON line: per model ok/error (the exact error text), seconds.
    Skips a build whose stamp matches.

worker (default)
    serves the protocol of ``_protocol.py``. ``LLMPipeline(OUT/target, "CPU",
    INFERENCE_NUM_THREADS=threads[, draft_model=draft_model(OUT/draft, "CPU", ...)])``; per
    prompt a ``GenerationConfig(max_new_tokens=N, do_sample=False)`` with
    ``num_assistant_tokens=k`` (fixed k) or ``assistant_confidence_threshold=th`` for the
    speculative variants, the prompt given as token ids (``TokenizedInputs``), so every
    system decodes the same ids. Time to first token: the first call of a streamer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

try:  # imported as specrt.bench.workers.openvino_worker (the harness, the tests)
    from ._protocol import send, serve, set_thread_env
except ImportError:  # run as a file by a venv's python: Python puts this folder first on sys.path
    from _protocol import send, serve, set_thread_env


def _stamp(src: str, group: int) -> dict:
    st = {}
    for name in ("config.json", "model.safetensors"):
        p = Path(src) / name
        if p.exists():
            s = p.stat()
            st[name] = [s.st_size, int(s.st_mtime)]
    return dict(source=str(Path(src).resolve()), files=st, group_size=group)


def build_one(src: str, out: Path, group: int) -> dict:
    """One checkpoint to OpenVINO int4 IR in ``out`` (optimum-cli, group size ``group``), skipped when its stamp matches; ok/error record."""
    stamp_file = out / "specrt_bench_stamp.json"
    stamp = _stamp(src, group)
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return dict(ok=True, cached=True, out=str(out))
    exe = Path(sys.executable).parent / "optimum-cli"
    cmd = [str(exe), "export", "openvino", "--model", str(src), "--task", "text-generation-with-past"]
    cmd += ["--weight-format", "int4", "--group-size", str(group), "--ratio", "1.0", str(out)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    log = (p.stdout or "") + (p.stderr or "")
    sys.stderr.write(log[-4000:])
    if p.returncode != 0 or not (out / "openvino_model.xml").exists():
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-6:]
        return dict(ok=False, cmd=" ".join(cmd), returncode=p.returncode, seconds=secs, error="\n".join(tail) or f"exit {p.returncode}")
    stamp_file.write_text(json.dumps(stamp))
    return dict(ok=True, cached=False, cmd=" ".join(cmd), seconds=secs, out=str(out))


def build_main(a) -> int:
    """The ``--build`` mode: both checkpoints converted; prints one JSON line with each one's record."""
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    res = {role: build_one(src, root / role, a.group_size) for role, src in (("target", a.target), ("draft", a.draft))}
    try:
        import openvino_genai

        res["openvino_genai"] = openvino_genai.__version__
    except Exception as e:  # noqa: BLE001
        res["openvino_genai"] = f"{type(e).__name__}: {e}"
    send(res)
    return 0


def setup(init: dict):
    """The protocol's setup: an OpenVINO GenAI LLMPipeline (with the draft when speculative), warmed up; returns (generate, info, extra ops)."""
    threads = int(init["threads"])
    set_thread_env(threads)
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    v = init["variant"]
    props = {"INFERENCE_NUM_THREADS": threads}
    t0 = time.perf_counter()
    kw = dict(props)
    if v.get("speculative"):
        kw["draft_model"] = og.draft_model(init["draft_dir"], "CPU", **props)
    pipe = og.LLMPipeline(init["target_dir"], "CPU", **kw)
    load_s = time.perf_counter() - t0
    clock = time.perf_counter

    def generate(ids, max_new_tokens):
        cfg = og.GenerationConfig()
        cfg.max_new_tokens = max_new_tokens
        cfg.do_sample = False
        if v.get("speculative"):
            if v.get("assistant_confidence_threshold") is not None:
                cfg.assistant_confidence_threshold = float(v["assistant_confidence_threshold"])
            else:
                cfg.num_assistant_tokens = int(v["num_assistant_tokens"])
        arr = np.asarray([ids], dtype=np.int64)
        inputs = og.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))
        first = []
        t = clock()

        def streamer(_piece):
            if not first:
                first.append(clock() - t)
            return og.StreamingStatus.RUNNING

        res = pipe.generate(inputs, cfg, streamer)
        seconds = clock() - t
        toks = [int(x) for x in res.tokens[0]]
        extra = {}
        try:
            pm = res.perf_metrics
            extra = dict(ttft_ms_reported=pm.get_ttft().mean, tpot_ms_reported=pm.get_tpot().mean)
        except Exception:  # noqa: BLE001 - optional figures
            pass
        return toks, seconds, first[0] if first else None, extra

    for ids in init.get("warmup", [])[:2]:
        generate(ids, 8)
    info = dict(system="openvino-genai", openvino_genai=og.__version__, openvino=ov.__version__, load_seconds=load_s, variant=v, threads=threads)
    return generate, info, {}


if __name__ == "__main__":
    if "--build" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--build", action="store_true")
        ap.add_argument("--target", required=True)
        ap.add_argument("--draft", required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--group-size", type=int, default=64)
        raise SystemExit(build_main(ap.parse_args()))
    raise SystemExit(serve(setup))
