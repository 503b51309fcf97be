"""The backend contract of docs/howto/backend.md, as one check per rule of
runtime/backends/base.py, run on every model class in :data:`FACTORIES` (the onnxruntime CPU
backend, the walked-through example; a new backend adds its factory there): the protocol's
attributes, the logits' type and shape, the refusals, the KV rule (rolling back is a
smaller ``start``: rows at or beyond it are never read), forks with their own KV, the
target's width exactness from the manifest's ``min_q``, and an Engine on the backend whose
greedy speculative output equals its target-only output."""

from __future__ import annotations

import numpy as np
import pytest

from specrt import Engine, GenerationConfig, InputError
from specrt.runtime.backends import ThreadConfig, cpu_model
from specrt.runtime.backends.base import Model
from specrt.runtime.manifest import load_manifest

MAX_Q = 16


def _ort_cpu(folder, manifest, role, max_q=MAX_Q):
    return cpu_model(folder, getattr(manifest, role), manifest.max_ctx, max_q, ThreadConfig(), role=role)


# backend name (as Engine(backend=...) takes it) -> (folder, manifest, role, max_q) -> a Model
FACTORIES = {"ort-cpu": _ort_cpu}


@pytest.fixture(params=[(b, r) for b in FACTORIES for r in ("draft", "target")], ids=lambda p: f"{p[0]}-{p[1]}")
def model(request, tiny_pair):
    backend, role = request.param
    folder = tiny_pair[2]
    m = load_manifest(folder)
    made = FACTORIES[backend](folder, m, role)
    yield made, m, getattr(m, role)
    made.close()


def _tokens(m, n, seed):
    return np.random.default_rng(seed).integers(0, m.vocab_size, n).tolist()


def test_protocol_attributes_and_logits(model):
    mod, m, entry = model
    assert isinstance(mod, Model)
    assert (mod.max_q, mod.max_ctx, mod.vocab) == (MAX_Q, m.max_ctx, entry.vocab_size)
    out = mod.run(_tokens(m, 5, 0), 0)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (5, mod.vocab)
    assert np.isfinite(out).all()


def test_calls_outside_the_buffers_are_refused(model):
    mod, m, _ = model
    for tokens, start in (([], 0), ([1] * (MAX_Q + 1), 0), ([1, 2], m.max_ctx - 1), ([1], -1)):
        with pytest.raises(InputError):
            mod.run(tokens, start)


def test_rolling_back_is_a_smaller_start(model):
    """Rows written past ``start`` by a rejected call change nothing later: the rows of a
    run with a detour (junk written, then overwritten from a smaller start) equal those
    without it, bit for bit."""
    mod, m, _ = model
    toks = _tokens(m, 40, 1)
    mod.run(toks[:12], 0)
    want = [mod.run(toks[12:17], 12).copy(), mod.run(toks[17:22], 17).copy()]
    mod.run(toks[:12], 0)
    mod.run(_tokens(m, MAX_Q, 2), 12)  # a rejected verification: rows 12..27 hold junk
    mod.run(_tokens(m, 3, 3), 14)  # and a partial commit of it, rolled back again
    got = [mod.run(toks[12:17], 12).copy(), mod.run(toks[17:22], 17).copy()]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_fork_has_its_own_kv(model):
    mod, m, _ = model
    other = mod.fork()
    try:
        ta, tb = _tokens(m, 30, 4), _tokens(m, 30, 5)
        solo = [mod.run(ta[:12], 0).copy(), mod.run(ta[12:20], 12).copy()]
        mod.run(ta[:12], 0)
        other.run(tb[:12], 0)  # interleaved: each object keeps its own KV
        mixed = mod.run(ta[12:20], 12).copy()
        other.run(tb[12:20], 12)
        np.testing.assert_array_equal(mixed, solo[1])
    finally:
        other.close()


@pytest.mark.parametrize("backend", list(FACTORIES))
def test_target_widths_are_exact_from_the_manifests_min_q(tiny_pair, backend):
    """The manifest's exact_min_q was measured on onnxruntime CPU at export; the loop calls
    the target at min_q .. k_max + 1 rows on any backend, so those widths must give
    bit-identical rows on this one too."""
    from specrt.runtime.lab.exactness import measure

    folder = tiny_pair[2]
    m = load_manifest(folder)
    target = FACTORIES[backend](folder, m, "target", 2 * (m.k_max + 1) + 2)
    try:
        rec = measure([(backend, target)], m.vocab_size, widths=range(1, m.k_max + 2), offsets=(0, 1, 2), length=40)
    finally:
        target.close()
    assert rec["exact_min_q"] is not None and rec["exact_min_q"] <= m.min_q(), rec


@pytest.mark.parametrize("backend", list(FACTORIES))
def test_engine_on_the_backend_keeps_the_greedy_guarantee(tiny_pair, backend):
    e = Engine(tiny_pair[2], backend=backend)
    assert e.backend == backend
    for prompt in ("def add(a, b):", "for i in range(10):\n"):
        base = e.generate(prompt, GenerationConfig(max_new_tokens=24, speculative=False)).tokens
        for k in (1, 4, 8):
            res = e.generate(prompt, GenerationConfig(max_new_tokens=24, k_max=k, threshold=0.0))
            assert res.tokens == base, (prompt, k)
