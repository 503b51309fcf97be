"""llama.cpp's own scores of token sequences, for the quality comparison against a GGUF file.

Runs inside llama-cpp-python's venv (``.venv-llamacpp``), not specrt's: ``python
llamacpp_logits.py IN.json OUT.npz``. ``IN.json``: ``{"gguf": path, "threads": T,
"seqs": [[ids], ...], "first": [k, ...]}``. Each sequence is decoded in one
``llama_decode`` call from an empty KV cache with logits for every position (llama-cpp-python
0.3.36's low-level API, the vendored llama.cpp's CPU kernels); position t predicts token
t + 1, scored from position ``first[i]`` on. ``OUT.npz``: ``argmax`` int64, ``logprob``
float64 (log-softmax of the true next token, over the first ``n_vocab`` logits) and
``margin`` float32 (top-1 minus top-2 logit) for every scored position, sequences
concatenated in order, and ``n_vocab``.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(src: str, dst: str) -> None:
    """Score the sequences of the JSON file ``src`` with llama.cpp; write the ``.npz`` ``dst``
    (argmax, logprob, margin per scored position, n_vocab: see the module's docstring) and print
    ``{"positions", "n_vocab"}``. Raises ``SystemExit`` when the model cannot load or decode."""
    import llama_cpp as L

    a = json.loads(open(src).read())
    seqs, first = a["seqs"], a["first"]
    longest = max(len(s) for s in seqs)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(a["gguf"].encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp cannot load {a['gguf']}")
    cp = L.llama_context_default_params()
    cp.n_ctx = max(512, longest + 8)
    cp.n_batch = cp.n_ubatch = max(512, longest)
    cp.n_threads = cp.n_threads_batch = int(a["threads"])
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp cannot make a context")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(longest, 0, 1)
    arg, lp, margin = [], [], []
    for seq, f in zip(seqs, first):
        L.llama_memory_clear(mem, True)
        n = len(seq) - 1  # the last token is only predicted
        batch.n_tokens = n
        for i, t in enumerate(seq[:n]):
            batch.token[i] = int(t)
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        rows = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, n_vocab))[f:].astype(np.float64)
        nxt = np.asarray(seq[f + 1 :], np.int64)
        m = rows.max(-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(rows - m).sum(-1))
        top2 = np.partition(rows, -2, axis=-1)[:, -2:]
        arg.append(rows.argmax(-1))
        lp.append(rows[np.arange(len(rows)), nxt] - lse)
        margin.append((top2[:, 1] - top2[:, 0]).astype(np.float32))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    np.savez(dst, argmax=np.concatenate(arg), logprob=np.concatenate(lp), margin=np.concatenate(margin), n_vocab=n_vocab)
    print(json.dumps({"positions": int(sum(len(x) for x in arg)), "n_vocab": int(n_vocab)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
