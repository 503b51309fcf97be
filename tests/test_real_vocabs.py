"""Text with real tokenizers (issue 15, section 1), without a model hub.

llama.cpp's vocabulary files and tokenizer test cases (``tests/real_vocabs.py``, MIT),
converted with ``tests/gguf2tok.py``, for eight vocabularies:

- tokenization: the converted ``tokenizer.json`` (and the runtime's ``TextCodec``) encodes
  every ``.inp`` text to the ``.out`` ids llama.cpp expects (all of them);
- BOS/EOS: what the export records (``_special_ids``) and what the runtime does with it;
- the completion text (``runtime/textstream.py``): property tests on random prompt/output ids
  (encoded random text with CJK and emoji, random ids, byte tokens valid and invalid, split
  anywhere, random groupings) and every prompt/output split of every ``.inp`` text; the
  oracle is the tokenizer's decode of the whole sequence;
- the export's tokenizer guard (``export/tokenizer_check.py``) on each vocabulary, its NFC
  fix and its refusal;
- end to end, for llama-spm (SentencePiece, 32000), llama-bpe (Llama-3, 128256) and qwen2
  (151936): a tiny random model exported by ``specrt export`` as its own draft (tokens equal
  for every k, only the grouping differs): generate / stream / stop strings with k 1 and 8
  and target-only give one text, ``specrt generate``, BOS and EOS; the server (JSON and SSE)
  with the SentencePiece pair.
"""

from __future__ import annotations

import json
import os
import random
import unicodedata

import pytest
from click.testing import CliRunner
from helpers import scripted
from real_vocabs import read_cases
from text_oracle import FFFD, completion_text, invalid_byte_run, prefix_stable, stream_text

pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specrt import Engine, GenerationConfig  # noqa: E402
from specrt.cli import cli  # noqa: E402
from specrt.runtime.errors import TokenizerError  # noqa: E402
from specrt.runtime.textstream import CompletionText  # noqa: E402
from specrt.runtime.tokenizer import TextCodec  # noqa: E402

# name -> (BOS id, EOS id, whether BOS is prepended), from the GGUF's metadata and llama.cpp's defaults
SPECIALS = {
    "llama-spm": (1, 2, True),
    "llama-bpe": (128000, 128001, True),
    "qwen2": (151643, 151643, False),
    "phi-3": (1, 32000, True),
    "gpt-2": (50256, 50256, False),
    "deepseek-coder": (32013, 32014, True),
    "starcoder": (0, 0, False),
    "falcon": (11, 11, False),
}
SIZES = {"llama-spm": 32000, "llama-bpe": 128256, "qwen2": 151936, "phi-3": 32064, "gpt-2": 50257, "deepseek-coder": 32256, "starcoder": 49152, "falcon": 65024}
VOCABS = list(SPECIALS)
SENTENCEPIECE = {"llama-spm", "phi-3"}  # byte fallback; the others are byte-level BPE
PAIRS = ["llama-spm", "llama-bpe", "qwen2"]
EXAMPLES = int(os.environ.get("SPECRT_TEXT_EXAMPLES", "40"))  # hypothesis examples per vocabulary
DERANDOMIZE = not os.environ.get("SPECRT_TEXT_RANDOM")  # CI draws the same examples every run; set it to explore


