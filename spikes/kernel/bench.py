"""Kernel spike driver: a Q4_K/Q6_K matmul straight from the GGUF's blocks (q4k.c) against
onnxruntime's MatMulNBits (as the exact graph uses it) and ggml's mul_mat, at the real
target's layer shapes, for call widths q = 1..9.

1. correctness: every kernel output against float64 ``gguf.dequantize(W) @ x`` (and against the
   same product with llama.cpp's 8-bit-quantized activations, which isolates the kernel's own
   arithmetic); bit-identity of every output row across q = 1..9 and thread counts
   (the exit status is 1 if the kernel's rows are not bit-identical);
2. timing: every (shape, engine, q, cache state) case once per repetition in a fresh random
   order; median and quartiles of ms per call. ``cold``: a 256 MiB read evicts the LLC before
   the timed call (decoding streams ~1 GB of weights per token, so every layer comes from
   DRAM); ``warm``: an untimed call of the same case right before.

Usage (see spikes/kernel/README.md; ``make kernel-spike`` builds and runs it)::

    python spikes/kernel/bench.py --reps 15 --out docs/bench/kernel_spike/<isa>.json
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before libgomp loads: no spinning workers (ORT runs with spinning off too)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # one session builder with the layer-kinds record
from measure_layer_kinds import session  # noqa: E402

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build"
GGUF = Path.home() / ".cache/specrt/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
TYPE_ID = {"Q4_K": 12, "Q6_K": 14}
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


# ---------------------------------------------------------------- engines
class Kernel:
    def __init__(self, path=BUILD / "libq4k.so"):
        self.lib = ctypes.CDLL(str(path))
        f = self.lib.kq_matmul
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        f.restype = ctypes.c_int

    def bind(self, kind, w, x, threads=2):
        """A no-argument callable computing y = x @ W^T into the returned y."""
        q, k = x.shape
        n = w.shape[0]
        y = np.empty((q, n), np.float32)
        args = (TYPE_ID[kind], x.ctypes.data, q, k, w.ctypes.data, n, y.ctypes.data, threads)
        f = self.lib.kq_matmul

        def run():
            if f(*args):
                raise RuntimeError("kq_matmul failed")
            return y

        run.keep = (w, x, y)
        return run


class Ggml:
    def __init__(self, path=BUILD / "libggml_harness.so"):
        self.lib = ctypes.CDLL(str(path))
        self.lib.gh_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.gh_new.restype = ctypes.c_void_p
        self.lib.gh_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.gh_buft.argtypes = [ctypes.c_void_p]
        self.lib.gh_buft.restype = ctypes.c_char_p
        self.lib.gh_free.argtypes = [ctypes.c_void_p]

    def bind(self, kind, w, x, repack, threads=2):
        q, k = x.shape
        n = w.shape[0]
        h = self.lib.gh_new(TYPE_ID[kind], w.ctypes.data, k, n, q, int(repack), threads)
        if not h:
            raise RuntimeError("gh_new failed")
        y = np.empty((q, n), np.float32)
        f, xp, yp = self.lib.gh_run, x.ctypes.data, y.ctypes.data

        def run():
            if f(h, xp, yp):
                raise RuntimeError("gh_run failed")
            return y

        run.keep = (w, x, y)
        run.buft = self.lib.gh_buft(h).decode()
        weakref.finalize(run, self.lib.gh_free, ctypes.c_void_p(h))
        return run


def ort_session(blocks, k, n, threads=2):
    """MatMulNBits(q, s, z) x - (blocksum32(x) @ M^T), as the exact export writes a GGUF layer
    (export/gguf_blocks.py, export/prequantize.py add_min_corrections): Q4_K as 4-bit blocks of
    32 with a zero-point input (z = 0) plus the offsets branch; Q6_K as 8-bit blocks of 16 with
    zero points (z = 32), no offsets. accuracy_level 4 (int8 activations), the export's setting.
    Sessions as scripts/measure_layer_kinds.py builds them (intra-op threads, spinning off)."""
    from onnx import TensorProto, helper, numpy_helper

    bits, group = blocks.bits, blocks.group
    nblk = k // group
    if bits == 4:
        qq = blocks.q.reshape(n, nblk, group // 2, 2)
        packed = (qq[..., 0] | (qq[..., 1] << 4)).astype(np.uint8)
        z = blocks.zeros.astype(np.uint8)
        if nblk % 2:
            z = np.concatenate([z, np.zeros((n, 1), np.uint8)], 1)
        zp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    else:
        packed = blocks.q.reshape(n, nblk, group).astype(np.uint8)
        zp = blocks.zeros.astype(np.uint8)
    inits = [
        helper.make_tensor("W", TensorProto.UINT8, packed.shape, packed.tobytes(), raw=True),
        numpy_helper.from_array(np.ascontiguousarray(blocks.scales.reshape(-1), np.float32), "S"),
        helper.make_tensor("Z", TensorProto.UINT8, zp.shape, zp.tobytes(), raw=True),
    ]
    out = "y" if blocks.mins is None else "raw"
    nodes = [helper.make_node("MatMulNBits", ["x", "W", "S", "Z"], [out], domain="com.microsoft", K=k, N=n, bits=bits, block_size=group, accuracy_level=4)]
    if blocks.mins is not None:
        inits += [
            numpy_helper.from_array(np.array([-1, k // 32, 32], np.int64), "shape"),
            numpy_helper.from_array(np.array([-1], np.int64), "axes"),
            numpy_helper.from_array(np.ascontiguousarray(blocks.mins.T, np.float32), "MT"),
        ]
        nodes += [
            helper.make_node("Reshape", ["x", "shape"], ["blocks"]),
            helper.make_node("ReduceSum", ["blocks", "axes"], ["sums"], keepdims=0),
            helper.make_node("MatMul", ["sums", "MT"], ["offset"]),
            helper.make_node("Sub", ["raw", "offset"], ["y"]),
        ]
    return layer_session(nodes, inits, k, n, threads)


def layer_session(nodes, inits, k, n, threads):
    """A session of one layer's ``nodes``: input ``x`` [q, k], output ``y`` [q, n] (float32),
    with the runtime's session options (measure_layer_kinds.session: intra-op ``threads``,
    idle threads not spinning)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes,
        "layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["q", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["q", n])],
        inits,
    )
    return session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]), threads)


