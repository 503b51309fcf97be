"""What each exact GGUF layer representation costs in stock onnxruntime on this CPU (issue 31.2).

The exact target writes every GGUF weight as ``MatMulNBits(q, s, z) x - M . blocksum32(x)``
(export/gguf_blocks.py). Several MatMulNBits forms give the same weights; which one is
cheapest depends on the kernels onnxruntime (MLAS) has for this ISA. This script times one
MatMulNBits node per form at the real target's layer shapes (Qwen2.5-Coder-1.5B: hidden
1536, MLP 8960, KV 256, vocabulary 151,936), for call widths q = 1..9, with random integers
(the time depends on the form and the shape, not on the values):

- ``4-bit zp``: 4-bit blocks of 32 with a zero-point input (the exact graph's Q4_K today, z = 0);
- ``4-bit`` : the same without the input (MatMulNBits' implicit z = 8; Q4_K then keeps
  z = 8 and folds ``8 s`` into its offsets ``M``: same weights);
- ``8-bit/16 zp``: 8-bit blocks of 16 with zero points (Q6_K today: z = 32);
- ``8-bit/16``: without (implicit z = 128: Q6_K stored as q + 96, so q + 96 - 128 = q - 32);
- ``8-bit/32 zp`` / ``8-bit/32``: the same at blocks of 32 (Q8_0, Q5_0);
- ``offsets``: the float MatMul of the offsets branch, ``blocksum32(x) [q, K/32] @ M^T``.

Every case runs once per repetition in a fresh random order (shared machine: 2 cores); the
medians and quartiles are reported with the machine (runtime/machine.py). Usage::

    python scripts/measure_layer_kinds.py --reps 15 --out docs/bench/layer_kinds/<isa>.json
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from specrt.bench.common import say_machine, write_json
from specrt.runtime.machine import machine_record

# (layer, N output rows, K inputs) of Qwen2.5-Coder-1.5B, per decoder layer unless noted
SHAPES = {
    "q_proj/o_proj": (1536, 1536),
    "k_proj/v_proj": (256, 1536),
    "qkv fused": (2048, 1536),
    "gate/up_proj": (8960, 1536),
    "down_proj": (1536, 8960),
    "lm_head (once)": (151936, 1536),
}
FORMS = {  # name -> (bits, block, zero-point input)
    "4-bit zp": (4, 32, True),
    "4-bit": (4, 32, False),
    "8-bit/16 zp": (8, 16, True),
    "8-bit/16": (8, 16, False),
    "8-bit/32 zp": (8, 32, True),
    "8-bit/32": (8, 32, False),
}


def nbits_session(n: int, k: int, bits: int, block: int, zp: bool, threads: int, rng) -> ort.InferenceSession:
    """One MatMulNBits node (accuracy_level 4: int8 activations, the export's setting) with
    random integers, scales and (optionally) zero points."""
    blocks = k // block
    packed = rng.integers(0, 256, size=(n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (rng.random((n * blocks,), dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
    inits = [helper.make_tensor("W", TensorProto.UINT8, packed.shape, packed.tobytes(), raw=True), onnx.numpy_helper.from_array(scales, "S")]
    inputs = ["x", "W", "S"]
    if zp:
        zbytes = (blocks * bits + 7) // 8
        z = np.full((n, zbytes), 0 if bits == 4 else 32, np.uint8)
        inits.append(helper.make_tensor("Z", TensorProto.UINT8, z.shape, z.tobytes(), raw=True))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    return layer_session(node, inits, k, n, threads)


def offsets_session(n: int, k: int, threads: int, rng) -> ort.InferenceSession:
    """The offsets branch: ``y = ReduceSum(Reshape(x, [q, K/32, 32]), -1) @ M^T`` (float32)."""
    m = rng.random((k // 32, n), dtype=np.float32)
    shape = onnx.numpy_helper.from_array(np.array([-1, k // 32, 32], np.int64), "shape")
    axes = onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes")
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("ReduceSum", ["r", "axes"], ["s"], keepdims=0),
        helper.make_node("MatMul", ["s", "M"], ["y"]),
    ]
    return layer_session(nodes, [onnx.numpy_helper.from_array(m, "M"), shape, axes], k, n, threads)


def layer_session(nodes, inits, k: int, n: int, threads: int) -> ort.InferenceSession:
    """A session of one layer's ``nodes`` and initializers: input ``x`` [q, k], output ``y``
    [q, n] (float32), ``threads`` intra-op threads, idle threads not spinning (as the runtime)."""
    nodes = nodes if isinstance(nodes, list) else [nodes]
    graph = helper.make_graph(
        nodes,
        "layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["q", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["q", n])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qs", default="1,2,3,5,9", help="call widths")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="layers to time (names of SHAPES)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    say_machine()
    rng = np.random.default_rng(0)
    qs = [int(q) for q in a.qs.split(",")]
    cases = []  # (layer, form, q, session, x)
    for layer in a.shapes.split(","):
        n, k = SHAPES[layer]
        sessions = {f: nbits_session(n, k, *spec, a.threads, rng) for f, spec in FORMS.items()}
        sessions["offsets"] = offsets_session(n, k, a.threads, rng)
        for f, s in sessions.items():
            for q in qs:
                cases.append((layer, f, q, s, rng.standard_normal((q, k), dtype=np.float32)))
    for *_, s, x in cases:  # warm-up
        for _ in range(2):
            s.run(None, {"x": x})
    times = [[] for _ in cases]
    for r in range(a.reps):
        for i in rng.permutation(len(cases)):
            s, x = cases[i][3], cases[i][4]
            t0 = time.perf_counter()
            s.run(None, {"x": x})
            times[i].append(time.perf_counter() - t0)
        print(f"repetition {r + 1}/{a.reps}", file=sys.stderr, flush=True)
    rows = []
    for (layer, f, q, *_), t in zip(cases, times):
        ms = np.asarray(t) * 1e3
        rows.append(dict(layer=layer, form=f, q=q, median_ms=float(np.median(ms)), q25_ms=float(np.percentile(ms, 25)), q75_ms=float(np.percentile(ms, 75))))
    by = {(r["layer"], r["form"], r["q"]): r["median_ms"] for r in rows}
    print(f"{'layer':<16}{'form':<13}" + "".join(f"{'q=' + str(q):>9}" for q in qs))
    for layer in a.shapes.split(","):
        for f in list(FORMS) + ["offsets"]:
            print(f"{layer:<16}{f:<13}" + "".join(f"{by[(layer, f, q)]:>9.3f}" for q in qs))
    rec = dict(
        command="python scripts/measure_layer_kinds.py " + " ".join(sys.argv[1:] if argv is None else argv),
        machine=machine_record(),
        threads=a.threads,
        reps=a.reps,
        rows=rows,
    )
    if a.out:
        write_json(a.out, rec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
