"""Bad export input is refused before any conversion, in one line (issue 32, item 4).

Tiny GGUF files (metadata, a vocabulary and one small tensor, written with the ``gguf``
package's ``GGUFWriter``) stand in for real checkpoints; the GGUF conversion is replaced by
a function that fails the test if called, so a refusal that came after it would show.
"""

from __future__ import annotations

import json
import re
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
from click.testing import CliRunner  # noqa: E402

from specrt.cli import cli  # noqa: E402
from specrt.export import gguf_import, preflight  # noqa: E402
from specrt.runtime.errors import ExportError, PairError, UnsupportedModelError  # noqa: E402

VOCAB = [f"tok{i}" for i in range(64)] + ["<|endoftext|>"]


def write_gguf(
    path: Path, arch: str = "llama", tokens: list[str] = VOCAB, name: str = "tiny", token_types: list[int] | None = None, merges: list[str] | None = None
) -> Path:
    """A GGUF file with ``general.architecture`` = ``arch``, the vocabulary ``tokens`` (with
    ``token_types`` and BPE ``merges`` when given) and one float32 tensor ``[len(tokens), 8]``
    (the token embedding)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    if token_types is not None:
        w.add_token_types(token_types)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def no_conversion(monkeypatch):
    """Replace the GGUF conversion with one that records its call and stops the export."""
    calls = []

    def convert(path, *a, **kw):
        calls.append(Path(path).name)
        raise ExportError("conversion started")

    monkeypatch.setattr(gguf_import, "import_gguf", convert)
    return calls


def run_export(draft: Path, target: Path, out: Path, *extra: str):
    return CliRunner().invoke(
        cli, ["export", "--draft", str(draft), "--target", str(target), "--out", str(out), "--max-ctx", "64", "--precision", "int4", *extra]
    )


def one_line_error(result) -> str:
    """The CLI's error: exit code 1 and one ``Error: ...`` line."""
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


def test_valid_gguf_pair_reaches_the_conversion(tmp_path, no_conversion):
    """The control: a supported architecture with one vocabulary passes every check, so
    the tests below see their refusal and not something else."""
    d, t = write_gguf(tmp_path / "d.gguf"), write_gguf(tmp_path / "t.gguf")
    err = one_line_error(run_export(d, t, tmp_path / "out"))
    assert "conversion started" in err and no_conversion == ["d.gguf"]


def test_unsupported_gguf_architecture_is_refused_before_any_conversion(tmp_path, no_conversion):
    d = write_gguf(tmp_path / "d.gguf")
    t = write_gguf(tmp_path / "gemma.gguf", arch="gemma3")
    err = one_line_error(run_export(d, t, tmp_path / "out"))
    assert "--target" in err and "gemma.gguf" in err
    assert "GGUF general.architecture='gemma3' is not supported; supported: gpt2, llama, mistral, phi3, qwen2" in err
    assert no_conversion == [] and not (tmp_path / "out").exists()


def test_unsupported_folder_architecture_is_refused_first(tmp_path, no_conversion):
    """A Hugging Face folder's config.json model_type, read before the (GGUF) target is converted."""
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}))
    t = write_gguf(tmp_path / "t.gguf")
    with pytest.raises(UnsupportedModelError, match=r"--draft .*gemma: config.json model_type='gemma3_text' is not supported; supported: gpt2"):
        from specrt.export.pipeline import export_pair

        export_pair(folder, t, tmp_path / "out", max_ctx=64, log=lambda *_: None)
    assert no_conversion == []


def test_different_gguf_vocabularies_are_refused_before_any_conversion(tmp_path, no_conversion):
    d = write_gguf(tmp_path / "d.gguf")
    other = VOCAB[:10] + ["zzz"] + VOCAB[10:]  # one token more: every later id moves
    t = write_gguf(tmp_path / "t.gguf", tokens=other)
    err = one_line_error(run_export(d, t, tmp_path / "out"))
    assert "draft d.gguf and target t.gguf have different vocabularies" in err
    assert "draft has 65 tokens, target 66" in err and "only in the target (e.g. 'zzz'=10)" in err and "different ids" in err
    assert "pick a draft trained with the target's tokenizer" in err
    assert no_conversion == []