def ort_noop(k, threads=2):
    """An Identity session: onnxruntime's Python run() overhead per call, for reference."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "noop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["q", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["q", k])],
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString(), so, providers=["CPUExecutionProvider"]
    )


def bind_ort(sess, x):
    feed = {"x": x}
    return lambda: sess.run(None, feed)[0]


# ---------------------------------------------------------------- reference arithmetic
def q8k(x):
    """llama.cpp's quantize_row_q8_K_ref in numpy (float32 arithmetic, RNE): the dequantized
    activations the K-quant dot products actually use."""
    q, k = x.shape
    b = x.reshape(q, k // 256, 256).astype(np.float32)
    idx = np.abs(b).argmax(-1)
    mx = np.take_along_axis(b, idx[..., None], -1)
    with np.errstate(divide="ignore"):
        iscale = (np.float32(-127.0) / mx).astype(np.float32)
    v = np.minimum(np.rint(iscale * b), 127).astype(np.float32)
    d = (np.float32(1.0) / iscale).astype(np.float32)
    return (v.astype(np.float64) * d.astype(np.float64)).reshape(q, k)


def rel_err(y, ref):
    """max over rows of ||y - ref|| / ||ref||, and max |y - ref| / max |ref|."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    per_row = np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1)
    return float(per_row.max()), float(np.abs(y - ref).max() / np.abs(ref).max())


def bit_identity(make_run, x, qmax):
    """Row r of every q-row call (q = 1..qmax) equals row r of the qmax-row call and of the 1-row
    call on that row alone, bit for bit. Returns (ok, number of differing rows)."""
    full = make_run(x[:qmax]).copy()
    bad = 0
    for q in range(1, qmax + 1):
        y = make_run(np.ascontiguousarray(x[:q]))
        bad += int((y.view(np.uint32) != full[:q].view(np.uint32)).any(axis=1).sum())
    for r in range(qmax):
        y = make_run(np.ascontiguousarray(x[r : r + 1]))
        bad += int((y.view(np.uint32) != full[r : r + 1].view(np.uint32)).any())
    return bad == 0, bad


# ---------------------------------------------------------------- main
def pick_tensors(reader, names):
    by = {t.name: t for t in reader.tensors}
    out = {}
    for label, name in names.items():
        if name == "ffn_down Q4_K":
            name = next(t.name for t in reader.tensors if t.name.endswith("ffn_down.weight") and t.tensor_type.name == "Q4_K")
        out[label] = by[name]
    return out


