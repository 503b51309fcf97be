"""Benchmark worker: onnxruntime-genai, target-only or speculative (draft model), greedy.

Runs in its own venv (.venv-ortgenai: onnxruntime-genai, and torch + transformers for its
model builder). Two modes:

``--build --target DIR --draft DIR --out DIR [--k K] [--precision fp32|int4|int8]``
    builds both checkpoints with onnxruntime-genai's model builder
    (``python -m onnxruntime_genai.models.builder -i DIR -o OUT -p PRECISION -e cpu``, the
    builder's own defaults otherwise: what a user of it gets) into
    OUT/target and OUT/draft, then writes OUT/genai_config.json: a speculative model
    (``model.type = "speculative"``, ``model.draft`` = the draft's decoder block) whose files
    lie in subfolders (onnxruntime-genai rejects ".." in config paths). Prints one JSON line:
    per step ok/error (the exact error text), seconds. Skips a build whose stamp matches.

worker (default)
    serves the protocol of ``_protocol.py``. Session options (intra-op threads, 1 inter-op
    thread, spinning) go in through ``og.Config.overlay`` for the decoder and the draft.
    Per prompt: a ``GeneratorParams`` with ``do_sample=False, max_length=len(prompt)+N``
    (+ ``set_speculative_options(max_draft_tokens=k)``), a ``Generator``,
    ``append_tokens(prompt)``, ``generate_next_token()`` until ``is_done()``; creating the
    generator is timed with the rest (a user does it per request). onnxruntime-genai has
    no confidence threshold: its speculative decoding drafts a fixed k per round.

    ``{"op": "turn", "ids": [...], "max_new_tokens": N}`` (the agent bench): one generator
    kept across requests, as onnxruntime-genai's own chat example keeps it; each request
    rewinds it (``Generator.rewind_to``) to the longest common prefix of its sequence and the
    new prompt, appends the rest and generates (greedy). Answers the "run" fields plus
    ``cached`` (the tokens kept). A failed request drops the generator (the next starts cold).
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

try:  # imported as specrt.bench.workers.ortgenai_worker (the harness, the tests)
    from ._protocol import send, serve, set_thread_env
except ImportError:  # run as a file by a venv's python: Python puts this folder first on sys.path
    from _protocol import send, serve, set_thread_env

# ---- build -----------------------------------------------------------------------------


def _stamp(src: str, precision: str = "fp32") -> dict:
    st = {}
    for name in ("config.json", "model.safetensors"):
        p = Path(src) / name
        if p.exists():
            s = p.stat()
            st[name] = [s.st_size, int(s.st_mtime)]
    return dict(source=str(Path(src).resolve()), files=st, precision=precision)


def build_one(src: str, out: Path, cache: Path, precision: str = "fp32") -> dict:
    """One checkpoint through onnxruntime-genai's model builder into ``out``, skipped when its stamp matches; ok/error record with the exact error text."""
    stamp_file = out / "specrt_bench_stamp.json"
    stamp = _stamp(src, precision)
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp and (out / "genai_config.json").exists():
        return dict(ok=True, cached=True, out=str(out))
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(cache)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    log = (p.stdout or "") + (p.stderr or "")
    sys.stderr.write(log[-4000:])
    if p.returncode != 0 or not (out / "genai_config.json").exists():
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-6:]
        return dict(ok=False, cmd=" ".join(cmd), returncode=p.returncode, seconds=secs, error="\n".join(tail) or f"exit {p.returncode}")
    stamp_file.write_text(json.dumps(stamp))
    return dict(ok=True, cached=False, cmd=" ".join(cmd), seconds=secs, out=str(out))


