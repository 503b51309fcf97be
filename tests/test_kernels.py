"""specrt's CPU kernels (runtime/kernels): the panel layout, the q-row matmuls and the whole
decoder step.

Oracles: ``gguf.dequantize`` of the same blocks (the layout, bit for bit), a float64 numpy
product on the same 8-bit activations (the matmuls), an independent numpy decoder step
(tests/kernel_ref.py) and, for a real file, PyTorch on the GGUF's converted folder. The
exactness the decode loop relies on: every row is bit-identical whatever the call width
(every width 1..k_max+1 and the prefill chunk), the thread count and the ISA path.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")

import kernel_ref as R  # noqa: E402

from specrt.runtime import kernels as K  # noqa: E402
from specrt.runtime.kernels import panels as PN  # noqa: E402

if K.status() is not None:
    pytest.skip(f"kernels not available: {K.status()}", allow_module_level=True)

ISAS = K.ISAS[: K.ISAS.index(K.cpu_isa()) + 1]  # every path this CPU runs
TYPES = [R.F32, R.F16, R.BF16, R.Q4_0, R.Q4_1, R.Q5_0, R.Q5_1, R.Q8_0, R.IQ4_NL, R.Q2_K, R.Q3_K, R.Q4_K, R.Q5_K, R.Q6_K, R.IQ4_XS]
K_MAX = 8


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def tensors():
    """Per type: (raw blocks, panels, n, k) of a random [48, 512] matrix."""
    rng = np.random.default_rng(0)
    out = {}
    for ty in TYPES:
        n, k = 48, 512
        raw = R.random_tensor(rng, ty, n, k)
        out[ty] = (raw, PN.pack(raw, ty, n, k), n, k)
    return out


@pytest.mark.parametrize("ty", [R.Q8_0, R.Q4_K, R.Q6_K, R.F16], ids=lambda t: PN.TYPES[t])
def test_a_tensor_packed_in_several_chunks_holds_the_gguf_values(ty):
    """``pack`` goes a few MB of panels at a time: a [2048, 4096] tensor takes two chunks, and
    its panels read back as gguf.dequantize of the blocks in every row of both."""
    n, k = 2048, 4096
    assert n // PN.P > (1 << 22) // (k * PN.P)  # more than one chunk
    raw = R.random_tensor(np.random.default_rng(3), ty, n, k)
    np.testing.assert_array_equal(bits(K.dequant(ty, n, k, PN.pack(raw, ty, n, k))), bits(R.dequant(raw, ty, n, k)))


def test_requantization_in_row_chunks_equals_the_whole_tensor():
    """The draft's requantization (``kernel_pack._blocks``) goes by row chunks: the blocks of a
    two-chunk tensor equal gguf-py's quantization of the whole dequantized tensor, rows kept too."""
    from types import SimpleNamespace

    import gguf
    from gguf.quants import dequantize, quantize

    from specrt.export.kernel_pack import _blocks

    n, k = 2048, 4096
    raw = R.random_tensor(np.random.default_rng(4), R.Q8_0, n, k)
    t = SimpleNamespace(tensor_type=gguf.GGMLQuantizationType(R.Q8_0), shape=[k, n], data=raw)
    whole = quantize(dequantize(np.asarray(raw).view(np.uint8).reshape(n, -1), t.tensor_type).reshape(n, k), gguf.GGMLQuantizationType(R.Q4_0)).reshape(n, -1)
    ty, n2, k2, got = _blocks(t, R.Q4_0, None)
    assert (ty, n2, k2) == (R.Q4_0, n, k) and np.array_equal(got, whole)
    rows = np.arange(0, n, 3)
    assert np.array_equal(_blocks(t, R.Q4_0, rows)[3], whole[rows])


def test_isa_paths_named():
    assert K.cpu_isa() in K.ISAS and ISAS[0] == "portable"
    with pytest.raises(ValueError, match="choose one of"):
        K.isa_id("sse9")


@pytest.mark.parametrize("ty", TYPES, ids=lambda t: PN.TYPES[t])
def test_panels_hold_the_gguf_values(tensors, ty):
    """Read back by the kernels' C code, the panels are gguf.dequantize of the blocks, bit for bit."""
    raw, pan, n, k = tensors[ty]
    assert pan.size == PN.panel_bytes(ty, n, k)
    want = R.dequant(raw, ty, n, k)
    np.testing.assert_array_equal(bits(K.dequant(ty, n, k, pan)), bits(want))
    np.testing.assert_array_equal(bits(K.dequant(ty, n, k, pan, 16, 32)), bits(want[16:32]))