class Vocab:
    """A converted vocabulary: its TextCodec, byte tokens and .inp/.out cases."""

    def __init__(self, name: str, folder, gguf):
        self.name, self.folder = name, folder
        bos, _, add_bos = SPECIALS[name]
        self.codec = TextCodec(folder / "tokenizer.json", bos, add_bos)
        self.tok = self.codec.tokenizer
        self.n = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos = [bos] if add_bos else []
        self.byte = byte_tokens(self.tok, name in SENTENCEPIECE)
        self.cases = read_cases(gguf)

    def enc(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids


def byte_tokens(tok, sentencepiece: bool) -> dict[int, int]:
    """byte -> id of the token standing for that single byte (``<0xNN>`` with byte fallback,
    GPT-2's printable byte alphabet in byte-level BPE)."""
    if sentencepiece:
        spelled = {b: f"<0x{b:02X}>" for b in range(256)}
    else:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        spelled = bytes_to_unicode()
    return {b: i for b, t in spelled.items() if (i := tok.token_to_id(t)) is not None}  # some vocabularies lack a few bytes


_VOCABS: dict[str, Vocab] = {}


@pytest.fixture
def vocab(request, real_tokenizer, real_vocabs) -> Vocab:
    """The :class:`Vocab` named ``request.param`` (converted once per session)."""
    name = request.param
    if name not in _VOCABS:
        _VOCABS[name] = Vocab(name, real_tokenizer(name), real_vocabs / f"ggml-vocab-{name}.gguf")
    return _VOCABS[name]


def vocabs(names):
    """Parametrize a test over the vocabularies ``names`` (the ``vocab`` fixture)."""
    return pytest.mark.parametrize("vocab", names, indirect=True)


# ---- fetching the vocabularies -----------------------------------------------------------
def test_vocab_fetch_says_why_it_cannot(tmp_path, monkeypatch):
    """Offline, or with the index unreachable, vocab_dir raises VocabsUnavailable with the
    reason (the fixture turns it into a skip with that reason); nothing is left half-written."""
    import real_vocabs as rv

    monkeypatch.setenv("SPECRT_VOCAB_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECRT_OFFLINE", "1")
    with pytest.raises(rv.VocabsUnavailable, match="SPECRT_OFFLINE"):
        rv.vocab_dir()
    monkeypatch.delenv("SPECRT_OFFLINE")
    monkeypatch.setenv("SPECRT_PYPI_SIMPLE", "http://127.0.0.1:9/simple")  # nothing listens there
    with pytest.raises(rv.VocabsUnavailable, match="cannot download"):
        rv.vocab_dir()
    assert not (tmp_path / rv.PIN).exists()


def test_vocab_cases_parse(real_vocabs):
    """llama.cpp's .inp/.out pairs: 46 cases, the empty text included, ids without BOS."""
    cases = read_cases(real_vocabs / "ggml-vocab-llama-spm.gguf")
    assert len(cases) == 46 and ("", []) in cases
    assert cases[0] == ("ied 4 ½ months", [474, 287, 29871, 29946, 29871, 30226, 7378])
    assert (real_vocabs / "LICENSE.llama.cpp").read_text().startswith("MIT License")


# ---- tokenization and special tokens ---------------------------------------------------
@vocabs(VOCABS)
def test_tokenization_matches_llama_cpp(vocab):
    """Every .inp text encodes to llama.cpp's expected ids and decodes back to itself; the
    runtime's TextCodec adds BOS exactly when the tokenizer says so."""
    assert len(vocab.cases) >= 46 and vocab.n == SIZES[vocab.name]
    wrong = [(t, ids, vocab.enc(t)) for t, ids in vocab.cases if vocab.enc(t) != ids]
    assert not wrong, f"{len(wrong)}/{len(vocab.cases)} cases differ, first: {wrong[0]}"
    for text, ids in vocab.cases:
        assert vocab.codec.decode(ids) == text
        assert vocab.codec.encode(text) == vocab.bos + ids
        assert vocab.tok.encode(text, add_special_tokens=True).ids == vocab.bos + ids  # tokenizer.json's own template


@vocabs(VOCABS)
def test_bos_eos_as_exported(vocab, tmp_path):
    """The export's probe (``_special_ids``) finds the GGUF's BOS/EOS and whether BOS is
    prepended; decode leaves them out; the export's tokenizer guard accepts the folder."""
    import shutil

    from transformers import LlamaConfig, Qwen2Config

    from specrt.export.pipeline import _special_ids
    from specrt.export.tokenizer_check import check_tokenizer

    bos, eos, add_bos = SPECIALS[vocab.name]
    cfg_cls = Qwen2Config if vocab.name == "qwen2" else LlamaConfig  # qwen2: transformers' Qwen2Tokenizer
    cfg_cls(vocab_size=vocab.n, bos_token_id=None, eos_token_id=None, pad_token_id=None).save_pretrained(tmp_path)
    for f in vocab.folder.iterdir():
        shutil.copy2(f, tmp_path / f.name)
    assert _special_ids(tmp_path) == (eos, bos, add_bos, vocab.n)
    assert check_tokenizer(tmp_path, tmp_path / "tokenizer.json", log=lambda *_: None) is None
    assert {bos, eos} <= vocab.codec.special_ids
    ids = vocab.enc("Hello world")
    assert vocab.codec.decode([bos, *ids, eos]) == vocab.codec.decode(ids) == "Hello world"
    assert (vocab.codec.encode("x")[0] == bos) is add_bos


# ---- the completion text -----------------------------------------------------------------
CJK = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FA5)
EMOJI = st.sampled_from(list("😀😁🤖🚀👍🏽🇩🇪"))
MISC = st.sampled_from(list("éüñßøΩЖж½€™\u00a0\u200b\u3000｜▁\ufffd"))
ASCII = st.sampled_from(list("abcxyzABC0123456789 _-+*/=()[]{}:;,.'\"!?#\n\t") + ["  ", "   ", "\n\n", "def ", "return ", " the"])
TEXT = st.lists(st.one_of(ASCII, ASCII, CJK, EMOJI, MISC), max_size=24).map("".join)
TAIL = st.sampled_from([b"", b"", b"", b"\xff", b"\x80", b"\xe6", b"\xf0\x9f"])