def cpu_detail():
    """/proc/cpuinfo's family/model/stepping and lscpu's cache sizes (the model name is generic here)."""
    out = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k in ("cpu family", "model", "stepping", "cpu MHz") and k not in out:
            out[k] = v.strip()
        if k == "processor" and v.strip() == "1":
            break
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in lscpu.splitlines():
        k, _, v = line.partition(":")
        if k.strip() in ("L1d cache", "L2 cache", "L3 cache"):
            out[k.strip()] = v.strip()
    return out


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=str(GGUF))
    ap.add_argument("--qs", default="1,2,3,4,5,6,7,8,9")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-ggml", action="store_true", help="skip ggml (library not built)")
    ap.add_argument("--no-lm-head", action="store_true", help="skip output.weight (Q6_K, 151936 x 1536)")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    qs = [int(v) for v in a.qs.split(",")]
    qmax = max(qs)
    t_start = time.time()
    load_before = uptime()
    print("load before:", load_before, flush=True)

    import gguf

    from specrt.export.gguf_blocks import unpack
    from specrt.runtime.machine import machine_record

    reader = gguf.GGUFReader(a.gguf)
    names = {
        "attn_q (Q4_K 1536x1536)": "blk.0.attn_q.weight",
        "ffn_gate (Q4_K 8960x1536)": "blk.0.ffn_gate.weight",
        "ffn_down (Q4_K 1536x8960)": "ffn_down Q4_K",
        "ffn_down (Q6_K 1536x8960)": "blk.0.ffn_down.weight",
    }
    if not a.no_lm_head:
        names["lm_head (Q6_K 151936x1536)"] = "output.weight"
    tensors = pick_tensors(reader, names)

    # bytes per token of each representation, whole target (token_embd is a lookup: excluded)
    bpt = dict(gguf_blocks=0, exact_graph_ort=0)
    for t in reader.tensors:
        if t.name == "token_embd.weight" or len(t.shape) != 2 or t.tensor_type.name not in BLOCK_BYTES:
            continue
        n, k = int(t.shape[1]), int(t.shape[0])
        bpt["gguf_blocks"] += int(np.asarray(t.data).nbytes)
        if t.tensor_type.name == "Q4_K":  # 4-bit q + f32 scale + 4-bit zp per 32, f32 offset per 32
            bpt["exact_graph_ort"] += n * (k // 2 + (k // 32) * 4 + (k // 64) + (k // 32) * 4)
        else:  # Q6_K as 8-bit blocks of 16: q byte + f32 scale + 8-bit zp per 16
            bpt["exact_graph_ort"] += n * (k + (k // 16) * 4 + k // 16)
    print("bytes per token:", bpt, flush=True)

    kern = Kernel()
    gg = None if a.no_ggml else Ggml()
    rng = np.random.default_rng(0)
    rec_shapes = {}
    cases = []  # (shape, engine, q, run)
    failures = []
    for label, t in tensors.items():
        kind = t.tensor_type.name
        w = np.ascontiguousarray(np.asarray(t.data))  # [N, K/256 * bytes]
        n, k = int(t.shape[1]), int(t.shape[0])
        x = rng.standard_normal((qmax, k), dtype=np.float32)
        t0 = time.time()
        lo_rows = n if n <= 16384 else 8192  # lm_head: accuracy on the first 8192 rows
        wd = gguf.dequantize(w[:lo_rows], t.tensor_type).reshape(lo_rows, k).astype(np.float64)
        ref = x.astype(np.float64) @ wd.T
        ref_q8 = q8k(x) @ wd.T
        info = dict(tensor=t.name, type=kind, N=n, K=k, bytes=int(w.nbytes), accuracy_rows=lo_rows)
        eng_runs = {}
        y = kern.bind(kind, w, x, a.threads)().copy()
        info["kernel_rel_err_vs_fp64"] = rel_err(y[:, :lo_rows], ref)
        info["kernel_rel_err_vs_q8_activations"] = rel_err(y[:, :lo_rows], ref_q8)
        ok, bad = bit_identity(lambda xx: kern.bind(kind, w, xx, a.threads)(), x, qmax)
        y1 = kern.bind(kind, w, x, 1)()
        ok_threads = bool(np.array_equal(y1.view(np.uint32), y.view(np.uint32)))
        info["kernel_bit_identical_across_q"] = ok
        info["kernel_bit_identical_threads_1_vs_2"] = ok_threads
        if not (ok and ok_threads):
            failures.append(f"{label}: {bad} rows differ across q; threads equal: {ok_threads}")
        eng_runs["kernel"] = lambda xx, w=w, kind=kind: kern.bind(kind, w, xx, a.threads)
        if gg is not None:
            for rp in [False, True] if kind == "Q4_K" else [False]:
                name = "ggml-repack" if rp else "ggml"
                r = gg.bind(kind, w, x, rp, a.threads)
                yg = r().copy()
                info[f"{name}_buffer"] = r.buft
                info[f"{name}_rel_err_vs_fp64"] = rel_err(yg[:, :lo_rows], ref)
                info[f"{name}_max_abs_diff_vs_kernel"] = float(np.abs(yg - y).max())
                info[f"{name}_bit_identical_to_kernel"] = bool(np.array_equal(yg.view(np.uint32), y.view(np.uint32)))
                info[f"{name}_bit_identical_across_q"] = bit_identity(lambda xx, rp=rp: gg.bind(kind, w, xx, rp, a.threads)(), x, qmax)[0]
                eng_runs[name] = lambda xx, w=w, kind=kind, rp=rp: gg.bind(kind, w, xx, rp, a.threads)
        if "lm_head" not in label:  # the exact graph's MatMulNBits form (unpack checks it against gguf.dequantize)
            blocks = unpack(t)
            sess = ort_session(blocks, k, n, a.threads)
            yo = sess.run(None, {"x": x})[0]
            info["ort_rel_err_vs_fp64"] = rel_err(yo, ref)
            info["ort_bit_identical_across_q"] = bit_identity(lambda xx: sess.run(None, {"x": np.ascontiguousarray(xx)})[0], x, qmax)[0]
            eng_runs["ort"] = lambda xx, sess=sess: bind_ort(sess, xx)
            del blocks
        del wd
        rec_shapes[label] = info
        print(f"{label}: checked in {time.time() - t0:.1f}s", {kk: v for kk, v in info.items() if kk not in ("tensor",)}, flush=True)
        for eng, make in eng_runs.items():
            for q in qs:
                xq = np.ascontiguousarray(rng.standard_normal((q, k), dtype=np.float32))
                cases.append((label, eng, q, make(xq)))
    noop = ort_noop(1536, a.threads)
    for q in qs:
        cases.append(("(none)", "ort-noop", q, bind_ort(noop, np.ascontiguousarray(rng.standard_normal((q, 1536), dtype=np.float32)))))

    rows = []
    load_meas = []
    if not a.check_only:
        flush = np.ones(256 << 17, np.float64)  # 256 MiB
        for *_, run in cases:
            run()
            run()
        order = [(i, c) for i in range(len(cases)) for c in ("cold", "warm")]
        times = {o: [] for o in order}
        load_meas.append(uptime())
        print("measuring:", len(order), "cases x", a.reps, "repetitions;", load_meas[-1], flush=True)
        for rep in range(a.reps):
            for j in rng.permutation(len(order)):
                i, cond = order[j]
                run = cases[i][3]
                if cond == "cold":
                    flush.sum()
                else:
                    run()
                t0 = time.perf_counter()
                run()
                times[(i, cond)].append(time.perf_counter() - t0)
            if rep % 5 == 4:
                load_meas.append(uptime())
            print(f"repetition {rep + 1}/{a.reps}", file=sys.stderr, flush=True)
        for (i, cond), t in times.items():
            label, eng, q, _ = cases[i]
            ms = np.asarray(t) * 1e3
            rows.append(
                dict(
                    shape=label,
                    engine=eng,
                    q=q,
                    cache=cond,
                    median_ms=float(np.median(ms)),
                    q1_ms=float(np.percentile(ms, 25)),
                    q3_ms=float(np.percentile(ms, 75)),
                )
            )
        by = {(r["shape"], r["engine"], r["q"], r["cache"]): r["median_ms"] for r in rows}
        for cond in ("cold", "warm"):
            print(f"\n[{cond}] median ms per call")
            print(f"{'shape':<28}{'engine':<13}" + "".join(f"{'q=' + str(q):>8}" for q in qs))
            for label in list(tensors) + ["(none)"]:
                for eng in ("kernel", "ort", "ggml", "ggml-repack", "ort-noop"):
                    if (label, eng, qs[0], cond) in by:
                        print(f"{label:<28}{eng:<13}" + "".join(f"{by[(label, eng, q, cond)]:>8.3f}" for q in qs))
    load_after = uptime()
    print("load after:", load_after)
    rec = dict(
        command="python spikes/kernel/bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=machine_record(),
        cpu_detail=cpu_detail(),
        builds=dict(
            kernel="gcc -O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -ffp-contract=off -fopenmp -shared -fPIC (spikes/kernel/q4k.c)",
            ggml="ggml from llama-cpp-python 0.3.36 (vendor/llama.cpp), cmake -DGGML_NATIVE=ON, AMX off, GGML_OPENMP=ON, Release",
        ),
        threads=a.threads,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        reps=a.reps,
        gguf=os.path.basename(a.gguf),
        load=dict(before=load_before, during=load_meas, after=load_after),
        bytes_per_token=bpt,
        shapes=rec_shapes,
        rows=rows,
        failures=failures,
        wall_s=round(time.time() - t_start, 1),
    )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        import json

        Path(a.out).write_text(json.dumps(rec, indent=1) + "\n")
        print("wrote", a.out)
    if failures:
        print("BIT-IDENTITY FAILURES:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
