"""Test fixtures for specrt's kernels: small GGUF files with random blocks of every type the
kernels run, and an independent numpy reference of the kernels' decoder step.

The reference computes in float64 from ``gguf.dequantize`` of the file's blocks, with the
activations quantized as llama.cpp does (Q8_K per 256 for K-quant weights, Q8_0 per 32
otherwise) and the KV rows rounded to f16: the kernels' numerics, so the two agree to float
rounding (not bit for bit: the kernels accumulate in float32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23
K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)  # 256-blocks: Q8_K activations
FLOATS = (F32, F16, BF16)  # float weights: the float activations themselves
BLOCK = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, IQ4_NL: 32, **{t: 256 for t in K_QUANTS}, **dict.fromkeys(FLOATS, 1)}
# random-byte blocks: (block bytes, offsets and values of their f16 scales as multiples of `scale`)
# chosen so that the dequantized values are about `scale` in magnitude and centred on 0
RANDOM_BLOCKS = {
    Q2_K: (84, ((80, 1 / 12), (82, 1.5 / 12))),  # d sc q - dmin m: q ~ 1.5, sc ~ m ~ 7.5
    Q3_K: (110, ((108, 1 / 40),)),  # d (s - 32) v: |s - 32| ~ 16, |v| ~ 2
    Q4_K: (144, ((0, 1 / 500), (2, 7.5 / 500))),  # d sc q - dmin m with q ~ 7.5, sc ~ m ~ 31.5
    Q5_K: (176, ((0, 1 / 1000), (2, 15.5 / 1000))),  # q ~ 15.5
    Q6_K: (210, ((208, 1 / 2000),)),
    IQ4_NL: (18, ((0, 1 / 60),)),  # d kv, |kv| ~ 60
    IQ4_XS: (136, ((0, 1 / 1000),)),  # d (ls - 32) kv
}


def f16(x: float) -> np.ndarray:
    return np.array([x], np.float16).view(np.uint8)


def random_tensor(rng, ggml_type: int, n: int, k: int, scale: float = 0.05) -> np.ndarray:
    """uint8 ``[n, row bytes]`` of valid random blocks of ``ggml_type`` whose values are
    about ``scale`` in magnitude (K-quants and IQ4: random bytes with sane fp16 scales; the
    others quantized by gguf-py from random floats)."""
    import gguf
    from gguf.quants import quantize

    if ggml_type in RANDOM_BLOCKS:
        nbytes, scales = RANDOM_BLOCKS[ggml_type]
        b = rng.integers(0, 256, (n, k // BLOCK[ggml_type], nbytes), dtype=np.uint8)
        for j, v in scales:
            b[..., j : j + 2] = f16(scale * v)
        return b.reshape(n, -1)
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    if ggml_type == F32:
        return w.view(np.uint8)
    if ggml_type == F16:
        return w.astype(np.float16).view(np.uint8)
    return quantize(w, gguf.GGMLQuantizationType(ggml_type))


def dequant(raw: np.ndarray, ggml_type: int, n: int, k: int) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize

    if ggml_type in (F32, F16):  # gguf.dequantize passes these through as their own dtype
        return np.ascontiguousarray(raw).view(np.float32 if ggml_type == F32 else np.float16).astype(np.float32).reshape(n, k)
    return dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).reshape(n, k)


# ---------------------------------------------------------------- activations, as the kernels quantize them (c/quant.h)


def q8k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """llama.cpp Q8_K of float32 rows ``x [r, k]``: int values and one float32 scale per 256."""
    x = np.asarray(x, np.float32)
    r, k = x.shape
    xb = x.reshape(r, k // 256, 256)
    j = np.abs(xb).argmax(-1)
    mx = np.take_along_axis(xb, j[..., None], -1)[..., 0]
    with np.errstate(divide="ignore"):
        isc = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
    q = np.minimum(np.rint((isc[..., None] * xb).astype(np.float32)), 127).astype(np.int64)
    with np.errstate(divide="ignore"):
        d = np.where(isc == 0, np.float32(0), np.float32(1.0) / isc).astype(np.float32)
    return q.reshape(r, k), d, 256


def q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """llama.cpp Q8_0 of float32 rows: per 32, d = amax / 127 kept as f16."""
    x = np.asarray(x, np.float32)
    r, k = x.shape
    xb = x.reshape(r, k // 32, 32)
    amax = np.abs(xb).max(-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        idd = np.where(d == 0, np.float32(0), np.float32(1.0) / d).astype(np.float32)
    q = np.rint((xb * idd[..., None]).astype(np.float32)).astype(np.int64)
    return q.reshape(r, k), d.astype(np.float16).astype(np.float32), 32


def matmul_ref(x: np.ndarray, w: np.ndarray, ggml_type: int) -> np.ndarray:
    """float64 ``[r, n]``: rows ``x`` quantized as the kernels quantize them for a matrix of
    ``ggml_type``, times the dequantized ``w [n, k]`` (float64 sums)."""
    if ggml_type in FLOATS:  # float weights read the float activations themselves
        return np.asarray(x, np.float64) @ w.astype(np.float64).T
    q, d, blk = (q8k if ggml_type in K_QUANTS else q8_0)(x)
    r, k = q.shape
    qb = q.reshape(r, k // blk, blk).astype(np.float64)
    wb = w.astype(np.float64).reshape(w.shape[0], k // blk, blk)
    return np.einsum("rbi,nbi,rb->rn", qb, wb, d.astype(np.float64))


# ---------------------------------------------------------------- a small GGUF decoder

DIMS = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512)


def byte_vocab(n: int, tag: str = "") -> dict:
    """Tokenizer metadata of a byte-level BPE vocabulary of ``n`` ids for :func:`write_gguf`:
    the 256 byte symbols, merges of the pairs of the first 8 letters (their tokens follow),
    ``<|endoftext|>`` (a CONTROL token, BOS and EOS) and filler tokens named ``<tag fill i>``
    (a different ``tag`` makes a different vocabulary of the same size)."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    letters = list("abcdefgh")
    merges = [f"{a} {b}" for a in letters for b in letters]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    eot = len(tokens) - 1
    tokens += [f"<{tag}fill {i}>" for i in range(n - len(tokens))]
    types = [1] * len(tokens)
    types[eot] = 3
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "types": types, "merges": merges, "eos": eot, "bos": eot}