@st.composite
def ids_case(draw, v: Vocab):
    """(prompt ids, output ids): encoded text, raw byte tokens (UTF-8 cut anywhere, invalid
    bytes), random ids (special tokens included), mixed, split anywhere, BOS or not."""

    def raw_bytes():
        b = draw(TEXT).encode("utf-8")
        return [v.byte[x] for x in b[: max(0, len(b) - draw(st.integers(0, 3)))] + draw(TAIL) if x in v.byte]

    def part():
        kind = draw(st.sampled_from(["text", "text", "bytes", "random", "mix"]))
        if kind == "text":
            return v.enc(draw(TEXT))
        if kind == "bytes":
            return raw_bytes()
        if kind == "random":
            return draw(st.lists(st.integers(0, v.n - 1), max_size=10))
        return v.enc(draw(TEXT)) + raw_bytes() + v.enc(draw(TEXT))

    ids = part() + part()
    k = draw(st.integers(0, len(ids)))
    return (v.bos if draw(st.booleans()) else []) + ids[:k], ids[k:]


@vocabs(VOCABS)
def test_completion_text_properties(vocab):
    """Any grouping gives the same text, the pieces join to it, the window stays bounded,
    and it equals decode(prompt + out) minus decode(prompt): always for byte-level BPE; for
    SentencePiece wherever the decoder never takes text back (no byte-fallback run that is
    invalid UTF-8, no forced release; runtime/textstream.py says why not elsewhere)."""
    v = vocab
    counts = {"examples": 0, "asserted": 0}
    window = []

    class Counting(TextCodec):  # v.codec, with the length of every decoded window recorded
        def __init__(self):
            self.__dict__.update(v.codec.__dict__)

        def decode(self, ids):
            window.append(len(ids))
            return v.codec.decode(ids)

    counting = Counting()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        prompt, out = data.draw(ids_case(v))
        sizes, left = [], len(out)
        while left:
            sizes.append(data.draw(st.integers(1, left)))
            left -= sizes[-1]
        # cost: once per request a decode of the prompt's last 32 ids and, when they end
        # inside a character, a search for its last complete one; then one decode per id of
        # ctx + the window (<= max_pending + 1 ids, but once up to the 32 prompt ids when no
        # complete character was found), + the context once, + finish
        ctx, tail = len(v.codec.context_ids), 32
        window.clear()
        ct = CompletionText(counting, prompt)
        assert len(window) <= 2 * tail + ct.max_pending**2 + 3 and max(window, default=0) <= ctx + tail
        window.clear()
        for t in out:
            ct.push([t])
        ct.finish()
        assert len(window) <= len(out) + 2 and max(window, default=0) <= ctx + tail + 1
        assert sum(n > ctx + ct.max_pending + 1 for n in window) <= 1
        one, pieces, ct = stream_text(v.codec, prompt, out)
        assert one == ct.text
        grouped, gpieces, _ = stream_text(v.codec, prompt, out, sizes)
        whole, _, _ = stream_text(v.codec, prompt, out, [len(out)] if out else [])
        assert one == grouped == whole == "".join(pieces) == "".join(gpieces)
        counts["examples"] += 1
        ref = completion_text(v.codec.decode, prompt, out)
        if v.name not in SENTENCEPIECE:
            assert one == ref
        elif not ct.forced and not invalid_byte_run(v.tok, prompt + out) and prefix_stable(v.codec.decode, prompt + out):
            assert one == ref
        else:
            return
        counts["asserted"] += 1

    run()
    assert counts["asserted"] >= counts["examples"] // 5, counts  # the draws are byte-heavy on purpose


