"""GGUF files served directly (issue 52, item 1): ``specrt generate|bench|serve --target
T.gguf [--draft D.gguf]`` build an engine folder for the kernels from the files' own blocks
and metadata, with no torch, no transformers and no ONNX graph, cache it by the files'
SHA-256 and reuse it.

Oracles: greedy speculative output == the target alone on the same folder (the draft is
another model, so candidates are rejected); the folder's target panels == those the ONNX
export writes from the same file (:mod:`specrt.export.kernel_pack`, checked there against
``gguf.dequantize``); the tokenizer against llama.cpp's own test cases
(tests/test_real_vocabs.py converts every vocabulary with the same code) and, for
SentencePiece merges, against transformers' ``generate_merges``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from kernel_ref import byte_vocab, write_gguf

from specrt import Engine, GenerationConfig
from specrt.runtime import kernels as K
from specrt.runtime.errors import BackendError, EngineError, ExportError, InputError, PairError, UnsupportedModelError

if K.status() is not None:
    pytest.skip(f"kernels not available: {K.status()}", allow_module_level=True)

from specrt.cli import cli  # noqa: E402
from specrt.export.gguf_engine import build_engine, engine_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["abcabc", "ponmlk jih", "hello abc def"]
# a child that cannot import torch, transformers or onnx: the build and the run need none
NO_TORCH = (
    "import sys\n"
    "for m in ('torch', 'transformers', 'onnx', 'onnxscript', 'optimum', 'safetensors'):\n"
    "    sys.modules[m] = None\n"
    "from specrt.cli import main\n"
    "sys.argv = ['specrt'] + sys.argv[1:]\n"
    "main()\n"
)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """A tiny qwen2 target and draft (other weights, same vocabulary), and a draft of another
    vocabulary of the same size."""
    root = tmp_path_factory.mktemp("gguf_engine")
    v = byte_vocab(512)
    return {
        "target": write_gguf(root / "target.gguf", "qwen2", seed=1, vocab=v),
        "draft": write_gguf(root / "draft.gguf", "qwen2", seed=2, types={"attn": 8, "ffn": 8, "attn_v": 8, "ffn_down": 8}, vocab=v),
        "other": write_gguf(root / "other.gguf", "qwen2", seed=3, vocab=byte_vocab(512, tag="x")),
        "novocab": write_gguf(root / "novocab.gguf", "qwen2", seed=4),
    }


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=600)


def test_generate_from_gguf_files_without_torch_builds_once_and_reuses(ggufs, tmp_path):
    cache = tmp_path / "cache"
    args = [
        "generate",
        "--target",
        str(ggufs["target"]),
        "--draft",
        str(ggufs["draft"]),
        "--prompt",
        PROMPTS[0],
        "--max-new-tokens",
        "24",
        "--max-ctx",
        "256",
        "--no-adaptive",
        "--threshold",
        "0",
    ]
    first = _run(args, {"SPECRT_ENGINE_CACHE": str(cache)})
    assert first.returncode == 0, first.stderr
    assert "building a kernels engine" in first.stderr
    (folder,) = [p for p in cache.iterdir() if p.is_dir() and p.name != "ranks"]
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["chat_template.jinja", "draft.panels", "manifest.json", "target.panels", "tokenizer.json"], names  # no ONNX graph
    stamp = (folder / "target.panels").stat().st_mtime_ns
    second = _run(args, {"SPECRT_ENGINE_CACHE": str(cache)})
    assert second.returncode == 0, second.stderr
    assert "building" not in second.stderr and second.stdout == first.stdout
    assert (folder / "target.panels").stat().st_mtime_ns == stamp
    stats = json.loads(second.stderr.strip().splitlines()[-1])
    assert 1 <= stats["new_tokens"] <= 24 and stats["proposed"] > 0
    # the same text as the target alone on that folder
    e = Engine(folder)
    assert e.backend == "kernels" and e.manifest.kernels_only()
    want = e.generate(PROMPTS[0], GenerationConfig(max_new_tokens=24, speculative=False))
    assert first.stdout.rstrip("\n") == want.text


def _speculative_equals_target_alone(e: Engine) -> tuple[int, int]:
    """Greedy speculative output == the target alone on every prompt at k 1, 4 and 8 (asserted);
    returns the (rejected, accepted) candidates over all of them."""
    rejected = accepted = 0
    for p in PROMPTS:
        base = e.generate(p, GenerationConfig(max_new_tokens=40, speculative=False))
        for k in (1, 4, 8):
            out = e.generate(p, GenerationConfig(max_new_tokens=40, k_max=k, adaptive=False, threshold=0.0))
            assert out.tokens == base.tokens, (p, k)
            rejected += out.stats.proposed - out.stats.accepted
            accepted += out.stats.accepted
    return rejected, accepted


def test_speculative_equals_the_target_alone_on_a_built_folder(ggufs, tmp_path):
    m = build_engine(ggufs["target"], ggufs["draft"], tmp_path / "e", max_ctx=256, log=lambda *_: None)
    assert m.target.graph == m.draft.graph == "kernels" and m.target.precision == "gguf"
    assert m.draft.file == "draft.panels" and m.extra["kernels"]["draft"]["requantized"]["type"] == "Q4_0"
    e = Engine(tmp_path / "e")
    rejected, _ = _speculative_equals_target_alone(e)
    assert rejected > 0  # the draft is another model: the check is not vacuous
    # batch slots route and reuse rows as the Engine does: 1-row steps on width-exact kernels
    # (the folder records no measured layout; whole 256-row calls hid every shorter history)
    from specrt.runtime.backends.kern_batch import KernelBatch
    from specrt.runtime.slots import Slots

    batch = KernelBatch(e.target, 2)
    assert e.slot.t_step == 1 and {s.t_step for s in Slots.of_batch(batch, e)} == {1}
    batch.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_files_run_speculatively_as_the_target_alone(tmp_path, arch):
    """A gemma target and draft (another model of the vocabulary) built into a folder: greedy
    speculative output == the target alone at every k, with and without sliding layers past
    their window (the prompts and outputs run past its 16 positions)."""
    v = byte_vocab(512)
    # the draft: the target's file, whose matrices the draft's panels hold as Q4_0, so it
    # agrees often but not always; small token rows, or the tied head repeats the input
    t, d = (write_gguf(tmp_path / f"{r}.gguf", arch, seed=1, vocab=v, embd_scale=1 / 128) for r in "td")
    m = build_engine(t, d, tmp_path / "e", max_ctx=256, log=lambda *_: None)
    assert m.target.graph == m.draft.graph == "kernels" and m.extra["kernels"]["target"]["dims"]["ffn_act"] == "gelu"
    rejected, accepted = _speculative_equals_target_alone(Engine(tmp_path / "e"))
    assert rejected > 0 and accepted > 0, (rejected, accepted)


def test_target_panels_equal_the_exports(ggufs, tmp_path):
    """The folder's target panels are those ``specrt export`` writes from the same file."""
    from specrt.export.kernel_pack import write_panels

    build_engine(ggufs["target"], None, tmp_path / "a", max_ctx=64, log=lambda *_: None)
    (tmp_path / "b").mkdir()
    write_panels(ggufs["target"], tmp_path / "b", "target", log=lambda *_: None)
    assert (tmp_path / "a" / "target.panels").read_bytes() == (tmp_path / "b" / "target.panels").read_bytes()


