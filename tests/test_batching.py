"""Continuous batching (issue 17): the slot-major batched builder model, its slot views, the
batch scheduler behind ``specrt serve --max-batch``.

Oracles: a slot view against an ordinary batch-1 model (bit for bit); batched rows against
the same sequence alone (independent of the other rows bit for bit; close to the batch-1
rows, which differ only by the kernels' rounding); greedy requests under batching against
the same request alone (exact when the scheduler speculates per row; near-ties reported
when it makes batched steps). Tiny int4 builder pair from conftest (seconds)."""

from __future__ import annotations

import numpy as np
import pytest

from specrt import Engine
from specrt.runtime.backends import cpu_model
from specrt.runtime.backends.base import ThreadConfig
from specrt.runtime.backends.ort_gqa_batch import BatchedGqaModel
from specrt.runtime.errors import InputError
from specrt.runtime.lab.exactness import measure_batched, pattern_bounds, run_pattern
from specrt.runtime.manifest import load_manifest


@pytest.fixture(scope="module")
def int4(int4_pair):
    return Engine(int4_pair[2])


@pytest.fixture(scope="module")
def batched(int4):
    return BatchedGqaModel(int4.target, 4, 32)


def test_slot_views_equal_a_batch1_model_bit_for_bit(int4_pair, int4, batched):
    m = load_manifest(int4_pair[2])
    ref_model = cpu_model(int4_pair[2], m.target, m.max_ctx, 32, ThreadConfig())
    rng = np.random.default_rng(0)
    seq = rng.integers(0, m.vocab_size, size=30).tolist()
    want = run_pattern(ref_model, seq, pattern_bounds(30, 4, 1))
    for j in (0, 3):
        got = run_pattern(batched.slots[j], seq, pattern_bounds(30, 4, 1))
        assert np.array_equal(got, want)
    # slot 3's run left slot 0's rows alone; slot 0's KV rows are the batch-1 model's
    run_pattern(batched.slots[0], seq, pattern_bounds(30, 4, 1))
    before = batched.keys[0][0].copy()
    batched.slots[3].run(rng.integers(0, m.vocab_size, size=10).tolist(), 0)
    assert np.array_equal(batched.keys[0][0], before)
    assert np.array_equal(batched.keys[0][0, :, :30], ref_model.keys[0][0, :, :30])


def test_batched_rows_are_independent_and_close_to_batch1(int4, batched):
    """Row 0 of a batched step gives the same bits whatever the other rows hold and however
    long they are; its rows stay within the kernels' rounding of the batch-1 rows."""
    rng = np.random.default_rng(1)
    V = int4.manifest.vocab_size
    s = rng.integers(0, V, size=40).tolist()
    L, steps = 20, 6
    ref = run_pattern(batched.slots[0], s, pattern_bounds(len(s), 9))[L - 1 : L - 1 + steps].copy()
    outs = []
    for other_len in (20, 25, 12):
        other = rng.integers(0, V, size=40).tolist()
        for n in (2, 4):
            run_pattern(batched.slots[0], s[:L], pattern_bounds(L, 9))
            for j in range(1, n):
                run_pattern(batched.slots[j], other[:other_len], pattern_bounds(other_len, 9))
            rows = []
            for t in range(steps):
                toks = [s[L - 1 + t]] + [other[other_len - 1 + t]] * (n - 1)
                rows.append(batched.step(toks, [L - 1 + t] + [other_len - 1 + t] * (n - 1))[0].copy())
            outs.append(np.stack(rows))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    assert np.abs(outs[0] - ref).max() < 0.1
    rec = measure_batched(batched, V, [1, 2, 4], steps=6, prefix=12)
    assert set(rec["max_abs_diff"]) == {"n1", "n2", "n4"} and max(rec["max_abs_diff"].values()) < 0.1


def test_batched_step_refuses_bad_input(batched):
    with pytest.raises(InputError, match="1..4 rows") as ei:
        batched.step([1] * 5, [3] * 5)
    assert ei.value.param == "tokens"
    with pytest.raises(InputError) as ei:
        batched.step([1, 2], [3])
    assert ei.value.param == "lengths"
    with pytest.raises(InputError) as ei:
        batched.step([1], [batched.max_ctx])
    assert ei.value.param == "lengths"
    with pytest.raises(InputError) as ei:
        BatchedGqaModel(None, 0, 4)
    assert ei.value.param == "max_batch"


def test_move_compacts_a_slot(int4, batched):
    rng = np.random.default_rng(2)
    s = rng.integers(0, int4.manifest.vocab_size, size=16).tolist()
    batched.slots[3].run(s, 0)
    batched.move(3, 1, 16)
    for buf in (*batched.keys, *batched.values):
        assert np.array_equal(buf[1, :, :16], buf[3, :, :16])
