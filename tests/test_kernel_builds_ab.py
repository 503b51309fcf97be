"""scripts/kernel_builds_ab.py: its width specs and ratios, and what it relies on: a build of
the kernels with other prefetch settings (CFLAGS) computes the same bits as the installed one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

import kernel_ref as R  # noqa: E402

from specrt.runtime import kernels as K  # noqa: E402
from specrt.runtime.kernels import panels as PN  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("kernel_builds_ab", REPO / "scripts" / "kernel_builds_ab.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

pytestmark = pytest.mark.skipif(K.library() is None, reason="specrt's kernels are not built here")


def test_widths_are_a_range_or_a_list():
    assert ab.widths_of("1-4") == [1, 2, 3, 4]
    assert ab.widths_of("1,5,9") == [1, 5, 9]
    with pytest.raises(SystemExit, match="--widths"):
        ab.widths_of("1-x")


def test_ratios_are_against_the_first_build():
    """ms: first / this (> 1 is faster); tok/s: this / first; medians over rounds."""

    def rnd(t1, d1, tok):
        return {"target": {"1": t1}, "draft": {"1": d1}, "bench": {"spec": {"tok_s": tok, "equal_target": 8}}}

    s = ab.summarize({"old": [rnd(40, 8, 20), rnd(44, 9, 22), rnd(42, 7, 21)], "new": [rnd(20, 8, 42), rnd(21, 9, 40), rnd(22, 10, 44)]})
    assert s["old"]["target"]["1"] == {"median": 42, "min": 40, "max": 44}
    assert s["new"]["speedup_vs_first"]["target"]["1"] == pytest.approx(42 / 21)
    assert s["new"]["speedup_vs_first"]["draft"]["1"] == pytest.approx(8 / 9)
    assert s["new"]["speedup_vs_first"]["bench"]["spec"] == pytest.approx(42 / 21)
    assert s["old"]["speedup_vs_first"]["target"]["1"] == 1.0
    assert s["new"]["bench_equal_target"]["spec"] == [8, 8, 8]


CHILD = """
import sys, numpy as np
from specrt.runtime import kernels as K
d = sys.argv[1]
for ty in (int(t) for t in sys.argv[2].split(",")):
    f = np.load(f"{d}/{ty}.npz")
    n, k = (int(v) for v in f["nk"])
    ys = [K.matmul(ty, n, k, f["pan"], f["x"][:q], isa=isa) for isa in sys.argv[3].split(",") for q in (1, 5, 9)]
    np.savez(f"{d}/{ty}.out.npz", *ys)
"""


def test_other_prefetch_settings_compute_the_same_bits(tmp_path):
    """A build with every prefetch constant changed (1 block ahead, the 32-weight types 7, no
    cache level) gives each type's rows bit for bit on every ISA path, at 1, 5 and 9 rows (and
    the flags do reach the compiler: a locality that is not a number does not build)."""
    with pytest.raises(SystemExit, match="failed"):
        ab.build("bad", "-DSK_PF_LOC=not_a_level", tmp_path)
    lib = ab.build("other", "-DSK_PF_AHEAD=1 -DSK_PF_AHEAD_LEG=7 -DSK_PF_LOC=0", tmp_path)
    assert lib.is_file() and tmp_path in lib.parents
    rng = np.random.default_rng(11)
    types = (R.Q2_K, R.Q4_K, R.Q5_K, R.Q6_K, R.IQ4_XS, R.Q8_0, R.Q4_0, R.Q4_1, R.Q5_1, R.F16)
    isas = K.ISAS[: K.ISAS.index(K.cpu_isa()) + 1]  # every path this CPU runs
    want = {}
    for ty in types:
        n, k = 32, 512
        raw = R.random_tensor(rng, ty, n, k)
        pan, x = PN.pack(raw, ty, n, k), rng.standard_normal((9, k)).astype(np.float32)
        np.savez(tmp_path / f"{ty}.npz", pan=pan, x=x, nk=np.array([n, k]))
        want[ty] = [K.matmul(ty, n, k, pan, x[:q], isa=isa) for isa in isas for q in (1, 5, 9)]
    env = dict(os.environ, SPECRT_KERNELS_LIB=str(lib))
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), ",".join(map(str, types)), ",".join(isas)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    for ty in types:
        got = np.load(tmp_path / f"{ty}.out.npz")
        for i, w in enumerate(want[ty]):
            np.testing.assert_array_equal(got[f"arr_{i}"].view(np.uint32), w.view(np.uint32), err_msg=f"{PN.TYPES[ty]} call {i}")
