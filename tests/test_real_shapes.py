"""scripts/real_shapes.py: the presets have the published parameter counts, the analytic
bound and its inversion are right, the synthetic tokenizer has the real vocabulary size.
(No checkpoint is built or exported here: the shapes are counted on PyTorch's meta device.)"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("real_shapes", Path(__file__).resolve().parents[1] / "scripts" / "real_shapes.py")
rs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rs)


@pytest.mark.parametrize(
    "preset, params",
    [
        ("qwen2.5-0.5b", 494_032_768),  # Qwen/Qwen2.5-0.5B: 0.49B (tied embeddings)
        ("qwen2.5-1.5b", 1_543_714_304),  # Qwen/Qwen2.5-1.5B: 1.54B
        ("llama-3.2-1b", 1_235_814_400),  # meta-llama/Llama-3.2-1B: 1.24B
    ],
)
def test_presets_have_the_published_parameter_counts(preset, params):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(rs.preset_config(preset))
    assert sum(p.numel() for p in model.parameters()) == params


def test_bound_formula_and_its_inversion():
    # Leviathan et al. 2023, Thm 3.8 at alpha 0.8, k 4, c 0.1: (1 - 0.8^5) / (0.2 * 1.4)
    assert rs.bound(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert rs.bound(0.8, 4, 0.1, verify=1.5) == pytest.approx((1 - 0.8**5) / 0.2 / 1.9)
    assert rs.bound(1.0, 3, 0.0) == 4.0
    for a in (0.3, 0.5, 0.77, 0.9):
        tau = (1 - a**6) / (1 - a)
        assert rs.alpha_from_mean_tokens(tau, 5) == pytest.approx(a, abs=1e-9)
    assert math.isclose(rs.alpha_from_mean_tokens(3.0, 5), 0.709, abs_tol=5e-4)


def test_synthetic_tokenizer_size():
    tok = rs.synthetic_tokenizer(1000)
    assert tok.get_vocab_size() == 1000
    assert tok.encode("w1 w999 nope").ids == [1, 999, 0]


def test_load_modes_cold_and_warm(tiny_pair):
    """``cold`` hashes every file the load opens (empty digest cache), ``warm`` (a new
    process whose cache file an earlier load filled) hashes none."""
    import time

    from specrt.runtime.manifest import load_manifest

    engine = str(tiny_pair[2])
    n = len(load_manifest(engine, verify_hashes=False).load_files())
    time.sleep(2.1)  # files younger than the racy window (2 s) are never recorded
    res = rs.measure_load([engine], ["cold", "warm", "no-hash"], 1)
    rows = {r["mode"]: r for r in res["rows"]}
    assert (rows["cold"]["files_hashed"], rows["cold"]["files_cached"]) == (n, 0)
    assert (rows["warm"]["files_hashed"], rows["warm"]["files_cached"]) == (0, n)
    assert "files_hashed" not in rows["no-hash"] and rows["no-hash"]["wall_s_median"] > 0