def test_without_a_draft_ngram_drafting_gives_the_target_output(ggufs, tmp_path):
    m = build_engine(ggufs["target"], None, tmp_path / "e", max_ctx=256, log=lambda *_: None)
    assert m.defaults["drafter"] == "ngram" and m.draft == m.target
    e = Engine(tmp_path / "e")
    for p in PROMPTS:
        assert e.generate(p, GenerationConfig(max_new_tokens=30)).tokens == e.generate(p, GenerationConfig(max_new_tokens=30, speculative=False)).tokens


def test_tokenizer_and_template_come_from_the_gguf(ggufs, tmp_path):
    from tokenizers import Tokenizer

    m = build_engine(ggufs["target"], None, tmp_path / "e", max_ctx=64, log=lambda *_: None)
    tok = Tokenizer.from_file(str(tmp_path / "e" / "tokenizer.json"))
    v = byte_vocab(512)
    assert tok.encode("ab").ids == [v["tokens"].index("ab")] and tok.encode("az").ids == [v["tokens"].index("a"), v["tokens"].index("z")]
    assert tok.encode("ab<|endoftext|>").ids == [v["tokens"].index("ab"), v["eos"]]
    assert m.eos_token_id == v["eos"] and m.bos_token_id == v["eos"] and m.add_bos is False
    assert "assistant" in (tmp_path / "e" / "chat_template.jinja").read_text()
    assert m.vocab_size == 512 and m.target.vocab_size == 512


