"""Where one target call's time goes, per operator, against the weight-read floor.

onnxruntime's own profiler (``SessionOptions.enable_profiling``) on the engine's target
graph, bound as the decode loop binds it (:class:`~specrt.runtime.backends.ort_gqa.OrtGqaModel`,
the engine's thread settings), ``--past`` KV rows, calls of each width in ``--widths``.
Kernel times are grouped by the node's layer part (q/k/v, o, gate/up, down, LM head,
embedding, attention, norms, other); each MatMulNBits group also gets the bytes of weights it
reads (packed integers, scales, zero points) and the bandwidth that implies, to set against
what the machine streams (``--bandwidth`` GB/s, e.g. from a large ``numpy`` copy, measured
here when not given).

    python scripts/profile_step.py --engines engines/qwen2.5-coder --out docs/bench/real_pair/profile_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from specrt.bench.common import emit

ROOT = Path(__file__).resolve().parents[1]

PARTS = [
    ("lm_head", r"lm_head"),
    ("embedding", r"embed"),
    ("q/k/v", r"qkv_proj|q_proj|k_proj|v_proj"),
    ("o_proj", r"o_proj"),
    ("gate/up", r"gate_proj|up_proj|gate_up"),
    ("down", r"down_proj"),
    ("attention", r"GroupQueryAttention|attn"),
    ("norms", r"layernorm|LayerNorm|norm"),
]


def part_of(node: str) -> str:
    """The layer part a node name belongs to (first match of :data:`PARTS`), else ``other``."""
    for name, pat in PARTS:
        if re.search(pat, node):
            return name
    return "other"


def weight_bytes(path: Path) -> dict[str, int]:
    """Bytes of initializers each MatMulNBits / GatherBlockQuantized node reads, by node name."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    size = {}
    for t in m.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        # bytes per element by ONNX type: float, uint8, int8, float16, bfloat16, int32, int64, uint4, int4
        size[t.name] = int(n * {1: 4, 2: 1, 3: 1, 10: 2, 16: 2, 6: 4, 7: 8, 21: 0.5, 22: 0.5}.get(t.data_type, 4))
    out = {}
    for node in m.graph.node:
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized", "MatMul", "Gather"):
            b = sum(size.get(i, 0) for i in node.input)
            if b:
                out[node.name] = b
    return out


def stream_bandwidth(mb: int = 512, reps: int = 5) -> float:
    """GB/s of a large numpy copy (read + write counted), best of ``reps``."""
    a = np.ones(mb * 2**20 // 8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/qwen2.5-coder")
    ap.add_argument("--role", default="target", choices=["target", "draft"])
    ap.add_argument("--widths", default="1,2,9")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=0.0)
    ap.add_argument("--out")
    a = ap.parse_args()

    import onnxruntime as ort

    from specrt.runtime.backends.base import ThreadConfig
    from specrt.runtime.backends.ort import session_options
    from specrt.runtime.backends.ort_gqa import OrtGqaModel
    from specrt.runtime.manifest import load_manifest

    eng = ROOT / a.engines
    man = load_manifest(eng)
    entry = getattr(man, a.role)
    threads = ThreadConfig() if a.role == "target" else ThreadConfig().for_draft(entry.params)
    prof_dir = Path(tempfile.mkdtemp(prefix="ortprof"))
    so = session_options(threads)  # the runtime's own settings, plus the profiler
    so.enable_profiling = True
    so.profile_file_prefix = str(prof_dir / "p")
    model = object.__new__(OrtGqaModel)
    model.session = ort.InferenceSession(str(eng / entry.file), so, providers=["CPUExecutionProvider"])
    widths = [int(w) for w in a.widths.split(",")]
    model._allocate(entry, a.past + max(widths) + 1, max(widths))
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 1000, a.past + max(widths)).tolist()
    for lo in range(0, a.past, max(widths)):
        model.run(ctx[lo : min(lo + max(widths), a.past)], lo)
    wall = defaultdict(list)
    marks = []
    for _ in range(a.calls):
        for q in widths:
            t0 = time.perf_counter_ns()
            model.run(ctx[a.past : a.past + q], a.past)
            t1 = time.perf_counter_ns()
            wall[q].append((t1 - t0) / 1e6)
            marks.append(q)
    path = Path(model.session.end_profiling())
    events = json.loads(path.read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    # each node event belongs to the model_run whose span contains it
    runs.sort(key=lambda e: e["ts"])
    timed = runs[-len(marks) :]
    wb = weight_bytes(eng / entry.file)
    per_q: dict[int, dict] = {q: defaultdict(list) for q in widths}
    per_q_op: dict[int, dict] = {q: defaultdict(list) for q in widths}
    for r, q in zip(timed, marks):
        lo, hi = r["ts"], r["ts"] + r["dur"]
        part_sum: dict = defaultdict(float)
        op_sum: dict = defaultdict(float)
        for e in nodes:
            if lo <= e["ts"] <= hi:
                node = e["name"][: -len("_kernel_time")]
                part_sum[part_of(node)] += e["dur"] / 1e3
                op_sum[e["args"].get("op_name", "?")] += e["dur"] / 1e3
        for k, v in part_sum.items():
            per_q[q][k].append(v)
        for k, v in op_sum.items():
            per_q_op[q][k].append(v)
    bytes_by_part: dict = defaultdict(int)
    for node, b in wb.items():
        bytes_by_part[part_of(node)] += b
    bw = a.bandwidth or stream_bandwidth()
    result = dict(
        command="python scripts/profile_step.py " + " ".join(sys.argv[1:]),
        engines=a.engines,
        role=a.role,
        threads=threads.intra_op,
        past=a.past,
        copy_bandwidth_gb_s=bw,
        weight_bytes=dict(bytes_by_part),
        # a call reads q rows of the embedding table, every byte of the other weights
        weight_read_floor_ms=sum(b for k, b in bytes_by_part.items() if k != "embedding") / bw / 1e6,
        load=os.getloadavg(),
        widths={},
    )
    for q in widths:
        parts = {k: statistics.median(v) for k, v in per_q[q].items()}
        result["widths"][str(q)] = dict(
            wall_ms=statistics.median(wall[q]),
            kernels_ms=sum(parts.values()),
            by_part_ms=dict(sorted(parts.items(), key=lambda kv: -kv[1])),
            by_op_ms=dict(sorted(((k, statistics.median(v)) for k, v in per_q_op[q].items()), key=lambda kv: -kv[1])),
            gb_s_by_part={k: bytes_by_part[k] / (parts[k] / 1e3) / 1e9 for k in parts if bytes_by_part.get(k)},
        )
    path.unlink()
    emit(result, a.out)


if __name__ == "__main__":
    main()