def test_vocabulary_rule_is_check_pairs_rule(tmp_path):
    """The early check compares token -> id maps as the late check (pipeline.check_pair) does:
    the same tokens in another order differ; equal lists pass."""
    a = preflight.read_input("draft", write_gguf(tmp_path / "a.gguf"))
    b = preflight.read_input("target", write_gguf(tmp_path / "b.gguf", tokens=list(reversed(VOCAB))))
    with pytest.raises(PairError, match="different vocabularies.*with different ids"):
        preflight.check_gguf_vocabularies(a, b)
    preflight.check_gguf_vocabularies(a, preflight.read_input("target", write_gguf(tmp_path / "c.gguf")))


Usage = namedtuple("Usage", "total used free")


def test_full_disk_is_refused_before_any_conversion(tmp_path, no_conversion, monkeypatch):
    d, t = write_gguf(tmp_path / "d.gguf"), write_gguf(tmp_path / "t.gguf")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: Usage(10**12, 10**12 - 1000, 1000))
    err = one_line_error(run_export(d, t, tmp_path / "out"))
    assert re.search(rf"not enough disk space: the export needs about \d+ kB in {re.escape(str(tmp_path / 'out'))} \(.*\), 1 kB free", err), err
    assert "target float32 folder from GGUF" in err
    assert no_conversion == []


def test_disk_estimate_per_precision_and_conversion(tmp_path):
    """The estimate: params x bytes per parameter of each flavor, the builder's copy for
    int8/int4, the kernels' panels (and a checkpoint folder's scratch GGUF), the fp32 quality
    reference, and 4 bytes/param per GGUF folder to convert."""
    from specrt.export.pipeline import ExportOptions
    from specrt.export.quality import QualityConfig

    n = 10**8
    infos = [preflight.InputInfo("draft", tmp_path / "d.gguf", True, "qwen2", n), preflight.InputInfo("target", tmp_path / "t.gguf", True, "qwen2", 3 * n)]
    out = tmp_path / "engine"
    need = preflight.estimate_disk(infos, out, ExportOptions(precision="int4", quality=QualityConfig()), {"target": tmp_path / "t.gguf.hf"})
    assert need[out]["bytes"] == (n + 3 * n) * 1.0 * 2 + 4 * 3 * n + int(1.07 * n) + int(1.07 * 3 * n)  # GGUF inputs: panels, no scratch
    assert need[tmp_path]["bytes"] == 4 * 3 * n
    folders = [preflight.InputInfo(i.role, tmp_path / i.role, False, "qwen2", i.params) for i in infos]
    plain = preflight.estimate_disk(folders, out, ExportOptions(precision="int4"))
    assert plain[out]["bytes"] == (n + 3 * n) * 2 + 2 * (int(1.07 * n) + int(1.07 * 3 * n))
    assert "target scratch GGUF (deleted after packing) 0.3 GB" in plain[out]["parts"]
    assert preflight.estimate_disk(folders, out, ExportOptions(precision="int4", kernels=False))[out]["bytes"] == (n + 3 * n) * 2
    fp32 = preflight.estimate_disk(infos, out, ExportOptions(precision="fp32"))
    assert fp32 == {out: {"bytes": 4 * 4 * n, "parts": ["draft fp32 0.4 GB", "target fp32 1.2 GB"]}}
    assert preflight.check_disk({out: {"bytes": 10**6, "parts": []}})[0].startswith(f"about 1 MB in {out}, ")


# A GGUF file beside a Hugging Face folder (tokenizer.json): compared before the conversion.
MERGES = ["t o", "to k", "tok 1", "tok 2"]
PADDED = VOCAB + ["[PAD65]", "[PAD66]", "[PAD67]"]  # llama.cpp pads a vocabulary so (Qwen: 151,665 -> 151,936)
PADDED_TYPES = [1] * 64 + [3] + [5] * 3  # NORMAL, CONTROL (<|endoftext|>), UNUSED