def write_speculative_config(root: Path, k: int) -> dict:
    """Write ``root/genai_config.json``: the speculative model of ``root/target`` and ``root/draft`` with ``max_draft_tokens`` k; ok record."""
    tgt = json.loads((root / "target" / "genai_config.json").read_text())
    drf = json.loads((root / "draft" / "genai_config.json").read_text())
    dec = copy.deepcopy(tgt["model"]["decoder"])
    dec["filename"] = f"target/{dec['filename']}"
    dd = copy.deepcopy(drf["model"]["decoder"])
    dd["filename"] = f"draft/{dd['filename']}"
    model = copy.deepcopy(tgt["model"])
    model["type"] = "speculative"
    model["decoder"] = dec
    model["draft"] = dd
    cfg = {"model": model, "search": copy.deepcopy(tgt.get("search", {})), "speculative": {"max_draft_tokens": int(k)}}
    (root / "genai_config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (root / "target" / name).exists() and not (root / name).exists():
            (root / name).write_bytes((root / "target" / name).read_bytes())
    return dict(ok=True, out=str(root / "genai_config.json"))


def build_main(a) -> int:
    """The ``--build`` mode: both builds, then the speculative config; prints one JSON line of records."""
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    res = {}
    res["target"] = build_one(a.target, root / "target", root / "hf_cache", a.precision)
    res["draft"] = build_one(a.draft, root / "draft", root / "hf_cache", a.precision)
    if res["target"]["ok"] and res["draft"]["ok"]:
        try:
            res["speculative_config"] = write_speculative_config(root, a.k)
        except Exception as e:  # noqa: BLE001
            res["speculative_config"] = dict(ok=False, error=f"{type(e).__name__}: {e}")
    else:
        res["speculative_config"] = dict(ok=False, error="not written: a model build failed")
    import onnxruntime_genai as og

    res["onnxruntime_genai"] = og.__version__
    send(res)
    return 0


# ---- worker ----------------------------------------------------------------------------


# onnxruntime-genai's speculative counters kept in a call's extra (get_speculative_stats)
SPEC_STATS = (
    "rounds",
    "draft_tokens_proposed",
    "draft_tokens_evaluated",
    "draft_tokens_accepted",
    "draft_forward_passes",
    "target_forward_passes",
    "target_verify_forward_passes",
    "full_accept_rounds",
    "partial_accept_rounds",
    "zero_accept_rounds",
    "total_draft_ms",
    "total_target_ms",
    "acceptance_rate",
    "effective_k",
)


def load_model(og, init: dict, spec: bool) -> tuple:
    """(og.Model, session options, load seconds): the model folder ``init["model_dir"]`` with
    the session options (intra-op threads, 1 inter-op thread, spinning) overlaid on the
    decoder and, when speculative, the draft."""
    threads = int(init["threads"])
    so = {"intra_op_num_threads": threads, "inter_op_num_threads": 1, "allow_spinning": "1" if init.get("spinning") else "0"}
    t0 = time.perf_counter()
    cfg = og.Config(init["model_dir"])
    overlay = {"model": {"decoder": {"session_options": so}}}
    if spec:
        overlay["model"]["draft"] = {"session_options": so}
    cfg.overlay(json.dumps(overlay))
    model = og.Model(cfg)
    return model, so, time.perf_counter() - t0


def make_generate(og, model, spec: bool, k: int):
    """``generate(ids, max_new_tokens) -> (new token ids, seconds, ttft seconds, extra)``: one
    greedy generation (generator created inside the timed call; k draft tokens per round
    when speculative, with the counters of :data:`SPEC_STATS` in the extra)."""
    import numpy as np

    clock = time.perf_counter

    def generate(ids, max_new_tokens):
        arr = np.asarray([ids], dtype=np.int32)
        t = clock()
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        if spec:
            params.set_speculative_options(max_draft_tokens=k)
        gen = og.Generator(model, params)
        t_setup = clock() - t
        gen.append_tokens(arr)
        ttft = None
        while not gen.is_done():
            gen.generate_next_token()
            if ttft is None:
                ttft = clock() - t
        seconds = clock() - t
        seq = [int(x) for x in gen.get_sequence(0)]
        extra = {"setup_seconds": t_setup}
        if spec:
            st = gen.get_speculative_stats()
            extra.update({key: st.get(key) for key in SPEC_STATS})
            # specrt's definition: every candidate sent to verification counts as proposed
            # (onnxruntime-genai's own acceptance_rate divides by the tokens examined up to
            # the first rejection, draft_tokens_evaluated; kept in the extra as is)
            extra["proposed"] = st.get("draft_tokens_proposed")
            extra["accepted"] = st.get("draft_tokens_accepted")
        return seq[len(ids) :], seconds, ttft, extra

    return generate


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (ints)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_turn(og, model, spec: bool, k: int, max_length: int):
    """``turn(msg) -> dict``: the "turn" op: the kept generator rewound to the common prefix
    of its sequence and ``msg["ids"]`` (at most len(ids) - 1 tokens: the last prompt token is
    always fed, so the first new token comes from a forward pass), the rest appended, then up
    to ``max_new_tokens`` greedy tokens; ``{"tokens", "seconds", "ttft", "cached", "extra"}``.
    ``max_length``: the generator's whole-sequence limit (the context)."""
    import numpy as np

    clock = time.perf_counter
    state = {"gen": None}

    def turn(msg):
        ids = [int(x) for x in msg["ids"]]
        n_new = int(msg["max_new_tokens"])
        t = clock()
        gen = state["gen"]
        keep = 0
        if gen is not None:
            keep = min(common_prefix([int(x) for x in gen.get_sequence(0)], ids), len(ids) - 1)
            gen.rewind_to(keep)
        else:
            params = og.GeneratorParams(model)
            params.set_search_options(do_sample=False, max_length=max_length)
            if spec:
                params.set_speculative_options(max_draft_tokens=k)
            gen = og.Generator(model, params)
        state["gen"] = None  # held again only after a whole request
        gen.append_tokens(np.asarray([ids[keep:]], dtype=np.int32))
        ttft, made = None, 0
        start = len(ids)
        while not gen.is_done() and made < n_new:
            gen.generate_next_token()
            if ttft is None:
                ttft = clock() - t
            made = len(gen.get_sequence(0)) - start
        seconds = clock() - t
        seq = [int(x) for x in gen.get_sequence(0)]
        state["gen"] = gen
        return dict(tokens=seq[start : start + n_new], seconds=seconds, ttft=ttft, cached=keep, extra={})

    return turn


def setup(init: dict):
    """The protocol's setup: load the model of ``init`` (threads, spinning, model_dir,
    variant: speculative, max_draft_tokens), warm up on up to two prompts; returns
    (generate, info, extra ops)."""
    set_thread_env(int(init["threads"]))
    import onnxruntime_genai as og

    v = init["variant"]
    spec = bool(v["speculative"])
    model, so, load_s = load_model(og, init, spec)
    generate = make_generate(og, model, spec, int(v.get("max_draft_tokens", 4)))
    for ids in init.get("warmup", [])[:2]:
        generate(ids, 8)
    try:
        from importlib.metadata import version

        ort_version = version("onnxruntime")
    except Exception:  # noqa: BLE001
        ort_version = None
    ops = {"turn": make_turn(og, model, spec, int(v.get("max_draft_tokens", 4)), int(init.get("max_length", 4096)))}
    info = dict(
        system="onnxruntime-genai",
        onnxruntime_genai=og.__version__,
        onnxruntime=ort_version,
        load_seconds=load_s,
        variant=v,
        model_dir=init["model_dir"],
        session_options=so,
    )
    return generate, info, ops


if __name__ == "__main__":
    if "--build" in sys.argv:
        ap = argparse.ArgumentParser()
        ap.add_argument("--build", action="store_true")
        ap.add_argument("--target", required=True)
        ap.add_argument("--draft", required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--k", type=int, default=4)
        ap.add_argument("--precision", default="fp32")
        raise SystemExit(build_main(ap.parse_args()))
    raise SystemExit(serve(setup))