@vocabs(VOCABS)
def test_completion_text_of_every_split_of_real_text(vocab):
    """Every .inp text with BOS as the runtime adds it, split into prompt/output at every
    token, streamed one id at a time: the completion text is a suffix of the whole text with
    no U+FFFD (the texts are valid), and equals the whole-decode oracle (so prompt text +
    completion == whole text) wherever the decoder never takes text back; elsewhere (a prompt
    ending inside a character of a byte-fallback run, runtime/textstream.py) it is the text
    after the prompt's last complete character."""
    v = vocab
    splits = equal = 0
    for text, _ in v.cases:
        ids = v.codec.encode(text)
        stable = prefix_stable(v.codec.decode, ids)
        whole = v.codec.decode(ids)
        for k in range(1, len(ids) + 1):
            prompt, out = ids[:k], ids[k:]
            got, pieces, _ = stream_text(v.codec, prompt, out)
            assert "".join(pieces) == got and whole.endswith(got) and FFFD not in got, (text, k, got)
            ref = completion_text(v.codec.decode, prompt, out)
            splits += 1
            equal += got == ref
            if stable:
                assert got == ref, (text, k)
                assert v.codec.decode(prompt).rstrip(FFFD) + got == whole
    assert equal == splits or (v.name in SENTENCEPIECE and equal >= splits * 0.97), (equal, splits)


def test_leading_space_and_byte_cases_sentencepiece(real_tokenizer, real_vocabs):
    """The issue's two SentencePiece cases, on the codec alone: the first output token keeps
    its space; [x, <0x0A>, <0xE6>] gives "x\\n" + U+FFFD whatever the grouping (the whole
    decode gives "x" + 2 U+FFFD: ByteFallback takes back the newline, see runtime/textstream.py)."""
    codec = TextCodec(real_tokenizer("llama-spm") / "tokenizer.json", 1, True)
    t = codec.tokenizer.token_to_id
    prompt = codec.encode("def f(x):\n   ")
    out = [t("▁return"), t("▁x")]
    assert codec.decode(out) == "return x"  # what decoding the output alone gives
    assert stream_text(codec, prompt, out)[0] == completion_text(codec.decode, prompt, out) == " return x"
    assert stream_text(codec, [1], out)[0] == "return x" == codec.decode([1] + out)  # BOS only: no text before
    cut = [t("▁x"), t("<0x0A>"), t("<0xE6>")]
    for groups in ([1, 1, 1], [3], [2, 1], [1, 2]):
        assert stream_text(codec, prompt, cut, groups)[0] == " x\n" + FFFD
    assert completion_text(codec.decode, prompt, cut) == " x" + FFFD * 2
    # a character split between prompt and output belongs to the output
    p2 = codec.encode("hi") + [t("<0xE6>")]
    o2 = [t("<0x97>"), t("<0xA5>"), *codec.tokenizer.encode("!", add_special_tokens=False).ids]
    assert stream_text(codec, p2, o2)[0] == completion_text(codec.decode, p2, o2) == "日 !"