def write_folder(path: Path, vocab: list[str] = VOCAB, merges: list = MERGES, pairs: bool = True) -> Path:
    """A Hugging Face folder with a config.json (llama) and a BPE tokenizer.json: ``vocab``'s
    last entry as an added token, the others as the model vocabulary; ``merges`` written as
    [a, b] pairs (``pairs``, tokenizers >= 0.20) or as "a b" strings."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    tok = {
        "version": "1.0",
        "added_tokens": [
            {"id": len(vocab) - 1, "content": vocab[-1], "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        ],
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab[:-1])}, "merges": [m.split(" ") if pairs else m for m in merges]},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


def padded_gguf(path: Path, tokens: list[str] = PADDED, types: list[int] | None = PADDED_TYPES, merges: list[str] = MERGES) -> Path:
    return write_gguf(path, tokens=tokens, token_types=types, merges=merges)


@pytest.mark.parametrize("gguf_role", ["draft", "target"])
@pytest.mark.parametrize("pairs", [True, False], ids=["merge-pairs", "merge-strings"])
def test_gguf_and_folder_with_one_vocabulary_reach_the_conversion(tmp_path, no_conversion, gguf_role, pairs):
    """The control: the GGUF's padding ids are in tokenizer.json too (a folder converted from
    such a GGUF), the merges equal whichever way tokenizer.json stores them; the export
    reaches the conversion."""
    g, f = padded_gguf(tmp_path / "m.gguf"), write_folder(tmp_path / "hf", vocab=PADDED, pairs=pairs)
    d, t = (g, f) if gguf_role == "draft" else (f, g)
    err = one_line_error(run_export(d, t, tmp_path / "out"))
    assert "conversion started" in err and no_conversion == ["m.gguf"]


@pytest.mark.parametrize("gguf_role", ["draft", "target"])
def test_gguf_and_folder_differing_in_one_token_are_refused_before_any_conversion(tmp_path, no_conversion, gguf_role):
    g = padded_gguf(tmp_path / "m.gguf")
    f = write_folder(tmp_path / "hf", vocab=[*VOCAB[:5], "tox5", *PADDED[6:]])
    d, t = (g, f) if gguf_role == "draft" else (f, g)
    err = one_line_error(run_export(d, t, tmp_path / "out"))
    gd, ft = ("draft", "target") if gguf_role == "draft" else ("target", "draft")
    names = {"draft": "m.gguf", "target": str(f)} if gguf_role == "draft" else {"draft": str(f), "target": "m.gguf"}
    assert f"draft {names['draft']} and target {names['target']} have different vocabularies (draft has 68 tokens, target 68;" in err
    assert f"1 only in the {gd} (e.g. 'tok5'=5)" in err and f"1 only in the {ft} (e.g. 'tox5'=5)" in err
    assert "pick a draft trained with the target's tokenizer" in err
    assert no_conversion == [] and not (tmp_path / "out").exists()


def test_gguf_and_folder_differing_in_one_merge_are_refused_before_any_conversion(tmp_path, no_conversion):
    g = padded_gguf(tmp_path / "m.gguf")
    f = write_folder(tmp_path / "hf", vocab=PADDED, merges=[MERGES[0], "to kk", *MERGES[2:]])
    err = one_line_error(run_export(g, f, tmp_path / "out"))
    assert f"draft m.gguf and target {f} have the same tokens but different BPE merges (draft has 4 merges, target 4; " in err
    assert "first difference at rank 1: draft 'to k', target 'to kk'" in err
    assert no_conversion == []


def test_gguf_ids_the_folder_lacks_are_refused_padding_too(tmp_path, no_conversion):
    """A GGUF id tokenizer.json lacks is refused before the conversion, padding included: the
    conversion keeps every GGUF token, so the check on the converted folders
    (pipeline.check_pair) would refuse the pair after it; and an id the GGUF lacks."""
    f = preflight.read_input("target", write_folder(tmp_path / "hf"))

    def check(name, **kw):
        preflight.check_gguf_folder_vocabularies(preflight.read_input("draft", padded_gguf(tmp_path / name, **kw)), f)

    check("same.gguf", tokens=VOCAB, types=None)
    with pytest.raises(PairError, match=r"draft has 68 tokens, target 65; 3 only in the draft \(e.g. '\[PAD65\]'=65"):
        check("padded.gguf")
    err = one_line_error(run_export(padded_gguf(tmp_path / "m.gguf"), f.path, tmp_path / "out"))
    assert "3 only in the draft (e.g. '[PAD65]'=65" in err and no_conversion == []
    with pytest.raises(PairError, match=r"draft has 64 tokens, target 65; 1 only in the target \(e.g. '<\|endoftext\|>'=64\)"):
        check("short.gguf", tokens=VOCAB[:-1], types=None)


def test_folder_beside_a_gguf_needs_a_tokenizer_json(tmp_path, no_conversion):
    f = write_folder(tmp_path / "hf")
    (f / "tokenizer.json").unlink()
    err = one_line_error(run_export(f, padded_gguf(tmp_path / "m.gguf"), tmp_path / "out"))
    assert f"draft checkpoint {f} has no tokenizer.json" in err and no_conversion == []