def write_gguf(
    path: Path,
    arch: str = "qwen2",
    seed: int = 0,
    types: dict | None = None,
    dims: dict | None = None,
    strings: dict | None = None,
    vocab: dict | None = None,
    embd_scale: float = 1.0,
    floats: dict | None = None,
) -> Path:
    """A decoder of ``arch`` (``qwen2``: q/k/v biases, NEOX RoPE; ``qwen3``: per-head q/k
    RMSNorm, NEOX RoPE, no biases; ``llama``: NORM RoPE, no biases; ``gemma2``: GeGLU, post
    norms, soft-caps 1.5 (scores) and 20 (logits), a head tied to the embedding, layer 0 sliding
    over 16 positions; ``gemma3``: gemma2's without soft-caps, with q/k norms, global RoPE base
    10^6, sliding layers 0 and 1 of 3 (10^4)) with random weights, written with gguf-py. ``types`` maps tensor kinds
    (``attn``, ``attn_v``, ``ffn``, ``ffn_down``, ``embd``, ``output``) to ggml types; the
    defaults mix Q4_K, Q6_K, Q8_0 and Q4_1 as llama.cpp's Q4_K_M does. ``strings``: more
    string metadata (``{key: value}``, the key without the architecture prefix). ``vocab``:
    tokenizer metadata (:func:`byte_vocab`), written as llama.cpp's ``tokenizer.ggml.*``
    keys with a chat template. ``embd_scale``: the token rows' magnitude (gemma scales them by
    sqrt(n_embd) and ties its head to them: 1 / 16 keeps a gemma model from repeating its input).
    ``floats``: more float32 metadata (e.g. ``{"rope.scaling.factor": 8.0}``)."""
    import gguf

    d = {**DIMS, **({"n_layer": 3} if arch == "gemma3" else {}), **(dims or {})}
    t = {"attn": Q4_K, "attn_v": Q6_K, "ffn": Q4_K, "ffn_down": Q6_K, "embd": Q8_0, "output": Q6_K, **(types or {})}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(d["n_layer"])
    w.add_context_length(d.get("n_ctx", 4096))
    w.add_embedding_length(d["n_embd"])
    w.add_feed_forward_length(d["n_ff"])
    w.add_head_count(d["n_head"])
    w.add_head_count_kv(d["n_head_kv"])
    gemma = arch in ("gemma2", "gemma3")
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if gemma:
        w.add_sliding_window(16)  # a 40-token prompt slides past it
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(1.5)  # small: the caps bite on these random weights
        w.add_final_logit_softcapping(20.0)
    if arch == "gemma3":
        w.add_uint32("gemma3.attention.sliding_window_pattern", 3)
    if d["head_dim"] != d["n_embd"] // d["n_head"] and not gemma:  # llama.cpp's default is n_embd / n_head
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
    for key, value in (strings or {}).items():
        w.add_string(f"{arch}.{key}", value)
    for key, value in (floats or {}).items():
        w.add_float32(f"{arch}.{key}", value)
    if vocab is not None:
        w.add_tokenizer_model(vocab["model"])
        w.add_tokenizer_pre(vocab["pre"])
        w.add_token_list(vocab["tokens"])
        w.add_token_types(vocab["types"])
        w.add_token_merges(vocab["merges"])
        w.add_bos_token_id(vocab["bos"])
        w.add_eos_token_id(vocab["eos"])
        w.add_add_bos_token(False)
        w.add_chat_template(
            "{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}"
        )
    E, F, V, qd, kd = d["n_embd"], d["n_ff"], d["n_vocab"], d["n_head"] * d["head_dim"], d["n_head_kv"] * d["head_dim"]

    def add(name, ty, n, k, scale=0.05):
        w.add_tensor(name, random_tensor(rng, ty, n, k, scale), raw_dtype=gguf.GGMLQuantizationType(ty))

    def f32(name, v):
        w.add_tensor(name, np.asarray(v, np.float32))

    add("token_embd.weight", t["embd"], V, E, embd_scale)
    f32("output_norm.weight", 1 + 0.1 * rng.standard_normal(E))
    if arch != "gemma2":  # gemma2's head is its embedding
        add("output.weight", t["output"], V, E, 0.1)
    for i in range(d["n_layer"]):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(E))
        f32(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(E))
        add(p + "attn_q.weight", t["attn"], qd, E, 0.1)
        add(p + "attn_k.weight", t["attn"], kd, E, 0.1)
        add(p + "attn_v.weight", t["attn_v"], kd, E)
        add(p + "attn_output.weight", t["attn"], E, qd)
        add(p + "ffn_gate.weight", t["ffn"], F, E)
        add(p + "ffn_up.weight", t["ffn"], F, E)
        add(p + "ffn_down.weight", t["ffn_down"], E, F)
        if arch == "qwen2":
            for name, n in (("attn_q.bias", qd), ("attn_k.bias", kd), ("attn_v.bias", kd)):
                f32(p + name, 0.1 * rng.standard_normal(n))
        if gemma:  # RMSNorm of each block's output before its residual add
            for name in ("post_attention_norm.weight", "post_ffw_norm.weight"):
                f32(p + name, 1 + 0.3 * rng.standard_normal(E))
        if arch in ("qwen3", "gemma3"):  # per-head RMSNorm of q and k before RoPE
            for name in ("attn_q_norm.weight", "attn_k_norm.weight"):
                f32(p + name, 1 + 0.3 * rng.standard_normal(d["head_dim"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def reference_step(gguf_path: Path, tokens: list[int], rope_neox: bool) -> np.ndarray:
    """float64 logits ``[len(tokens), n_vocab]`` of the decoder in ``gguf_path`` run over
    ``tokens`` from position 0, by the kernels' math in numpy (module docstring)."""
    import gguf

    from specrt.runtime.kernels.weights import rope_tables

    r = gguf.GGUFReader(str(gguf_path))
    T = {x.name: x for x in r.tensors}
    arch = r.fields["general.architecture"].contents()
    g = lambda k: r.fields[f"{arch}.{k}"].contents()  # noqa: E731
    L, E, H, KV = g("block_count"), g("embedding_length"), g("attention.head_count"), g("attention.head_count_kv")
    hd = r.fields[f"{arch}.attention.key_length"].contents() if f"{arch}.attention.key_length" in r.fields else E // H
    eps = g("attention.layer_norm_rms_epsilon")
    f = lambda k, default: r.fields[f"{arch}.{k}"].contents() if f"{arch}.{k}" in r.fields else default  # noqa: E731
    gemma = arch in ("gemma2", "gemma3")
    # gemma (llama.cpp's defaults written out here, independently of specrt's reading of them):
    # layer i slides over `window` positions unless i % pattern == pattern - 1
    window, pattern = f("attention.sliding_window", 0), f("attention.sliding_window_pattern", {"gemma2": 2, "gemma3": 6}.get(arch, 1))
    slides = [gemma and window > 0 and i % pattern < pattern - 1 for i in range(L)]
    attn_cap = f("attn_logit_softcapping", 50.0) if arch == "gemma2" else 0.0
    final_cap = f("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0) if gemma else 0.0

    def W(name):
        x = T[name]
        if int(x.tensor_type) == 0:
            return np.asarray(x.data, np.float64), 0
        n, k = int(x.shape[1]), int(x.shape[0])
        return dequant(np.asarray(x.data).view(np.uint8), int(x.tensor_type), n, k), int(x.tensor_type)

    def mm(x, name):
        w, ty = W(name)
        return matmul_ref(x.astype(np.float32), w, ty)

    def norm(x, name):
        w = W(name)[0]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    n = len(tokens)
    # linear RoPE scaling (positions / factor) on every layer but gemma3's sliding ones
    factor = f("rope.scaling.factor", 1.0)
    tables = {(b, s): [a.astype(np.float64) for a in rope_tables(n, hd, b, np.full(hd // 2, s))] for b in (g("rope.freq_base"), 10000.0) for s in (1.0, factor)}

    def rope(v, base):  # v [n, heads, hd]; base: (theta, factor)
        cos, sin = tables[base]
        c, s = cos[:, None, :], sin[:, None, :]
        if rope_neox:
            a, b = v[..., : hd // 2], v[..., hd // 2 :]
            return np.concatenate([a * c - b * s, a * s + b * c], -1)
        a, b = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def cap(x, c):
        return c * np.tanh(x / c) if c else x

    emb, _ = W("token_embd.weight")
    x = emb[tokens].astype(np.float64) * (np.float32(np.sqrt(E)) if gemma else 1.0)
    mask = np.triu(np.full((n, n), -np.inf), 1)
    pos = np.arange(n)
    swa_mask = np.where(pos[:, None] - pos[None, :] >= window, -np.inf, 0.0) + mask
    for i in range(L):
        p = f"blk.{i}."
        xn = norm(x, p + "attn_norm.weight")
        q, k, v = (mm(xn, p + f"attn_{c}.weight") for c in "qkv")
        if p + "attn_q.bias" in T:
            q, k, v = q + W(p + "attn_q.bias")[0], k + W(p + "attn_k.bias")[0], v + W(p + "attn_v.bias")[0]
        q, k = q.reshape(n, H, hd), k.reshape(n, KV, hd)
        if p + "attn_q_norm.weight" in T:  # qwen3: each head RMS-normalized before RoPE
            q, k = norm(q, p + "attn_q_norm.weight"), norm(k, p + "attn_k_norm.weight")
        base = (10000.0, 1.0) if arch == "gemma3" and slides[i] else (g("rope.freq_base"), factor)
        q = rope(q, base)
        k = rope(k, base).astype(np.float16).astype(np.float64)
        v = v.reshape(n, KV, hd).astype(np.float16).astype(np.float64)
        rep = H // KV
        k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
        s = cap(np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd), attn_cap) + (swa_mask if slides[i] else mask)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", s, v).reshape(n, H * hd)
        o = mm(att, p + "attn_output.weight")
        x = x + (norm(o, p + "post_attention_norm.weight") if gemma else o)
        xn = norm(x, p + "ffn_norm.weight")
        gt, up = mm(xn, p + "ffn_gate.weight"), mm(xn, p + "ffn_up.weight")
        act = 0.5 * gt * (1 + np.tanh(np.sqrt(2 / np.pi) * (gt + 0.044715 * gt**3))) if gemma else gt / (1 + np.exp(-gt))
        o = mm(act * up, p + "ffn_down.weight")
        x = x + (norm(o, p + "post_ffw_norm.weight") if gemma else o)
    return cap(mm(norm(x, "output_norm.weight"), "output.weight" if "output.weight" in T else "token_embd.weight"), final_cap)