# ---- the export's tokenizer guard -----------------------------------------------------------
def _qwen2_folder(tmp_path, tok_dir, tokenizer_json: str | None = None):
    """A config-only model_type=qwen2 folder (AutoTokenizer -> Qwen2Tokenizer) with the
    tokenizer files of ``tok_dir`` (tokenizer.json replaced by ``tokenizer_json`` if given)."""
    import shutil

    from transformers import Qwen2Config

    Qwen2Config(vocab_size=152064).save_pretrained(tmp_path)
    for f in tok_dir.iterdir():
        shutil.copy2(f, tmp_path / f.name)
    if tokenizer_json is not None:
        (tmp_path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    return tmp_path


def test_tokenizer_guard_adds_a_missing_nfc(real_tokenizer, tmp_path):
    """Qwen2's vocabulary with its NFC normalizer removed: AutoTokenizer (Qwen2Tokenizer)
    still normalizes NFC; the guard returns tokenizer.json with NFC added, which then encodes
    every probe (NFD text included) as AutoTokenizer does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from specrt.export.tokenizer_check import PROBES, check_tokenizer

    d = json.loads((real_tokenizer("qwen2") / "tokenizer.json").read_text())
    assert d["normalizer"] == {"type": "NFC"}
    d["normalizer"] = None
    folder = _qwen2_folder(tmp_path, real_tokenizer("qwen2"), json.dumps(d))
    nfd = unicodedata.normalize("NFD", "Café résumé")
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode(nfd).ids != auto(nfd)["input_ids"]
    notes = []
    fixed = check_tokenizer(folder, folder / "tokenizer.json", log=notes.append, auto=auto)
    assert fixed is not None and len(notes) == 1 and "NFC added" in notes[0]
    fixed_tok = Tokenizer.from_str(fixed)
    for text in (*PROBES, nfd):
        assert fixed_tok.encode(text, add_special_tokens=False).ids == auto(text, add_special_tokens=False)["input_ids"]
    assert fixed_tok.get_vocab(with_added_tokens=True) == Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)


def test_tokenizer_guard_refuses_in_one_line(real_tokenizer, tmp_path):
    """GPT-2's vocabulary in a model_type=qwen2 folder: Qwen2Tokenizer splits text with its own
    regex, tokenizer.json with GPT-2's: the export refuses, naming the first differing text."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from specrt.export.tokenizer_check import PROBES, check_tokenizer

    folder = _qwen2_folder(tmp_path / "m", real_tokenizer("gpt-2"))
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    first = next(t for t in PROBES if raw.encode(t, add_special_tokens=False).ids != auto(t, add_special_tokens=False)["input_ids"])
    with pytest.raises(TokenizerError) as err:
        check_tokenizer(folder, folder / "tokenizer.json", log=lambda *_: None, auto=auto)
    assert err.value.param == "tokenizer" and repr(first) in str(err.value) and "Qwen2Tokenizer" in str(err.value)
    res = CliRunner().invoke(cli, ["export", "--draft", str(folder), "--target", str(folder), "--out", str(tmp_path / "e")])
    *before, last = res.output.strip().splitlines()
    # the refusal is one line; before it only the export's first line (the disk estimate)
    assert res.exit_code != 0 and last.startswith("Error:") and repr(first) in last, res.output
    assert all(line.startswith("disk: ") for line in before), res.output
    assert not (tmp_path / "e" / "manifest.json").exists()


# ---- end to end: exported pairs with real vocabularies -------------------------------------
PROMPTS = ["def f(x):\n   ", "日本語のテキスト", "Hello", "emoji 😀 and ", "  two  spaces\n\n"]
MODES = {
    "target-only": dict(speculative=False),
    "k=1": dict(k_max=1, threshold=0.0),
    "k=8": dict(k_max=8, threshold=0.0),
}


_ENGINES: dict[str, Engine] = {}


@pytest.fixture
def pair(request, real_pair):
    """(name, checkpoint dir, Engine) of the exported pair with vocabulary ``request.param``."""
    ckpt, eng = real_pair(request.param)
    if request.param not in _ENGINES:
        _ENGINES[request.param] = Engine(eng)
    return request.param, ckpt, _ENGINES[request.param]


def pairs(names=PAIRS):
    """Parametrize a test over the exported pairs ``names`` (the ``pair`` fixture)."""
    return pytest.mark.parametrize("pair", names, indirect=True)


def _stream(engine, prompt, cfg):
    """(pieces, result) of one Engine.stream call."""
    st_ = engine.stream(prompt, cfg)
    pieces = list(st_)
    return pieces, st_.result


@pairs()
def test_pair_bos_eos_and_prompt_ids(pair, real_vocabs):
    """The manifest records the tokenizer's BOS/EOS; prompt ids are llama.cpp's expected ids
    with BOS first exactly when the tokenizer adds it (= transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    name, ckpt, engine = pair
    bos, eos, add_bos = SPECIALS[name]
    m = engine.manifest
    assert (m.bos_token_id, m.eos_token_id, m.add_bos, m.vocab_size) == (bos, eos, add_bos, SIZES[name])
    auto = AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    for text, ids in read_cases(real_vocabs / f"ggml-vocab-{name}.gguf"):
        if text:
            assert engine.prompt_ids(text) == ([bos] if add_bos else []) + ids == auto(text)["input_ids"]


@pairs()
def test_pair_text_is_the_same_for_every_grouping(pair):
    """Draft == target: every mode gives the same tokens; the text (generate, stream pieces
    joined) is then the same too, and equals the whole-decode oracle where it is defined;
    stop strings cut all modes alike, at the documented place."""
    name, _, engine = pair
    rnd = random.Random(0)
    stops_checked = 0
    for prompt in PROMPTS:
        ids = engine.prompt_ids(prompt)
        results = {}
        for mode, kw in MODES.items():
            cfg = GenerationConfig(max_new_tokens=24, **kw)
            res = engine.generate(prompt, cfg)
            pieces, sres = _stream(engine, prompt, cfg)
            assert sres.tokens == res.tokens and "".join(pieces) == sres.text == res.text
            results[mode] = res
        base = results["target-only"]
        assert all(r.tokens == base.tokens and r.text == base.text for r in results.values())
        if name not in SENTENCEPIECE or (
            not invalid_byte_run(engine.codec.tokenizer, ids + base.tokens) and prefix_stable(engine.codec.decode, ids + base.tokens)
        ):
            assert base.text == completion_text(engine.codec.decode, ids, base.tokens)
        segs = [s for s in base.text.split(FFFD) if len(s) >= 2]
        if not segs:
            continue
        seg = rnd.choice(segs)
        a = rnd.randrange(len(seg) - 1)
        stop = seg[a : a + 2]
        want_text = base.text[: base.text.index(stop)]
        outs = []
        for kw in MODES.values():
            cfg = GenerationConfig(max_new_tokens=24, stop=(stop,), **kw)
            res = engine.generate(prompt, cfg)
            pieces, sres = _stream(engine, prompt, cfg)
            assert "".join(pieces) == sres.text == res.text and sres.tokens == res.tokens
            outs.append((res.tokens, res.text, res.stop_reason, res.finish_reason))
        assert all(o == outs[0] for o in outs)
        n = len(outs[0][0])
        assert outs[0][1:] == (want_text, stop, "stop") and stop in completion_text(engine.codec.decode, ids, base.tokens[:n])
        assert stop not in completion_text(engine.codec.decode, ids, base.tokens[: n - 1]).rstrip(FFFD)
        stops_checked += 1
    assert stops_checked >= 2


def _token(tok, *spellings):
    """The id of the first spelling the vocabulary has."""
    return next(i for s in spellings if (i := tok.token_to_id(s)) is not None)


@pairs()
def test_pair_scripted_text_cases(pair):
    """Scripted continuations through the whole Engine, every mode and streaming: the first
    token's leading space; an output cut inside a character after a newline; a character
    split between prompt and output; EOS ends the output and adds no text."""
    name, _, engine = pair
    tok = engine.codec.tokenizer
    byte = byte_tokens(tok, name in SENTENCEPIECE)
    prompt = engine.prompt_ids("def f(x):\n   ")
    space_first = [_token(tok, "▁return", "Ġreturn"), _token(tok, "▁x", "Ġx")]
    cut = [_token(tok, "▁x", "Ġx"), byte[0x0A], byte[0xE6]]
    split_prompt = engine.prompt_ids("hi") + [byte[0xE6]]
    split_out = [byte[0x97], byte[0xA5], *engine.codec.tokenizer.encode("!", add_special_tokens=False).ids]
    eos = engine.manifest.eos_token_id
    cases = [
        (prompt, space_first, " return x"),
        (prompt, cut, " x\n" + FFFD),  # SentencePiece: the whole decode gives " x" + 2 U+FFFD (runtime/textstream.py)
        (split_prompt, split_out, "日 !" if name in SENTENCEPIECE else "日!"),  # "!" is "▁!" in SentencePiece
        (prompt, [*space_first, eos, space_first[0]], " return x"),
    ]
    for p, cont, want in cases:
        for kw in MODES.values():
            cfg = GenerationConfig(max_new_tokens=len(cont), **kw)
            with scripted(engine, p, cont):
                res = engine.generate(p, cfg)
                pieces, sres = _stream(engine, p, cfg)
            assert res.text == sres.text == "".join(pieces) == want, (kw, res.text, want)
            assert sres.tokens == res.tokens
            if eos in cont:
                assert res.tokens == cont[: cont.index(eos) + 1] and res.finish_reason == "stop" and res.stop_reason is None
            else:
                assert res.tokens == cont and res.finish_reason == "length"
        if not (name in SENTENCEPIECE and cont is cut):
            assert want == completion_text(engine.codec.decode, p, res.tokens)
        else:
            assert completion_text(engine.codec.decode, p, res.tokens) == " x" + FFFD * 2


@pairs()
def test_pair_cli_generate_prints_the_same_text(pair):
    """``specrt generate`` (plain and --stream, k 1 and 8) prints the Engine's text."""
    import click

    name, _, engine = pair
    prompt = "def f(x):\n   "
    want = engine.generate(prompt, GenerationConfig(max_new_tokens=16, k_max=8)).text
    for extra in (["--k-max", "1"], ["--k-max", "8", "--stream"], ["--no-speculation", "--stream"]):
        args = ["generate", "--engines", str(engine.folder), "--prompt", prompt, "--max-new-tokens", "16", "--threshold", "0", "--no-stats", *extra]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, res.output
        assert res.stdout == click.unstyle(want) + "\n", (extra, res.stdout, want)


@pytest.mark.parametrize("pair", ["llama-spm"], indirect=True)
def test_server_text_with_a_sentencepiece_pair(pair):
    """``/v1/completions`` with the SentencePiece pair: the SSE pieces join to the JSON text,
    which is decode(prompt + output) minus decode(prompt) (leading space kept), with and
    without stop strings, for k 1 and 8."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from test_server import Server, post, post_stream
    from test_server import stream_text as sse_text

    name, _, engine = pair
    server = Server(engine.folder, "--workers", "1")
    try:
        checked = 0
        for prompt in ("def f(x):\n   ", "日本語のテキスト", "Hello"):
            ids = engine.prompt_ids(prompt)
            ref = engine.generate(prompt, GenerationConfig(max_new_tokens=20, k_max=8))
            seg = max(ref.text.split(FFFD), key=len)
            stops = [(), (seg[len(seg) // 2 :][:2],)] if len(seg) >= 4 else [()]
            for k, stop in [(k, stop) for k in (1, 8) for stop in stops]:
                body = dict(prompt=prompt, max_tokens=20, temperature=0.0, threshold=0.0, k_max=k, **({"stop": list(stop)} if stop else {}))
                status, out, _ = post(server.port, body)
                assert status == 200, out
                status, events, done = post_stream(server.port, body)
                assert status == 200 and done
                text = out["choices"][0]["text"]
                assert sse_text(events) == text == engine.generate(prompt, GenerationConfig(max_new_tokens=20, k_max=k, stop=stop)).text
                if not stop:
                    assert text == ref.text
                    if not invalid_byte_run(engine.codec.tokenizer, ids + ref.tokens):
                        assert text == completion_text(engine.codec.decode, ids, ref.tokens)
                        checked += 1
        assert checked >= 2
    finally:
        server.stop()
