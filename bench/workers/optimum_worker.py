"""Benchmark worker: optimum's ``ORTModelForCausalLM`` (onnxruntime) on the target, ``generate``.

Runs in its own venv (.venv-optimum: optimum-onnx needs transformers < 4.58). The target is
exported once with ``from_pretrained(export=True)`` into ``init["cache"]`` and reloaded from
there on later runs (a stamp file records the source checkpoint's size and mtime). Session
options: ``intra_op_num_threads`` = the benchmark's thread count, 1 inter-op thread, spinning
as the benchmark says; everything else (IO binding included) is optimum's default.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

try:  # imported as specrt.bench.workers.optimum_worker (the harness, the tests)
    from ._protocol import FirstTokenClock, serve, set_thread_env
except ImportError:  # run as a file by a venv's python: Python puts this folder first on sys.path
    from _protocol import FirstTokenClock, serve, set_thread_env


def _stamp(target: str) -> dict:
    st = {}
    for name in ("config.json", "model.safetensors"):
        p = Path(target) / name
        if p.exists():
            s = p.stat()
            st[name] = [s.st_size, int(s.st_mtime)]
    return dict(source=str(Path(target).resolve()), files=st)


def setup(init: dict):
    """The protocol's setup: optimum's ORTModelForCausalLM of the target (exported once, cached), warmed up; returns (generate, info, extra ops)."""
    threads = int(init["threads"])
    set_thread_env(threads)
    import onnxruntime as ort
    import torch
    import transformers
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if init.get("spinning") else "0")
    cache = Path(init["cache"])
    stamp = _stamp(init["target"])
    export_s = None
    t0 = time.perf_counter()
    stamp_file = cache / "specrt_bench_stamp.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp and any(cache.glob("*.onnx")):
        model = ORTModelForCausalLM.from_pretrained(cache, provider="CPUExecutionProvider", session_options=so)
    else:
        model = ORTModelForCausalLM.from_pretrained(init["target"], export=True, provider="CPUExecutionProvider", session_options=so)
        export_s = time.perf_counter() - t0
        cache.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(cache)
        stamp_file.write_text(json.dumps(stamp))
    load_s = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
    clock = time.perf_counter

    def generate(ids, max_new_tokens):
        streamer = FirstTokenClock(clock)
        x = torch.tensor([ids], dtype=torch.long)
        t = clock()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, streamer=streamer)
        seconds = clock() - t
        ttft = (streamer.first - t) if streamer.first is not None else None
        return out[0, len(ids) :].tolist(), seconds, ttft, {}

    for ids in init.get("warmup", [])[:2]:
        generate(ids, 8)
    try:
        from importlib.metadata import version

        optimum_onnx, optimum_version = version("optimum-onnx"), version("optimum")
    except Exception:  # noqa: BLE001
        optimum_onnx = optimum_version = None
    info = dict(
        system="optimum",
        optimum=optimum_version,
        optimum_onnx=optimum_onnx,
        transformers=transformers.__version__,
        torch=torch.__version__,
        onnxruntime=ort.__version__,
        use_io_binding=getattr(model, "use_io_binding", None),
        providers=model.providers if hasattr(model, "providers") else None,
        export_seconds=export_s,
        load_seconds=load_s,
        onnx_dir=str(cache),
        pid=os.getpid(),
    )
    return generate, info, {}


if __name__ == "__main__":
    raise SystemExit(serve(setup))
