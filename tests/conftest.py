"""Shared fixtures: tiny random-weight pairs exported once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_tokenizer, save_llama

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ENGINES = REPO / "engines" / "default"


@pytest.fixture(scope="session", autouse=True)
def _digest_cache(tmp_path_factory):
    """The tests' digest cache lives in their temporary folder, never in ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRT_DIGEST_CACHE", str(tmp_path_factory.mktemp("digest_cache") / "digests.json"))
        yield


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(draft_dir, target_dir, engine_dir) for a random 2-layer target and 1-layer draft
    (exported without the lazy-head graphs: the folder of the lazy-head error tests)."""
    pytest.importorskip("torch")
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=1, hidden=64, layers=2)
    save_llama(root / "draft", tok, seed=2, hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
    export_pair(root / "draft", root / "target", root / "engine", k_max=8, max_ctx=256, log=lambda *_: None, lazy_head=False)
    return root / "draft", root / "target", root / "engine"


@pytest.fixture(scope="session")
def noisy_pair(tmp_path_factory):
    """(target_dir, engine_dir): draft = target with perturbed weights, so it agrees often but not always."""
    pytest.importorskip("torch")
    import torch

    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("noisy")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=5, hidden=64, layers=2)
    draft = save_llama(root / "draft", tok, seed=5, hidden=64, layers=2)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.35 * p.std())
    draft.save_pretrained(root / "draft")
    export_pair(root / "draft", root / "target", root / "engine", k_max=8, max_ctx=256, log=lambda *_: None)
    return root / "target", root / "engine"


@pytest.fixture(scope="session")
def self_pair(tmp_path_factory):
    """Engine folder whose draft IS the target (every proposal must be accepted)."""
    pytest.importorskip("torch")
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("self")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=3, hidden=64, layers=2)
    export_pair(root / "target", root / "target", root / "engine", k_max=8, max_ctx=256, log=lambda *_: None)
    return root / "target", root / "engine"
