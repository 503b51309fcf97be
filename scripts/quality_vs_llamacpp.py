"""An engine's target against llama.cpp's own logits on the same GGUF file (top-1 agreement,
loss), teacher-forced on the held-out stdlib text (:mod:`specrt.runtime.lab.quality`).

llama.cpp runs in its own venv (``--llama-python``, e.g. ``.venv-llamacpp/bin/python`` of
``make bench-envs``) through ``bench/workers/llamacpp_logits.py``; the engine runs
in this one, on the engine's own model class and call widths. Both see the same token ids
(the engine's tokenizer, which the export checked against the GGUF's). Figures: top-1
agreement over all scored positions and over the positions where llama.cpp's top-1 leads
its top-2 by more than ``--margin`` (near-ties are where two correct implementations of the
same weights may disagree), the loss of both and its change, and the export-time record
against the dequantized fp32 model (``extra.quality``) beside it.

    python scripts/quality_vs_llamacpp.py --engines engines/qwen2.5-coder \\
        --gguf ~/.cache/specrt/real-pair/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --llama-python .venv-llamacpp/bin/python --windows 32 --out docs/bench/quality_vs_llamacpp.json

The engine's target runs on the backend the folder loads with (``--backend`` to name one:
``kernels``, specrt's CPU kernels, or ``ort-cpu``, the ONNX graph). ``--llama-pythonpath`` and
``--llama-lib`` run the worker on an unpacked llama-cpp-python source over a separately built
libllama (the sdist's ``llama_cpp`` package and the folder holding ``libllama.so``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specrt.bench.common import write_json
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.lab.quality import Scores, compare, encode_texts, heldout_windows, score_model, stdlib_heldout_texts
from specrt.runtime.manifest import load_manifest

WORKER = Path(__file__).resolve().parents[1] / "bench" / "workers" / "llamacpp_logits.py"


def llama_scores(python: str, gguf: str, seqs: list, first: list, threads: int, env: dict | None = None) -> tuple[Scores, np.ndarray]:
    """llama.cpp's :class:`Scores` of ``seqs`` (and its top-1 - top-2 margins); ``env``: the
    worker's environment (e.g. ``PYTHONPATH`` / ``LLAMA_CPP_LIB_PATH`` for an unpacked
    llama-cpp-python over a separately built libllama), None = this one's."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.json", Path(d) / "out.npz"
        src.write_text(json.dumps({"gguf": gguf, "threads": threads, "seqs": seqs, "first": first}))
        p = subprocess.run([python, str(WORKER), str(src), str(dst)], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise SystemExit(f"llama.cpp worker failed: {(p.stdout + p.stderr)[-600:]}")
        z = np.load(dst)
        return Scores(z["argmax"], z["logprob"]), z["margin"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", required=True, help="engine folder exported from --gguf")
    ap.add_argument("--gguf", required=True, help="the GGUF file the target was exported from")
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--margin", type=float, default=0.1, help="logit lead below which a position counts as a near-tie")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default=None, help="the engine's backend (default: the folder's own choice)")
    ap.add_argument("--llama-pythonpath", default=None, help="PYTHONPATH for the worker (an unpacked llama-cpp-python source)")
    ap.add_argument("--llama-lib", default=None, help="LLAMA_CPP_LIB_PATH for the worker (the folder of a built libllama.so)")
    ap.add_argument("--out", default=None, help="JSON record")
    a = ap.parse_args(argv)
    t0 = time.time()
    folder = Path(a.engines)
    m = load_manifest(folder)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / m.tokenizer_file))
    data = encode_texts(lambda t: tok.encode(t, add_special_tokens=False).ids, stdlib_heldout_texts(), m.eos_token_id)
    wins = heldout_windows(data, a.windows, min(a.window, m.max_ctx - 1)).tolist()
    first = [0] * len(wins)
    env = None
    if a.llama_pythonpath or a.llama_lib:
        import os

        env = dict(
            os.environ, **({"PYTHONPATH": a.llama_pythonpath} if a.llama_pythonpath else {}), **({"LLAMA_CPP_LIB_PATH": a.llama_lib} if a.llama_lib else {})
        )
    ref, margin = llama_scores(a.llama_python, a.gguf, wins, first, a.threads, env)
    from specrt import Engine

    engine = Engine(folder, threads=ThreadConfig(a.threads), backend=a.backend, prefix_cache=False)
    got = score_model(engine.target, wins, first, m.vocab_size, engine.min_q)
    clear = margin > a.margin
    rec = dict(
        engines=str(folder),
        backend=engine.backend,
        gguf=str(a.gguf),
        set=dict(name="held-out stdlib text", windows=len(wins), window=len(wins[0]) - 1),
        vs_llama_cpp=dict(
            compare(ref, got),
            top1_agreement_clear=float((ref.argmax[clear] == got.argmax[clear]).mean()),
            clear_positions=int(clear.sum()),
            margin=a.margin,
        ),
        vs_fp32_at_export=m.extra.get("quality"),
        seconds=round(time.time() - t0, 1),
    )
    v = rec["vs_llama_cpp"]
    print(
        f"{folder.name} target vs llama.cpp on {a.gguf}: top-1 agreement {v['top1_agreement']:.4f} over {v['positions']} positions "
        f"({v['top1_agreement_clear']:.4f} where llama.cpp's lead > {a.margin}), loss {v['loss']:.4f} vs {v['loss_reference']:.4f}"
    )
    if a.out:
        write_json(a.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