def test_pack_refuses_shapes_it_cannot_lay_out():
    assert PN.supported(R.Q4_K, 40, 512) == "40 output columns is not a multiple of 16"
    assert "not a multiple of the Q4_K block" in PN.supported(R.Q4_K, 32, 320)
    assert "is not one the kernels run" in PN.supported(16, 32, 256)  # IQ2_XXS
    with pytest.raises(ValueError, match="bytes for a"):
        PN.pack(np.zeros(10, np.uint8), R.Q8_0, 16, 32)


@pytest.mark.parametrize("ty", TYPES, ids=lambda t: PN.TYPES[t])
def test_matmul_is_the_product_on_8_bit_activations(tensors, ty):
    raw, pan, n, k = tensors[ty]
    x = np.random.default_rng(1).standard_normal((5, k)).astype(np.float32)
    ref = R.matmul_ref(x, R.dequant(raw, ty, n, k), ty)
    # float weights: float32 rounding of two k/2-long FMA chains, growing as sqrt(k); the
    # others: exact integer sums, one rounding per block
    bound = 1.5e-7 * np.sqrt(k) if ty in R.FLOATS else 2e-6
    for isa in ISAS:
        y = K.matmul(ty, n, k, pan, x, isa=isa)
        assert np.abs(y - ref).max() <= bound * np.sqrt((ref**2).mean()), isa


@pytest.mark.parametrize("ty", TYPES, ids=lambda t: PN.TYPES[t])
def test_a_nan_in_one_activation_block_makes_its_row_nan(tensors, ty):
    """One NaN among finite activations: its row's outputs are NaN (the caller refuses them),
    never computed as if it were 0; the other rows are unchanged."""
    _, panels, n, k = tensors[ty]
    x = np.random.default_rng(4).standard_normal((3, k)).astype(np.float32)
    base = K.matmul(ty, n, k, panels, x)
    x[1, 40] = np.nan
    y = K.matmul(ty, n, k, panels, x)
    assert np.isnan(y[1]).all()
    np.testing.assert_array_equal(bits(y[[0, 2]]), bits(base[[0, 2]]))


@pytest.mark.parametrize("ty", [R.F32, R.F16, R.BF16], ids=lambda t: PN.TYPES[t])
def test_float_weights_take_any_k(ty):
    """Float weights have no block: an odd k (its last input on the even chain) is the float64
    product to float32 rounding, the same bits on every ISA path and width."""
    rng = np.random.default_rng(5)
    n, k = 32, 37
    raw = R.random_tensor(rng, ty, n, k)
    pan = PN.pack(raw, ty, n, k)
    x = rng.standard_normal((6, k)).astype(np.float32)
    ref = R.matmul_ref(x, R.dequant(raw, ty, n, k), ty)
    base = K.matmul(ty, n, k, pan, x, isa="portable")
    assert np.abs(base - ref).max() <= 1e-6 * np.abs(ref).max()
    for isa in ISAS:
        for q in (1, 4, 6):
            np.testing.assert_array_equal(bits(K.matmul(ty, n, k, pan, x[:q], isa=isa)), bits(base[:q]), err_msg=f"{isa} q={q}")


@pytest.mark.parametrize("ty", TYPES, ids=lambda t: PN.TYPES[t])
def test_matmul_rows_do_not_depend_on_width_threads_or_isa(tensors, ty):
    """Every window of every width 1..k_max+1, the 256-row prefill chunk, 1 and 2 threads,
    every ISA path: the same bits for each row."""
    _, pan, n, k = tensors[ty]
    x = np.random.default_rng(2).standard_normal((256, k)).astype(np.float32)
    base = K.matmul(ty, n, k, pan, x, isa="portable", threads=1)
    for isa in ISAS:
        for th in (1, 2):
            full = K.matmul(ty, n, k, pan, x, isa=isa, threads=th)
            np.testing.assert_array_equal(bits(full), bits(base), err_msg=f"{isa} {th} threads, 256 rows")
            for q in range(1, K_MAX + 2):
                for r0 in (0, 3, 250 - q):
                    y = K.matmul(ty, n, k, pan, x[r0 : r0 + q], isa=isa)
                    np.testing.assert_array_equal(bits(y), bits(base[r0 : r0 + q]), err_msg=f"{isa} {th} threads, q={q} at {r0}")
    K.start_team(2)


# ---------------------------------------------------------------- the decoder step


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    """(gguf path, panels record, weights factory) of a random 2-layer decoder."""
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.kernels.weights import KernelWeights

    out = tmp_path_factory.mktemp(f"kern_{request.param}")
    g = R.write_gguf(out / "m.gguf", request.param)
    rec = write_panels(g, out, "target", log=lambda *_: None)
    assert rec is not None and rec["rope_neox"] == (request.param != "llama")
    K.start_team(2)
    return g, rec, lambda ctx=256, q=64: KernelWeights(out / "target.panels", rec, ctx, q)