def test_refusals_are_one_line_before_any_panel_is_written(ggufs, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(PairError, match="different vocabularies") as e:
        engine_for(ggufs["target"], ggufs["other"], cache, 64, log=lambda *_: None)
    assert "\n" not in str(e.value)
    with pytest.raises(UnsupportedModelError, match="no vocabulary"):
        engine_for(ggufs["novocab"], None, cache, 64, log=lambda *_: None)
    other = write_gguf(tmp_path / "g.gguf", "starcoder2", vocab=byte_vocab(512))
    with pytest.raises(UnsupportedModelError, match=r"--target g.gguf: specrt's kernels do not run it: architecture 'starcoder2'"):
        engine_for(other, None, cache, 64, log=lambda *_: None)
    with pytest.raises(ExportError, match="not a GGUF file"):
        engine_for(ROOT / "README.md", None, cache, 64, log=lambda *_: None)
    assert not [p for p in cache.rglob("*") if p.suffix != ".lock"]  # no folder, panels or temporary left behind
    res = CliRunner().invoke(cli, ["generate", "--target", str(ggufs["target"]), "--draft", str(ggufs["other"]), "--prompt", "x", "--engine-cache", str(cache)])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "different vocabularies" in res.output
    res = CliRunner().invoke(cli, ["generate", "--draft", str(ggufs["draft"]), "--prompt", "x"])
    assert res.exit_code == 1 and "give --target X.gguf too" in res.output


def test_a_kernels_folder_refuses_the_onnx_backends_in_one_line(ggufs, tmp_path):
    build_engine(ggufs["target"], None, tmp_path / "e", max_ctx=64, log=lambda *_: None)
    with pytest.raises(BackendError, match="kernel panels only, no ONNX graph") as e:
        Engine(tmp_path / "e", backend="ort-cpu")
    assert "\n" not in str(e.value)


def test_a_kernels_entry_without_its_record_is_refused(ggufs, tmp_path):
    build_engine(ggufs["target"], ggufs["draft"], tmp_path / "e", max_ctx=64, log=lambda *_: None)
    path = tmp_path / "e" / "manifest.json"
    raw = json.loads(path.read_text())
    del raw["extra"]["kernels"]["draft"]
    path.write_text(json.dumps(raw))
    with pytest.raises(EngineError, match=r"extra\.kernels\.draft"):
        Engine(tmp_path / "e")


def test_a_stale_cache_folder_is_built_again(ggufs, tmp_path):
    cache = tmp_path / "cache"
    folder = engine_for(ggufs["target"], None, cache, 64, log=lambda *_: None)
    (folder / "manifest.json").write_text("{")  # a half-written manifest
    lines: list[str] = []
    again = engine_for(ggufs["target"], None, cache, 64, log=lines.append)
    assert again == folder and any("building it again" in x for x in lines)
    assert Engine(folder).generate(PROMPTS[1], GenerationConfig(max_new_tokens=8)).stats.new_tokens == 8


def test_spm_merges_equal_transformers(real_vocabs):
    """SentencePiece-BPE merges from the scores: the same list as transformers' derivation."""
    gm = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from specrt.export.gguf_tokenizer import read_tokenizer_meta, spm_merges

    m = read_tokenizer_meta(real_vocabs / "ggml-vocab-llama-spm.gguf")
    toks, scores = m["tokenizer.ggml.tokens"], m["tokenizer.ggml.scores"]
    assert spm_merges(toks, scores) == gm.generate_merges({t: i for i, t in enumerate(toks)}, dict(zip(toks, scores)))


def test_export_of_a_gguf_pair_without_precision_writes_the_kernels_folder(ggufs, tmp_path):
    out = tmp_path / "e"
    args = ["export", "--draft", str(ggufs["draft"]), "--target", str(ggufs["target"]), "--out", str(out), "--max-ctx", "128", "--k-max", "4"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert not list(out.glob("*.onnx*")) and (out / "draft.panels").is_file()
    e = Engine(out)
    assert e.manifest.kernels_only() and e.manifest.max_ctx == 128 and e.manifest.k_max == 4
    p = PROMPTS[2]
    assert e.generate(p, GenerationConfig(max_new_tokens=20)).tokens == e.generate(p, GenerationConfig(max_new_tokens=20, speculative=False)).tokens
    res = CliRunner().invoke(cli, [*args, "--lazy-head"])
    assert res.exit_code == 1 and "--lazy-head applies to ONNX graphs: add --precision" in res.output
    # without --max-ctx: serve --target's context (4096, or the target's own if smaller), and
    # adaptive k's call costs recorded, so the first adaptive request measures nothing
    res = CliRunner().invoke(cli, ["export", "--draft", str(ggufs["draft"]), "--target", str(ggufs["target"]), "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    from specrt.export.gguf_engine import read_input

    m = Engine(tmp_path / "d").manifest
    t = read_input(ggufs["target"], "target")
    key = f"{t.dims['arch']}.context_length"
    ctx = int(t.reader.fields[key].contents()) if key in t.reader.fields else 1 << 20
    assert m.max_ctx == min(4096, ctx), (m.max_ctx, ctx)
    costs = m.extra["tune"]["costs"]
    assert costs["backend"] == "kernels" and sorted(map(int, costs["target_s_by_q"])) == list(range(1, m.k_max + 2)) and costs["draft_s_per_call"] > 0


def test_serve_and_bench_take_gguf_files(ggufs, tmp_path, monkeypatch):
    """``serve --target``: the cached folder, the model id the target file's stem (unless
    --model-name); ``bench --target``: runs on it."""
    import specrt.runtime.serve.server as server

    seen = []
    monkeypatch.setattr(server, "serve", lambda cfg: seen.append(cfg))
    cache = tmp_path / "cache"
    base = ["serve", "--target", str(ggufs["target"]), "--engine-cache", str(cache), "--max-ctx", "128"]
    for extra, name in (([], "target"), (["--model-name", "m"], "m")):
        res = CliRunner().invoke(cli, [*base, *extra])
        assert res.exit_code == 0, res.output
        assert seen[-1].model_name == name and Path(seen[-1].engines).parent == cache
    assert len({cfg.engines for cfg in seen}) == 1  # built once, then reused
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    out = tmp_path / "b.json"
    res = CliRunner().invoke(
        cli,
        [
            "bench",
            "--target",
            str(ggufs["target"]),
            "--engine-cache",
            str(cache),
            "--max-ctx",
            "128",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert out.is_file()


@pytest.mark.parametrize("name", ["refact", "mpt", "command-r"])
def test_more_vocabularies_match_llama_cpp(real_vocabs, name):
    """Split rules llama.cpp shares between families (STARCODER's for refact and command-r,
    GPT-2's for mpt): every test case of llama.cpp's encodes to its ids (the eight
    vocabularies of tests/test_real_vocabs.py are checked there)."""
    from real_vocabs import read_cases

    from specrt.export.gguf_tokenizer import tokenizer_from_gguf

    path = real_vocabs / f"ggml-vocab-{name}.gguf"
    tok = tokenizer_from_gguf(path).tokenizer
    cases = read_cases(path)
    assert len(cases) > 40
    for text, ids in cases:
        assert tok.encode(text, add_special_tokens=False).ids == list(ids), text


def test_cli_refusals_of_the_gguf_options(ggufs, tmp_path):
    """One line each: a cache that is a file, --engines beside --target, --engine-cache alone,
    --no-kernels on a GGUF export without --precision."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    run = lambda *args: CliRunner().invoke(cli, list(args))  # noqa: E731
    res = run("generate", "--target", str(ggufs["target"]), "--engine-cache", str(blocker / "c"), "--prompt", "x")
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "engine cache" in res.output and "--engine-cache DIR" in res.output
    res = run("generate", "--engines", str(tmp_path), "--target", str(ggufs["target"]), "--prompt", "x")
    assert res.exit_code == 1 and "--engines and --target both name the model" in res.output
    res = run("generate", "--engine-cache", str(tmp_path), "--prompt", "x")
    assert res.exit_code == 1 and "give --target X.gguf too" in res.output
    res = run("export", "--draft", str(ggufs["draft"]), "--target", str(ggufs["target"]), "--out", str(tmp_path / "e"), "--no-kernels")
    assert res.exit_code == 1 and "--no-kernels" in res.output and not (tmp_path / "e").exists()


def test_a_script_without_a_main_guard_fails_in_one_line_instead_of_waiting_forever(ggufs, tmp_path):
    """The draft is built in a spawned process, which imports the caller's main module again:
    a script calling engine_for at its top level used to wait in that child for the build lock
    its parent holds. Now the child refuses in one line and the parent's build fails."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from specrt.export.gguf_engine import engine_for\n"
        f"engine_for({str(ggufs['target'])!r}, {str(ggufs['draft'])!r}, cache={str(tmp_path / 'cache')!r}, log=lambda *a: None)\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode != 0
    assert 'put the script\'s code under `if __name__ == "__main__":`' in r.stderr, r.stderr[-2000:]
    assert "the draft's build process ended without a result" in r.stderr, r.stderr[-2000:]


def test_the_default_context_is_the_models_when_shorter(tmp_path):
    short = write_gguf(tmp_path / "short.gguf", "qwen2", seed=5, dims={"n_ctx": 512}, vocab=byte_vocab(512))
    folder = engine_for(short, None, tmp_path / "cache", log=lambda *_: None)
    assert Engine(folder).manifest.max_ctx == 512
    with pytest.raises(InputError, match=r"max_ctx=4096; allowed: 10\.\.512"):
        engine_for(short, None, tmp_path / "cache", 4096, log=lambda *_: None)


def test_a_kernels_folder_where_the_kernels_cannot_run_says_why(ggufs, tmp_path, monkeypatch):
    build_engine(ggufs["target"], None, tmp_path / "e", max_ctx=64, log=lambda *_: None)
    monkeypatch.setattr(K, "status", lambda: "specrt's kernels were not built at install (test)")
    with pytest.raises(BackendError, match="backend 'kernels' is unavailable here: specrt's kernels were not built at install") as e:
        Engine(tmp_path / "e")
    assert "\n" not in str(e.value)
