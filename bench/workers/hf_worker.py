"""Benchmark worker: Hugging Face transformers on PyTorch (the main venv: torch 2.13, transformers 5).

Variants (``init["variant"]["kind"]``):

- ``generate``: ``model.generate(do_sample=False)`` on the target alone;
- ``assisted``: ``generate(assistant_model=draft, do_sample=False)``. The draft length and
  confidence threshold are read by transformers from the *assistant's* generation config
  (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
  ``assistant_confidence_threshold``; transformers 5 defaults 20, "constant", 0.4), so the
  variant sets them there; keys missing from the variant keep the library defaults. They
  are reset before every call, so no state (the "heuristic" schedule, the sklearn-based
  threshold adaptation) carries over from one prompt to the next.

Time to first token is the arrival of the first generated token at a streamer.
"""

from __future__ import annotations

import time

try:  # imported as specrt.bench.workers.hf_worker (the harness, the tests)
    from ._protocol import FirstTokenClock, serve, set_thread_env
except ImportError:  # run as a file by a venv's python: Python puts this folder first on sys.path
    from _protocol import FirstTokenClock, serve, set_thread_env

ASSIST_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def setup(init: dict):
    """The protocol's setup: load the transformers model(s) of ``init`` and warm up; returns (generate, info, extra ops)."""
    threads = int(init["threads"])
    set_thread_env(threads)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_sklearn_available

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    v = init["variant"]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(init["target"], dtype=torch.float32).eval()
    draft = None
    if v["kind"] == "assisted":
        draft = AutoModelForCausalLM.from_pretrained(init["draft"], dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    defaults = {}
    if draft is not None:
        gd = draft.generation_config._get_default_generation_params() if hasattr(draft.generation_config, "_get_default_generation_params") else {}
        for k in ASSIST_KEYS:
            val = getattr(draft.generation_config, k, None)
            defaults[k] = val if val is not None else gd.get(k)
    settings = {k: v.get(k, defaults.get(k)) for k in ASSIST_KEYS} if draft is not None else {}
    clock = time.perf_counter

    def generate(ids, max_new_tokens):
        if draft is not None:
            for k, val in settings.items():
                setattr(draft.generation_config, k, val)
        streamer = FirstTokenClock(clock)
        x = torch.tensor([ids], dtype=torch.long)
        t = clock()
        with torch.inference_mode():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                assistant_model=draft,
                streamer=streamer,
            )
        seconds = clock() - t
        tokens = out[0, len(ids) :].tolist()
        ttft = (streamer.first - t) if streamer.first is not None else None
        return tokens, seconds, ttft, {}

    for ids in init.get("warmup", [])[:2]:
        generate(ids, 8)
    info = dict(
        system="transformers",
        transformers=transformers.__version__,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        load_seconds=load_s,
        variant=v,
        assistant_settings=settings or None,
        assistant_library_defaults=defaults or None,
        sklearn_available=bool(is_sklearn_available()),
        note=(
            "assistant_confidence_threshold: transformers proposes the low-confidence token and stops after it "
            "(specrt greedy stops before it); without scikit-learn the threshold stays fixed"
            if draft is not None
            else None
        ),
    )
    return generate, info, {}


if __name__ == "__main__":
    raise SystemExit(serve(setup))
