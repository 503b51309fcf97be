"""What each exact representation of a GGUF layer costs in onnxruntime's MatMulNBits, per
layer kind of the real target, on the CPU at hand (issue 31.2).

(Until 2026-12-03 this script timed one node per form, whose weights stay in the L3 cache
between runs: docs/bench/layer_kinds/intel_xeon_avx512vnni_amx.json. It now streams them.)

The exact graph (:mod:`specrt.export.gguf_blocks`) writes every GGUF layer as
``MatMulNBits(q, s, z) x - M . blocksum32(x)``, always with a zero-point input: Q4_K at 4 bits
with ``z = 0`` (its mins in ``M``), Q6_K at 8 bits in blocks of 16 with ``z = 32``, and q/k/v
fused into one 8-bit call where any of them is 8-bit. The forms that give the same weights:

* **4-bit, no zero point** (MatMulNBits then assumes ``z = 8``; ``M`` absorbs ``8 s``);
* **8-bit, no zero point** (assumed ``z = 128``: ``q + 96`` stored for a Q6_K value ``q - 32``);
* **q/k/v unfused**: the Q4_K projections 4-bit, only the Q6_K one 8-bit;
* the offsets term alone (ReduceSum + MatMul + Sub), to weigh what folding it would save.

Each form is a graph of its layer repeated (distinct random packed weights at the real shapes:
hidden 1536, intermediate 8960, q 1536, k/v 256, vocabulary 151936) until it holds over 3x
the L3 cache, so the weights stream from memory as in a real step (one layer timed alone
stays cache-resident, which a real step's weights never are); accuracy level 4, the runtime's session
options. A figure is ms per layer call (the graph's time / its copies) at ``q`` rows (1 and
the verification width), the median of interleaved rounds, and that times the calls of its
kind in one step of the real target. Costs only: random weights say nothing about values.

    python scripts/measure_layer_kinds.py --out docs/bench/layer_kinds/<machine>_streamed.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

from specrt.bench.common import command, emit, say_machine
from specrt.runtime.machine import machine_record

# layer kind -> (calls per target step in the real graph, [(form, [(K, N, bits, block, zero point input?), ...]), ...])
FORMS = {
    "gate/up Q4_K": (56, [("zp", [(1536, 8960, 4, 32, True)]), ("no zp", [(1536, 8960, 4, 32, False)])]),
    "down Q4_K": (14, [("zp", [(8960, 1536, 4, 32, True)]), ("no zp", [(8960, 1536, 4, 32, False)])]),
    "down Q6_K": (
        14,
        [("zp", [(8960, 1536, 8, 16, True)]), ("no zp", [(8960, 1536, 8, 16, False)]), ("as 4-bit (not exact)", [(8960, 1536, 4, 32, True)])],
    ),
    "o Q4_K": (28, [("zp", [(1536, 1536, 4, 32, True)]), ("no zp", [(1536, 1536, 4, 32, False)])]),
    "q/k/v, v Q4_K": (14, [("fused 4-bit zp", [(1536, 2048, 4, 32, True)]), ("fused 4-bit no zp", [(1536, 2048, 4, 32, False)])]),
    # where v is Q6_K the fused call is 8-bit today; unfused, only v is
    "q/k/v, v Q6_K": (
        14,
        [
            ("fused 8-bit zp", [(1536, 2048, 8, 16, True)]),
            ("unfused: q, k 4-bit + v 8-bit, zp", [(1536, 1536, 4, 32, True), (1536, 256, 4, 32, True), (1536, 256, 8, 16, True)]),
            ("unfused: q, k 4-bit + v 8-bit, no zp", [(1536, 1536, 4, 32, False), (1536, 256, 4, 32, False), (1536, 256, 8, 16, False)]),
        ],
    ),
    "lm_head Q6_K": (
        1,
        [("zp", [(1536, 151936, 8, 16, True)]), ("no zp", [(1536, 151936, 8, 16, False)]), ("as 4-bit (not exact)", [(1536, 151936, 4, 32, True)])],
    ),
}
COLD_BYTES = 320 << 20  # each form's graph repeats its layer to hold >= 3x this CPU's 105 MiB L3: weights stream as in a real step


def layer_bytes(layers: list[tuple]) -> int:
    """Packed weight + scale bytes of one copy of ``layers``."""
    return sum(k * n * bits // 8 + (k // block) * n * 4 for k, n, bits, block, _ in layers)


def nbits_node(i: int, k: int, n: int, bits: int, block: int, zp: bool, rng: np.random.Generator) -> tuple[onnx.NodeProto, list]:
    """One MatMulNBits node ``X -> Y{i}`` with random packed weights (initializers returned)."""
    nb = k // block
    w = helper.make_tensor(
        f"W{i}", TensorProto.UINT8, [n, nb, block * bits // 8], rng.integers(0, 256, n * nb * block * bits // 8, dtype=np.uint8).tobytes(), raw=True
    )
    s = helper.make_tensor(f"S{i}", TensorProto.FLOAT, [n * nb], (rng.random(n * nb, dtype=np.float32) * 0.01).tobytes(), raw=True)
    inits, inputs = [w, s], ["X", f"W{i}", f"S{i}"]
    if zp:
        zbytes = n * ((nb * bits + 7) // 8)
        inits.append(helper.make_tensor(f"Z{i}", TensorProto.UINT8, [zbytes], rng.integers(0, 256, zbytes, dtype=np.uint8).tobytes(), raw=True))
        inputs.append(f"Z{i}")
    node = helper.make_node("MatMulNBits", inputs, [f"Y{i}"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=4)
    return node, inits


def one_input_model(name: str, nodes: list, inits: list, k: int, outputs: int) -> onnx.ModelProto:
    """The model of ``nodes``: one float32 input ``X`` ``[1, q, k]``, outputs ``Y0..Y{outputs-1}``
    (default opset 17 and com.microsoft 1 for MatMulNBits)."""
    g = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, "q", k])],
        [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, None) for i in range(outputs)],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def offsets_graph(k: int, n: int, copies: int, rng: np.random.Generator) -> onnx.ModelProto:
    """The offsets term as the exact graph writes it, ``copies`` times with distinct weights:
    ``Y_i = -(blocksum32(X) @ M_i)`` (ReduceSum over 32-blocks, a float32 MatMul [K/32, N],
    a Neg standing in for the Sub from MatMulNBits' output); X is ``[1, q, K]``."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [4], np.array([1, -1, k // 32, 32], np.int64).tobytes(), raw=True)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], np.array([-1], np.int64).tobytes(), raw=True)
    inits = [shape, axes]
    nodes = [helper.make_node("Reshape", ["X", "shape"], ["Xr"]), helper.make_node("ReduceSum", ["Xr", "axes"], ["Xs"], keepdims=0)]
    for i in range(copies):
        inits.append(helper.make_tensor(f"M{i}", TensorProto.FLOAT, [k // 32, n], rng.random((k // 32) * n, dtype=np.float32).tobytes(), raw=True))
        nodes += [helper.make_node("MatMul", ["Xs", f"M{i}"], [f"O{i}"]), helper.make_node("Neg", [f"O{i}"], [f"Y{i}"])]
    return one_input_model("offsets", nodes, inits, k, copies)


def offsets_nbits_graph(k: int, n: int, copies: int, level: int, rng: np.random.Generator) -> onnx.ModelProto:
    """The same offsets term in a candidate exact form: a Q4_K offset is ``dmin m`` (``m`` a
    6-bit integer per 32 weights, ``dmin`` one scale per 256), so ``M`` is an 8-bit matrix
    with one scale per 8 entries; MatMulNBits takes blocks of >= 16, so each super-block's 8
    block sums are padded to 16 (zeros) and ``M`` with them: ``Y_i = -MatMulNBits(pad16(
    blocksum32(X)), m_i, dmin_i)`` at ``accuracy_level`` ``level`` (4: int8 activations, 0:
    float32), ``copies`` times with distinct weights; X is ``[1, q, K]``."""
    sb = k // 256
    shape = helper.make_tensor("shape", TensorProto.INT64, [5], np.array([1, -1, sb, 8, 32], np.int64).tobytes(), raw=True)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], np.array([-1], np.int64).tobytes(), raw=True)
    pads = helper.make_tensor("pads", TensorProto.INT64, [8], np.array([0, 0, 0, 0, 0, 0, 0, 8], np.int64).tobytes(), raw=True)
    flat = helper.make_tensor("flat", TensorProto.INT64, [3], np.array([1, -1, sb * 16], np.int64).tobytes(), raw=True)
    inits = [shape, axes, pads, flat]
    nodes = [
        helper.make_node("Reshape", ["X", "shape"], ["Xr"]),
        helper.make_node("ReduceSum", ["Xr", "axes"], ["Xs"], keepdims=0),
        helper.make_node("Pad", ["Xs", "pads"], ["Xp"]),
        helper.make_node("Reshape", ["Xp", "flat"], ["Xf"]),
    ]
    for i in range(copies):
        w = rng.integers(0, 64, (n, sb, 16), dtype=np.uint8)
        w[:, :, 8:] = 0
        inits.append(helper.make_tensor(f"W{i}", TensorProto.UINT8, [n, sb, 16], w.tobytes(), raw=True))
        inits.append(helper.make_tensor(f"S{i}", TensorProto.FLOAT, [n * sb], (rng.random(n * sb, dtype=np.float32) * 0.01).tobytes(), raw=True))
        inits.append(helper.make_tensor(f"Z{i}", TensorProto.UINT8, [n * sb], np.zeros(n * sb, np.uint8).tobytes(), raw=True))
        nodes.append(
            helper.make_node(
                "MatMulNBits", ["Xf", f"W{i}", f"S{i}", f"Z{i}"], [f"O{i}"], domain="com.microsoft", K=sb * 16, N=n, bits=8, block_size=16, accuracy_level=level
            )
        )
        nodes.append(helper.make_node("Neg", [f"O{i}"], [f"Y{i}"]))
    return one_input_model("offsets8", nodes, inits, k, copies)


def nbits_graph(layers: list[tuple], rng: np.random.Generator) -> onnx.ModelProto:
    """A graph of one MatMulNBits per ``(K, N, bits, block, zp)`` of ``layers``, all on ``X``
    ``[1, q, K]`` (the same K), outputs ``Y0..``."""
    nodes, inits = [], []
    for i, (k, n, bits, block, zp) in enumerate(layers):
        node, ini = nbits_node(i, k, n, bits, block, zp, rng)
        nodes.append(node)
        inits += ini
    k = layers[0][0]
    return one_input_model("forms", nodes, inits, k, len(layers))


def session(model: onnx.ModelProto, threads: int):
    """An onnxruntime CPU session with the runtime's options (:func:`specrt.runtime.backends.ort.session_options`)."""
    import onnxruntime as ort

    from specrt.runtime.backends.base import ThreadConfig
    from specrt.runtime.backends.ort import session_options

    return ort.InferenceSession(model.SerializeToString(), session_options(ThreadConfig(threads)), providers=["CPUExecutionProvider"])


def time_ms(sess, k: int, q: int, reps: int) -> float:
    """Median ms of ``reps`` runs of ``sess`` on a ``[1, q, K]`` input (one warm-up run first)."""
    x = np.random.default_rng(0).standard_normal((1, q, k), dtype=np.float32)
    sess.run(None, {"X": x})
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        sess.run(None, {"X": x})
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--q", type=int, action="append", default=None, help="rows per call (repeatable; default 1 and 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10, help="timed runs per form and round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the figure is the median of their medians)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    say_machine()
    machine = machine_record()  # the load at the start
    qs = a.q or [1, 5]
    rng = np.random.default_rng(1)
    cases = {}
    for kind, (count, forms) in FORMS.items():
        for name, layers in forms:
            copies = max(1, -(-COLD_BYTES // layer_bytes(layers)))
            cases[(kind, name)] = (session(nbits_graph(layers * copies, rng), a.threads), layers[0][0], copies, count)
    # the Q4_K layers' offsets terms of gate/up, down and o (the fused q/k/v's 28 are not timed); the block sums are
    # computed once per graph here, once per layer in the exact graph: only the MatMul's cost is compared
    for kind, k, n, count in (("offsets, gate/up Q4_K", 1536, 8960, 56), ("offsets, down Q4_K", 8960, 1536, 14), ("offsets, o Q4_K", 1536, 1536, 28)):
        copies = max(1, -(-COLD_BYTES // ((k // 32) * n * 4)))
        cases[(kind, "float32 MatMul of 32-block sums")] = (session(offsets_graph(k, n, copies, rng), a.threads), k, copies, count)
        copies8 = max(1, -(-COLD_BYTES // ((k // 256) * 16 * n + (k // 256) * n * 4)))
        for level in (4, 0):
            cases[(kind, f"8-bit MatMulNBits, padded, acc {level}")] = (session(offsets_nbits_graph(k, n, copies8, level, rng), a.threads), k, copies8, count)
    samples = {c: {q: [] for q in qs} for c in cases}
    for _ in range(a.rounds):
        for c, (sess, k, copies, _) in cases.items():
            for q in qs:
                samples[c][q].append(time_ms(sess, k, q, a.reps) / copies)
    rows = []
    for (kind, name), per_q in samples.items():
        _, _, copies, count = cases[(kind, name)]
        med = {q: statistics.median(v) for q, v in per_q.items()}
        rows.append(
            dict(
                layer=kind,
                form=name,
                copies_timed=copies,
                per_step=count,
                **{f"ms_q{q}": v for q, v in med.items()},
                **{f"ms_per_step_q{q}": v * count for q, v in med.items()},
                rounds={str(q): v for q, v in per_q.items()},
            )
        )
        print(f"{kind:<22} {name:<40} " + "  ".join(f"q{q} {v:7.3f} ms x{count} = {v * count:6.2f}" for q, v in med.items()))
    emit(
        dict(command=command(), machine=machine, loadavg_end=os.getloadavg(), threads=a.threads, reps=a.reps, rounds=a.rounds, rows=rows),
        a.out,
        hide=("rows",),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