def model(w, isa=None):
    from specrt.runtime.backends.kern import KernelModel

    return KernelModel(w, isa or K.cpu_isa())


PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 512, 40)]


def test_step_matches_the_numpy_reference(tiny):
    g, rec, weights = tiny
    got = model(weights()).run(PROMPT, 0).astype(np.float64)
    ref = R.reference_step(g, PROMPT, rec["rope_neox"])
    # most rows to float rounding; where an 8-bit activation rounds the other way (the reference
    # rounds in float64), that row and the later ones that attend to it differ by ~1e-3
    err = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.median(err) < 1e-5 and err.max() < 0.02, err
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.95


LINEAR = {"rope.scaling.factor": 8.0}  # gemma3 4B+'s linear RoPE scaling (its global layers only)


@pytest.mark.parametrize(
    "arch,floats", [("gemma2", None), ("gemma3", None), ("gemma3", LINEAR), ("llama", LINEAR)], ids=["gemma2", "gemma3", "gemma3-linear8", "llama-linear8"]
)
def test_gemma_layers_match_the_reference_on_every_row(tmp_path, arch, floats):
    """gemma's GeGLU, embedding scale, post norms, soft-caps, sliding layers and their RoPE
    base, and linear RoPE scaling, over float weights (no 8-bit activation to round the other
    way): every row equals the numpy reference to float32 rounding, and the row is the same on
    every ISA path."""
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.kernels.weights import KernelWeights

    g = R.write_gguf(tmp_path / "m.gguf", arch, types=dict.fromkeys(KINDS, R.F32), floats=floats)
    rec = write_panels(g, tmp_path, "target", log=lambda *_: None)
    assert rec["dims"].get("swa") == {"gemma2": [16, 0], "gemma3": [16, 16, 0]}.get(arch)
    assert rec["dims"]["rope_scale"] == (8.0 if floats else 1.0) and rec["dims"].get("rope_scale_swa", 1.0) == 1.0
    w = KernelWeights(tmp_path / "target.panels", rec, 256, 64)
    base = model(w, "portable").run(PROMPT, 0).astype(np.float64)
    ref = R.reference_step(g, PROMPT, rec["rope_neox"])
    err = np.linalg.norm(base - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert err.max() < (2e-5 if arch.startswith("gemma") else 1e-4), err  # llama: no post norm keeps the float32 rounding small
    for isa in ISAS:
        np.testing.assert_array_equal(bits(model(w, isa).run(PROMPT, 0)), bits(base.astype(np.float32)), err_msg=isa)


def test_step_rows_do_not_depend_on_the_calls(tiny):
    """One 40-row call == 1-row steps == uneven chunks == every verification width from a
    past, on every ISA path and with 1 or 2 threads; the KV rows too."""
    _, _, weights = tiny
    w = weights()
    one = model(w, "portable")
    base = one.run(PROMPT, 0).copy()
    att = w.last_attention(len(PROMPT))  # the last layer's attention rows, before quantization
    kv = (one.k.copy(), one.v.copy())
    for isa in ISAS:
        for th in (1, 2):
            K.start_team(th)
            m = model(w, isa)
            rows, atts = [], []
            for i, t in enumerate(PROMPT):
                rows.append(m.run([t], i)[0].copy())
                atts.append(w.last_attention(1)[0])
            np.testing.assert_array_equal(bits(np.stack(rows)), bits(base), err_msg=f"{isa} {th} threads, 1-row steps")
            np.testing.assert_array_equal(bits(np.stack(atts)), bits(att), err_msg=f"{isa} {th} threads, attention rows")
            assert np.array_equal(m.k, kv[0]) and np.array_equal(m.v, kv[1])
            lo = 0
            for q in (7, 1, 12, 3, 17):
                got = m.run(PROMPT[lo : lo + q], lo)
                np.testing.assert_array_equal(bits(got), bits(base[lo : lo + q]), err_msg=f"{isa} chunk {lo}+{q}")
                lo += q
            for q in range(1, K_MAX + 2):  # verification widths after a past of 30
                got = m.run(PROMPT[30 : 30 + q], 30)
                np.testing.assert_array_equal(bits(got), bits(base[30 : 30 + q]), err_msg=f"{isa} q={q}")
    K.start_team(2)


KINDS = ("attn", "attn_v", "ffn", "ffn_down", "embd", "output")
# a Q4_K decoder whose value, down projections and head are float (llama.cpp's --output-tensor-type
# f32 and friends): float and quantized activations in one step
MIXED = {"attn": R.Q4_K, "ffn": R.Q4_K, "embd": R.Q8_0, "attn_v": R.BF16, "ffn_down": R.F16, "output": R.F32}


@pytest.mark.parametrize("ty", [R.Q5_1, R.IQ4_NL, R.Q2_K, R.Q3_K, R.Q5_K, R.IQ4_XS, R.F32, R.F16, R.BF16, "mixed"], ids=lambda t: PN.TYPES.get(t, t))
def test_a_decoder_of_one_block_type_steps_exactly(tmp_path, ty):
    """Each block type added through the block-type tables as every matrix of a decoder
    (attention, FFN, the token embeddings and the LM head), and a decoder mixing float and
    quantized matrices: the step matches the numpy reference, and 1-row steps give the 40-row
    call's bits on every ISA path."""
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.kernels.weights import KernelWeights

    types = MIXED if ty == "mixed" else dict.fromkeys(KINDS, ty)
    g = R.write_gguf(tmp_path / "m.gguf", "llama", types=types)
    rec = write_panels(g, tmp_path, "target", log=lambda *_: None)
    assert {t["type"] for t in rec["tensors"].values() if t["k"] > 1} == set(types.values())  # the matrices (norms: k = 1)
    w = KernelWeights(tmp_path / "target.panels", rec, 256, 64)
    base = model(w, "portable").run(PROMPT, 0).copy()
    ref = R.reference_step(g, PROMPT, rec["rope_neox"])
    # most rows equal the reference to float rounding; a few differ where an 8-bit activation
    # rounds the other way (as Q4_1's do; the reference rounds in float64). Float weights read
    # unquantized activations, so float32 rounding carries through the layers (no 8-bit grid
    # absorbs it): ~1e-5
    err = np.linalg.norm(base - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.median(err) < (1e-5 if ty in R.K_QUANTS + (R.Q5_1, R.IQ4_NL) else 1e-4) and err.max() < 0.05 and (base.argmax(1) == ref.argmax(1)).mean() >= 0.95
    for isa in ISAS:
        m = model(w, isa)
        np.testing.assert_array_equal(bits(np.stack([m.run([t], i)[0].copy() for i, t in enumerate(PROMPT)])), bits(base), err_msg=isa)
        # the reduced head over this head's type: each row's first maximum, as numpy's argmax
        np.testing.assert_array_equal(m.run_argmax(PROMPT, 0, 512), base.argmax(1), err_msg=isa)


def test_rows_past_start_are_never_read(tiny):
    """Rolling back is a smaller start: garbage in KV rows >= start changes nothing."""
    _, _, weights = tiny
    m = model(weights())
    base = m.run(PROMPT, 0).copy()
    m.run([1, 2, 3, 4, 5], 20)  # overwrite rows 20..24 with other tokens
    np.testing.assert_array_equal(bits(m.run(PROMPT[20:40], 20)), bits(base[20:40]))
    assert m.release_rows(0) > 0  # all rows back to the OS (zeros)
    np.testing.assert_array_equal(bits(m.run(PROMPT, 0)), bits(base))


def test_run_rows_projects_only_the_rows_asked(tiny):
    _, _, weights = tiny
    m = model(weights())
    base = m.run(PROMPT, 0).copy()
    m.logits[:] = np.nan
    got = m.run_rows(PROMPT, 0, len(PROMPT) - 1)
    assert np.isnan(got[:-1]).all()
    np.testing.assert_array_equal(bits(got[-1]), bits(base[-1]))
    m.run_rows(PROMPT[:30], 0, 30)  # no row projected: KV only
    np.testing.assert_array_equal(bits(m.run(PROMPT[30:], 30)), bits(base[30:]))


def test_bad_calls_are_refused_in_one_line(tiny):
    from specrt.runtime.errors import InputError

    _, _, weights = tiny
    m = model(weights(ctx=64, q=16))
    with pytest.raises(InputError, match="allowed 1 <= q <= 16"):
        m.run(list(range(17)), 0)
    with pytest.raises(InputError, match="max_ctx=64"):
        m.run([1, 2], 63)
    with pytest.raises(InputError, match="outside the vocabulary 0..511"):
        m.run([1, 600], 0)


def test_the_argmax_head_is_numpys_argmax():
    """The argmax head's reduction (each thread's columns in chunks, a 16-lane scan, the
    threads' results merged in id order) == np.argmax on rows built for each rule: ties inside
    a vector, across chunks and across the threads' ranges (the first id wins), NaN (the first
    NaN beats every number), inf, all -inf, -0.0 == 0.0, the last id, a width that is not a
    multiple of 16; every ISA path, 1 and 2 threads. Its value is the row's, bit for bit."""
    rng = np.random.default_rng(5)
    n = 5003  # chunks of 1,024 ids: 5 chunks, 2 threads split at id 2048 (chunks 0-1, 2-4)
    x = rng.standard_normal((16, n)).astype(np.float32)
    x[0, [7, 4000]] = 9.0  # tie: chunk 0 (thread 0) and chunk 3 (thread 1)
    x[1, [2047, 2048]] = 9.0  # tie across a chunk boundary and the 2-thread split
    x[2, [3001, 3002, 3010]] = 9.0  # ties inside one vector
    x[3, [4990, 5000]] = np.nan  # thread 1's NaNs after thread 0's larger number
    x[3, 10] = 50.0
    x[4] = -np.inf  # nothing beats -inf: id 0
    x[5, [100, 4002]] = np.inf
    x[6] = 0.0
    x[6, :50] = -0.0  # equal to 0.0: the first id
    x[7, 5001] = 20.0  # in the tail past the last full vector
    x[8, [2495, 2496]] = 9.0  # tie inside chunk 2
    x[9, [5, 3000]] = np.nan  # a NaN in each thread's range: the first
    x[9, 6] = np.inf
    x[10, 5002] = 9.0  # the last id
    x[11, [1, 17, 1040]] = np.nan  # NaNs in the first vectors of two chunks
    x[12, [16, 15]] = 9.0  # the first of a tie sits in the vector before the other
    x[13, [4000, 5000]] = 9.0  # a tie between the last chunk's vectors and its tail (ids past 4991)
    x[14, [4995, 5001]] = 9.0  # a tie inside the tail
    x[15] = -1.0
    x[15, [3, 17]] = [0.0, -0.0]  # equal maxima of both signs in two vectors: id 3, its value +0.0
    want = np.argmax(x, 1)
    for isa in ISAS:
        for th in (1, 2):
            ids, vals = K.argmax(x, isa, th)
            np.testing.assert_array_equal(ids, want, err_msg=f"{isa} {th} threads")
            np.testing.assert_array_equal(bits(vals), bits(x[np.arange(len(x)), want]), err_msg=f"{isa} {th} threads")
    K.start_team(2)


def _penalty_rows(rng, q: int, n: int) -> list:
    """Penalty rows as a grammar and a logit bias make them (0 / -inf, plus biases; one row
    allows one id alone, one allows nothing but a NaN-logit id, one is None)."""
    pens = []
    for r in range(q):
        allowed = rng.random(n) < (0.02 if r % 2 else 0.6)
        pen = np.where(allowed, 0.0, -np.inf).astype(np.float32)
        pen[rng.integers(0, n, 40)] += rng.uniform(-100, 100, 40).astype(np.float32)  # logit bias
        pens.append(pen)
    pens[1][:] = -np.inf
    pens[1][4999] = 0.0  # forced: one id alone
    pens[2] = None  # a row without a constraint (after an end of generation)
    return pens


def test_the_argmax_head_with_penalty_rows_is_numpys_argmax_of_the_masked_row():
    """Constrained greedy decoding in the reduced head: with a penalty row (a grammar's
    0 / -inf mask plus a logit bias) a row's token == np.argmax(np.add(row, pen)) (what
    ConstrainedAcceptor makes of a written row), bit for bit: a NaN logit where the mask bans
    the id still ranks highest (NaN + -inf is NaN), a tie between allowed ids goes to the
    first; every ISA path, 1 and 2 threads; rows without a penalty row are plain."""
    rng = np.random.default_rng(11)
    n = 5003
    x = rng.standard_normal((8, n)).astype(np.float32)
    x[3, 77] = np.nan  # banned or not, a NaN is what numpy's argmax of the masked row finds
    x[4, [10, 4000]] = 30.0
    pens = _penalty_rows(rng, len(x), n)
    pens[4][[10, 4000]] = 0.0  # a tie of allowed ids across chunks
    want = np.array([np.argmax(x[r] if p is None else np.add(x[r], p)) for r, p in enumerate(pens)])
    assert want[1] == 4999 and np.isnan(np.add(x[3], pens[3])[want[3]])
    assert (want != x.argmax(1)).sum() >= 5  # the masks change most rows' tokens
    for isa in ISAS:
        for th in (1, 2):
            ids, vals = K.argmax(x, isa, th, pens=pens)
            np.testing.assert_array_equal(ids, want, err_msg=f"{isa} {th} threads")
            masked = np.array([(x[r] if p is None else np.add(x[r], p))[want[r]] for r, p in enumerate(pens)], np.float32)
            np.testing.assert_array_equal(bits(vals), bits(masked), err_msg=f"{isa} {th} threads")
    K.start_team(2)
    with pytest.raises(ValueError, match="need a contiguous float32 row of at least 5003"):
        K.argmax(x, pens=[np.zeros(5002, np.float32)] * len(x))
    with pytest.raises(ValueError, match="pens has 3 entries for 8 rows"):  # C would read past the pointers
        K.argmax(x, pens=pens[:3])


def test_the_reduced_heads_confidence_is_the_softmax_probability():
    """With 1/T > 0 the reduced head gives the first maximum's softmax probability (what a
    greedy draft step reads): numpy's top1 within float32 rounding, the same bits on every ISA
    path and thread count (chunks fixed, sums in a fixed order), NaN where the maximum is not
    finite."""
    from specrt.runtime.speculative import top1

    rng = np.random.default_rng(9)
    x = (rng.standard_normal((6, 70_001)) * 3).astype(np.float32)
    x[1, 12345] = 40.0  # one sure token
    x[2, [5, 69_000]] = 8.0  # a tie across chunks
    x[3, 100:50_000] = -np.inf  # most ids out (a trimmed head's row)
    x[4, 777] = np.nan
    x[5, 3] = np.inf
    for it in (1.0, 0.7):
        got = {}
        for isa in ISAS:
            for th in (1, 2):
                got[isa, th] = K.argmax(x, isa, th, inv_temp=it)
        ids, conf = got[ISAS[0], 1]
        for key, (i2, c2) in got.items():
            np.testing.assert_array_equal(i2, ids, err_msg=str(key))
            np.testing.assert_array_equal(bits(c2), bits(conf), err_msg=str(key))
        np.testing.assert_array_equal(ids, np.argmax(x, 1))
        for r in range(4):
            t, p = top1(x[r], x.shape[1], inv_temp=it)
            assert ids[r] == t and conf[r] == pytest.approx(p, rel=2e-5), (r, it)
        assert np.isnan(conf[4:]).all()
    K.start_team(2)


def test_run_top1_is_the_draft_rows_top1(tiny, tmp_path):
    """A greedy draft step reduced in the kernels (``run_top1``) == top1 of the row ``run``
    writes: the token, and the confidence within float32 rounding; with a trimmed head too
    (the token mapped back to the vocabulary's id; ids past the tokenizer's never chosen)."""
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.errors import InputError, NumericsError
    from specrt.runtime.kernels.weights import KernelWeights
    from specrt.runtime.speculative import top1

    g, _, weights = tiny
    ids = np.sort(np.random.default_rng(5).choice(np.arange(1, 512), 64, replace=False)).astype(np.int32)  # id 0 cut: a vocab below every kept id
    cut = write_panels(g, tmp_path, "cut", log=lambda *_: None, requant=R.Q4_0, head_ids=ids)
    for m in (model(weights()), model(KernelWeights(tmp_path / "cut.panels", cut, 256, 64))):
        ref = model(m.w)
        rows = ref.run(PROMPT, 0).copy()
        m.run_rows(PROMPT, 0, len(PROMPT))  # the KV rows each call below reads (no row projected)
        for vocab, it in ((512, 1.0), (500, 0.8), (int(ids[40]), 1.0)):
            for hi in (1, 3, 20, 40):
                lo = max(0, hi - 5)
                t, c = m.run_top1(PROMPT[lo:hi], lo, vocab, it)
                want = top1(rows[hi - 1], vocab, inv_temp=it)
                assert t == want[0] and c == pytest.approx(want[1], rel=2e-5), (vocab, hi)
        assert np.array_equal(m.k, ref.k)
    with pytest.raises(InputError, match="inv_temp"):
        m.run_top1([1], 0, 512, 0.0)
    with pytest.raises(InputError, match="no id of this model's head is below it"):
        m.run_top1([1], 0, int(ids[0]), 1.0)
    # the cut head is Q4_0 (8-bit activations per 32): a NaN there is not quantized as a 0 either
    keep, nan = m.w.model.out_norm, np.full(int(m.w.dims["n_embd"]), np.nan, np.float32)
    try:
        m.w.model.out_norm = nan.ctypes.data
        assert np.isnan(m.run(PROMPT[:3], 0)[:, ids]).all()
        with pytest.raises(NumericsError, match="non-finite"):
            m.run_top1(PROMPT[:3], 0, 512, 1.0)
    finally:
        m.w.model.out_norm = keep


def test_run_argmax_is_the_argmax_of_run(tiny):
    """What greedy verification reads: each row's token from the argmax head == np.argmax of
    the row ``run`` writes, over the ids asked, at every verification width after a past,
    every ISA path, 1 and 2 threads; the KV rows as ``run`` writes them. A NaN hidden state
    gives NaN logits (never a token as if it were 0), reported by both reduced heads."""
    from specrt.runtime.errors import InputError, NumericsError

    _, _, weights = tiny
    w = weights()
    base = model(w, "portable").run(PROMPT, 0).copy()
    for isa in ISAS:
        for th in (1, 2):
            K.start_team(th)
            m, ref = model(w, isa), model(w, isa)
            ids = m.run_argmax(PROMPT[:30], 0, 512)
            np.testing.assert_array_equal(ids, base[:30].argmax(1), err_msg=f"{isa} {th} prefill")
            for n_valid in (512, 301):
                for q in range(1, K_MAX + 2):
                    got = m.run_argmax(PROMPT[30 : 30 + q], 30, n_valid)
                    np.testing.assert_array_equal(got, base[30 : 30 + q, :n_valid].argmax(1), err_msg=f"{isa} {th} q={q} n_valid={n_valid}")
            ref.run(PROMPT[: 30 + K_MAX + 1], 0)
            assert np.array_equal(m.k, ref.k) and np.array_equal(m.v, ref.v)
    K.start_team(2)
    with pytest.raises(InputError, match="n_valid=513; it must be in 1..512"):
        m.run_argmax([1], 0, 513)
    # with penalty rows (constrained greedy verification): np.argmax of the masked row, every width
    rng = np.random.default_rng(3)
    for n_valid in (512, 301):
        for q in range(1, K_MAX + 2):
            pens = [np.where(rng.random(n_valid) < 0.1, 0.0, -np.inf).astype(np.float32) for _ in range(q)]
            pens[0] = None if q > 1 else pens[0]
            rows = base[30 : 30 + q, :n_valid]
            want = [np.argmax(r if p is None else np.add(r, p)) for r, p in zip(rows, pens)]
            np.testing.assert_array_equal(m.run_argmax(PROMPT[30 : 30 + q], 30, n_valid, pens), want, err_msg=f"q={q} n_valid={n_valid}")
    with pytest.raises(InputError, match="pens has 1 rows for a call of 2"):
        m.run_argmax([1, 2], 0, 512, [None])
    # a NaN maximum is reported (-1: the greedy acceptor refuses it), never a token
    keep = w.model.out_norm
    nan = np.full(int(w.dims["n_embd"]), np.nan, np.float32)
    try:
        w.model.out_norm = nan.ctypes.data
        assert np.isnan(m.run(PROMPT[:3], 0)).all()  # a NaN activation is not quantized as a 0
        np.testing.assert_array_equal(m.run_argmax(PROMPT[:3], 0, 512), [-1, -1, -1])
        with pytest.raises(NumericsError, match="non-finite"):
            m.run_top1(PROMPT[:3], 0, 512, 1.0)
    finally:
        w.model.out_norm = keep
    np.testing.assert_array_equal(m.run_argmax(PROMPT[:3], 0, 512), base[:3].argmax(1))


def test_unsupported_files_write_no_panels(tmp_path):
    from specrt.export.kernel_pack import kernels_unsupported, write_panels

    g = R.write_gguf(tmp_path / "m.gguf", "qwen2", strings={"rope.scaling.type": "yarn"})
    lines: list[str] = []
    assert write_panels(g, tmp_path, "target", log=lines.append) is None
    assert "rope scaling 'yarn'" in lines[-1] and not (tmp_path / "target.panels").exists()
    assert kernels_unsupported(R.write_gguf(tmp_path / "ok.gguf", "llama")) is None


# ---------------------------------------------------------------- a real file: SmolLM2-135M Q4_1


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    import os

    from specrt.export.fetch import fetch
    from specrt.runtime.errors import ExportError

    try:
        return fetch("smollm2-135m-instruct-q4_1", log=lambda *_: None)
    except ExportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot fetch the SmolLM2 GGUF here: {e}")


def test_real_file_logits_match_pytorch(smol, tmp_path_factory):
    """SmolLM2-135M (llama, Q4_1 layers, Q8_0 tied embeddings): the kernels' logits against
    PyTorch float32 on the GGUF's converted folder (transformers' own conversion)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.export.gguf_import import checkpoint_folder
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.kernels.weights import KernelWeights

    out = tmp_path_factory.mktemp("smol_kern")
    rec = write_panels(smol, out, "target", log=lambda *_: None)
    folder, _ = checkpoint_folder(smol, "target", out / "hf", log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits[0].numpy().astype(np.float64)
    K.start_team(2)
    got = model(KernelWeights(out / "target.panels", rec, 256, 64)).run(ids[0].tolist(), 0)[:, : ref.shape[1]]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05  # 8-bit activations, as llama.cpp
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9


def test_qwen3_logits_match_pytorch(tmp_path):
    """qwen3 (per-head q/k RMSNorm before RoPE, head_dim 128 != n_embd / n_head): the kernels'
    logits against transformers' Qwen3ForCausalLM in float32 on the same dequantized weights
    (GGUF names mapped to Hugging Face's; NEOX RoPE, so no q/k permutation)."""
    torch = pytest.importorskip("torch")
    import gguf
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.kernels.weights import KernelWeights

    d = {**R.DIMS, "head_dim": 128}
    g = R.write_gguf(tmp_path / "q3.gguf", "qwen3", dims=d)
    rec = write_panels(g, tmp_path, "target", log=lambda *_: None)
    assert rec is not None and rec["dims"]["head_dim"] == 128 and "blk.1.attn_k_norm" in rec["tensors"]
    cfg = Qwen3Config(
        vocab_size=d["n_vocab"], hidden_size=d["n_embd"], intermediate_size=d["n_ff"], num_hidden_layers=d["n_layer"],
        num_attention_heads=d["n_head"], num_key_value_heads=d["n_head_kv"], head_dim=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
    )  # fmt: skip
    hf = Qwen3ForCausalLM(cfg).float().eval()
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # fmt: skip
    state = {}
    for t in gguf.GGUFReader(str(g)).tensors:
        ty, shape = int(t.tensor_type), [int(s) for s in reversed(t.shape) if len(t.shape) > 1] or [int(t.shape[0])]
        w = np.array(t.data, np.float32).reshape(shape) if ty == 0 else R.dequant(np.asarray(t.data).view(np.uint8), ty, *shape)
        parts = t.name.split(".")
        key = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}.get(parts[0])
        state[(key or f"model.layers.{parts[1]}.{names[parts[2]]}") + ".weight"] = torch.from_numpy(np.ascontiguousarray(w))
    missing = hf.load_state_dict(state, strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy().astype(np.float64)
    got = model(KernelWeights(tmp_path / "target.panels", rec, 256, 64)).run(PROMPT, 0)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.02  # 8-bit activations, as llama.cpp
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9
    # without the q/k norms it is another model: the check sees it
    bare = {k: v for k, v in rec["tensors"].items() if "_norm" not in k or k.endswith(("attn_norm", "ffn_norm")) or k == "output_norm"}
    assert set(rec["tensors"]) - set(bare) == {f"blk.{i}.attn_{c}_norm" for i in range(2) for c in "qk"}
    from specrt.runtime.kernels.weights import check_record

    assert "attn_q_norm is missing" in check_record({**rec, "tensors": bare}, (tmp_path / "target.panels").stat().st_size)


def test_a_trimmed_draft_head_gives_the_full_heads_logits_at_its_ids(tiny, tmp_path):
    """A draft's panels: every matrix quantized again (Q4_0), the LM head cut to some ids
    (FR-Spec). Each kept id's logit is the full head's, bit for bit; the others read -inf."""
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.kernels.weights import KernelWeights

    g, _, _ = tiny
    ids = np.sort(np.random.default_rng(5).choice(512, 64, replace=False)).astype(np.int32)
    full = write_panels(g, tmp_path, "full", log=lambda *_: None, requant=R.Q4_0)
    cut = write_panels(g, tmp_path, "cut", log=lambda *_: None, requant=R.Q4_0, head_ids=ids)
    assert cut["head"] == {"ids": 64, "of": 512} and cut["requantized"]["type"] == "Q4_0"
    assert cut["tensors"]["output"]["n"] == 64 and cut["tensors"]["blk.0.ffn_down"]["type"] == R.Q4_0
    assert cut["tensors"]["token_embd"]["type"] == full["tensors"]["token_embd"]["type"] == R.Q8_0  # rows looked up, kept
    a = model(KernelWeights(tmp_path / "full.panels", full, 256, 64)).run(PROMPT, 0).copy()
    m = model(KernelWeights(tmp_path / "cut.panels", cut, 256, 64))
    b = m.run(PROMPT, 0)
    np.testing.assert_array_equal(bits(b[:, ids]), bits(a[:, ids]))
    rest = np.setdiff1d(np.arange(512), ids)
    assert np.isneginf(b[:, rest]).all()
    m.release_logits(0)  # released rows read zeros until the next call fills them again
    np.testing.assert_array_equal(bits(m.run(PROMPT[:5], 0)[:, ids]), bits(a[:5, ids]))
    assert np.isneginf(m.logits[:5, rest]).all()
    assert not m.argmax_head  # a cut head's ids are not the vocabulary's: verification reads its rows
    with pytest.raises(RuntimeError, match="head is trimmed"):
        m.run_argmax(PROMPT[:2], 0, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        write_panels(g, tmp_path, "bad", log=lambda *_: None, head_ids=ids[:10])
    with pytest.raises(ValueError, match="ascending, each once"):  # the reduced head's id order relies on it
        write_panels(g, tmp_path, "bad", log=lambda *_: None, head_ids=ids[::-1].copy())
