"""Engine folder integrity (issue 15, sections 2-3): every file in the manifest's ``files``
map with SHA-256 and size, external-data weights included; the whole manifest validated at
load (one line per problem, naming the field, the value and what is allowed); the graphs
checked against it; and the CLI's statistics line is strict JSON.

Small synthetic folders only: one tiny pair exported with ``--external-data``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time

import pytest
from click.testing import CliRunner
from helpers import make_tokenizer, save_llama

from specrt import Engine, GenerationConfig
from specrt.cli import cli
from specrt.runtime.errors import EngineError
from specrt.runtime.integrity import Verification, check_present, file_identity, sha256_file
from specrt.runtime.manifest import FORMAT_VERSION, load_manifest, validate_manifest


@pytest.fixture(scope="module")
def ext_pair(tmp_path_factory):
    """(draft_dir, target_dir, engine_dir): a 1-layer target and draft exported with
    external data and the lazy-head graphs."""
    pytest.importorskip("torch")
    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("ext")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=11, hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
    save_llama(root / "draft", tok, seed=12, hidden=32, layers=1, heads=2, kv_heads=1, inter=64)
    lines = []
    export_pair(root / "draft", root / "target", root / "engine", k_max=4, max_ctx=64, log=lines.append, external_data=True, lazy_head=True)
    (root / "export.log").write_text("\n".join(lines))
    return root / "draft", root / "target", root / "engine"


def _copy(tmp_path, src, name="e"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit(folder, fn):
    raw = json.loads((folder / "manifest.json").read_text())
    fn(raw)
    (folder / "manifest.json").write_text(json.dumps(raw))
    return folder


# ---- the files map ------------------------------------------------------------------------
def test_every_file_is_recorded_with_hash_and_size(ext_pair):
    eng = ext_pair[2]
    m = load_manifest(eng)
    assert m.format_version == FORMAT_VERSION == 2
    on_disk = sorted(p.name for p in eng.iterdir() if p.name != "manifest.json")
    assert sorted(m.files) == on_disk  # nothing written is left out, nothing listed is absent
    # the lazy-head graphs read the target's weights from target.onnx.data (stored once)
    assert on_disk == sorted(["draft.onnx", "draft.onnx.data", "target.onnx", "target.onnx.data", "target_body.onnx", "target_head.onnx", "tokenizer.json"])
    assert m.files["target_body.onnx"].external == m.files["target_head.onnx"].external == ("target.onnx.data",)
    for name, rec in m.files.items():
        data = (eng / name).read_bytes()
        assert rec.sha256 == hashlib.sha256(data).hexdigest() and rec.bytes == len(data)
    # graphs name the files their initializers read; the weights are there, not in the graph
    for g in ("draft.onnx", "target.onnx", "target_body.onnx", "target_head.onnx"):
        assert m.files[g].external == ((g + ".data",) if g in ("draft.onnx", "target.onnx") else ("target.onnx.data",))
    assert m.files["target_head.onnx"].bytes < 4 * 320 * 32  # the LM head's float32 [320, 32] weight is read from target.onnx.data, not inline
    assert m.files["tokenizer.json"].external == ()
    assert (m.draft.sha256, m.target.sha256, m.tokenizer_sha256) == (
        m.files["draft.onnx"].sha256,
        m.files["target.onnx"].sha256,
        m.files["tokenizer.json"].sha256,
    )
    assert m.load_files() == {n: m.files[n].sha256 for n in ("draft.onnx", "draft.onnx.data", "target.onnx", "target.onnx.data", "tokenizer.json")}


def test_external_files_read_from_the_graph(ext_pair, tiny_pair):
    from specrt.export.onnx_export import external_files

    assert external_files(ext_pair[2] / "target.onnx") == ("target.onnx.data",)
    assert external_files(tiny_pair[2] / "target.onnx") == ()  # inline weights
    assert load_manifest(tiny_pair[2]).files["target.onnx"].external == ()


def test_export_records_peak_rss(ext_pair):
    m = load_manifest(ext_pair[2])
    rec = m.extra["export"]
    assert rec["external_data"] is True
    assert 50 < rec["peak_rss_mib"] < 64_000  # a Python process with torch: tens of MiB at least
    assert rec["peak_rss_mib"] == max(p["peak_rss_mib"] for p in rec["phases"].values())
    assert {"target: export ONNX", "target: parity (onnxruntime)", "draft: export ONNX"} <= set(rec["phases"])
    log = (ext_pair[2].parent / "export.log").read_text()
    assert re.search(r"export peak RSS [\d,]+ MiB", log) and "target.onnx: weights in target.onnx.data" in log


def test_external_data_engine_generates_like_the_inline_one(ext_pair, tmp_path):
    from specrt.export.pipeline import export_pair

    inline = tmp_path / "inline"
    export_pair(ext_pair[0], ext_pair[1], inline, k_max=4, max_ctx=64, log=lambda *_: None, lazy_head=False)
    assert not any(p.suffix == ".data" for p in inline.iterdir())
    cfg = GenerationConfig(max_new_tokens=12, k_max=3)
    a, b = Engine(ext_pair[2]).generate("def f(x):", cfg), Engine(inline).generate("def f(x):", cfg)
    assert a.tokens == b.tokens and len(a.tokens) == 12


# ---- altered, truncated, missing: refused naming the file ---------------------------------
@pytest.mark.parametrize("name", ["target.onnx.data", "draft.onnx.data", "target.onnx"])
@pytest.mark.parametrize("how", ["flip", "truncate", "missing"])
def test_altered_weight_files_refused(ext_pair, tmp_path, name, how):
    dst = _copy(tmp_path, ext_pair[2])
    p = dst / name
    size = p.stat().st_size
    if how == "flip":
        data = bytearray(p.read_bytes())
        data[size // 2] ^= 0x01  # one bit of one weight: the graph still loads, the values are wrong
        p.write_bytes(bytes(data))
        why = "does not match the SHA-256 recorded in the manifest (truncated or altered)"
    elif how == "truncate":
        with open(p, "r+b") as f:
            f.truncate(size - 4096)
        why = f"has {size - 4096} bytes, the manifest records {size} (truncated or altered)"
    else:
        p.unlink()
        why = "is missing (the manifest lists it as a file of this engine)"
    with pytest.raises(EngineError) as e:
        Engine(dst)
    msg = str(e.value)
    assert msg.startswith(str(p) + " " + why) and "\n" not in msg and "specrt export" in msg
    assert e.value.param == "files"


def test_flipped_weight_is_refused_before_any_session(ext_pair, tmp_path, monkeypatch):
    """The digests are checked before the sessions are created: no session is ever built
    over a corrupted .data file, and no Engine is returned."""
    import specrt.runtime.engine as engine_mod

    dst = _copy(tmp_path, ext_pair[2])
    p = dst / "target.onnx.data"
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x80
    p.write_bytes(bytes(data))
    built = []
    real = engine_mod.load_models

    def spy(*a, **kw):
        built.append(real(*a, **kw))
        return built[-1]

    monkeypatch.setattr(engine_mod, "load_models", spy)
    with pytest.raises(EngineError, match=re.escape(f"{p} does not match the SHA-256")):
        Engine(dst)
    assert built == []
    # without the hash check the corrupted weights would be used (presence only is checked)
    Engine(dst, verify_hashes=False)
    assert len(built) == 1


def test_lazy_head_graphs_checked_when_first_used(ext_pair, tmp_path):
    dst = _copy(tmp_path, ext_pair[2])
    p = dst / "target_head.onnx"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x01
    p.write_bytes(bytes(data))
    eng = Engine(dst)  # the lazy-head graphs are not opened by a load
    assert eng.generate("x", GenerationConfig(max_new_tokens=4, strategy="full")).tokens
    with pytest.raises(EngineError, match=re.escape(f"{p} does not match the SHA-256")):
        eng.generate("x", GenerationConfig(max_new_tokens=4, strategy="lazy-head"))
    (dst / "target_body.onnx").unlink()
    eng = Engine(dst)  # optional until used
    with pytest.raises(EngineError, match="target_body.onnx is missing"):
        eng.generate("x", GenerationConfig(max_new_tokens=4, strategy="lazy-head"))


def test_verification_unit(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * (9 << 20))  # more than one read block
    b.write_bytes(b"")
    assert sha256_file(a) == hashlib.sha256(b"x" * (9 << 20)).hexdigest()
    assert sha256_file(b) == hashlib.sha256(b"").hexdigest()
    Verification(tmp_path, {"a.bin": sha256_file(a), "b.bin": sha256_file(b)}, "hint", workers=2).wait()
    with pytest.raises(EngineError, match=r"b.bin does not match the SHA-256 recorded in the manifest \(truncated or altered\); hint"):
        Verification(tmp_path, {"a.bin": sha256_file(a), "b.bin": "0" * 64}, "hint").wait()
    with pytest.raises(EngineError, match="c.bin cannot be read"):
        Verification(tmp_path, {"c.bin": "0" * 64}, "hint").wait()


# ---- format 1 manifests still load -----------------------------------------------------------
def test_format_1_manifest_still_loads(tiny_pair, tmp_path):
    dst = _copy(tmp_path, tiny_pair[2])

    def to_v1(raw):  # what the exporter before the files map wrote
        raw["format_version"] = 1
        del raw["files"]
        raw["extra"].pop("export")

    _edit(dst, to_v1)
    m = load_manifest(dst)
    assert m.format_version == 1 and m.files == {}
    assert set(m.load_files()) == {"draft.onnx", "target.onnx", "tokenizer.json", "chat_template.jinja"}  # the tiny target has a chat template
    assert (
        Engine(dst).generate("def f(x):", GenerationConfig(max_new_tokens=5)).tokens
        == Engine(tiny_pair[2]).generate("def f(x):", GenerationConfig(max_new_tokens=5)).tokens
    )
    data = bytearray((dst / "target.onnx").read_bytes())
    data[100] ^= 1
    (dst / "target.onnx").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="target.onnx does not match the SHA-256"):
        Engine(dst)
    # a format 2 manifest must carry the files map
    v2 = _edit(_copy(tmp_path, tiny_pair[2], "v2"), lambda r: r.pop("files"))
    with pytest.raises(EngineError, match=r"field files = \{\} is not allowed: an object listing every file of the engine"):
        Engine(v2)


# ---- manifest validation -----------------------------------------------------------------------
BAD_FIELDS = [
    (lambda r: r.update(draft="draft.onnx"), "draft", 'field draft = "draft.onnx" is not allowed: an object (ModelEntry: file, sha256, family, n_layers'),
    (lambda r: r.update(max_ctx="1024"), "max_ctx", 'field max_ctx = "1024" is not allowed: an integer'),
    (lambda r: r.update(defaults=[1, 2]), "defaults", "field defaults = [1, 2] is not allowed: an object"),
    (lambda r: r.update(max_ctx=1), "max_ctx", "field max_ctx = 1 is not allowed: an integer >= 2"),
    (lambda r: r.update(max_ctx=256.0), "max_ctx", "field max_ctx = 256.0 is not allowed: an integer"),
    (lambda r: r.update(k_max=300), "k_max", "field k_max = 300 is not allowed: an integer in k_min=1..64"),
    (lambda r: r.update(k_min=0), "k_min", "field k_min = 0 is not allowed: an integer in 1..64"),
    (lambda r: r.update(k_min=9), "k_max", "field k_max = 8 is not allowed: an integer in k_min=9..64"),
    (lambda r: r.update(bos_token_id="0"), "bos_token_id", 'field bos_token_id = "0" is not allowed: an integer or null'),
    (lambda r: r.update(add_bos=1), "add_bos", "field add_bos = 1 is not allowed: true or false"),
    (lambda r: r.update(eos_token_id=320), "eos_token_id", "field eos_token_id = 320 is not allowed: a token id in 0..319"),
    (lambda r: r["target"].update(n_layers=3), "target.inputs", "field target.inputs = "),
    (lambda r: r["target"].update(n_kv_heads=0), "target.n_kv_heads", "field target.n_kv_heads = 0 is not allowed: an integer >= 1"),
    (
        lambda r: r["draft"].update(parity={"logits_q1_L0": "small"}),
        "draft.parity.logits_q1_L0",
        'field draft.parity.logits_q1_L0 = "small" is not allowed: a number',
    ),
    (lambda r: r["draft"].pop("vocab_size"), "draft.vocab_size", "field draft.vocab_size is missing (required: int)"),
    (lambda r: r["draft"].update(sha256="abc"), "draft.sha256", 'field draft.sha256 = "abc" is not allowed: 64 lowercase hex digits'),
    (
        lambda r: r["draft"].update(file="../draft.onnx"),
        "draft.file",
        'field draft.file = "../draft.onnx" is not allowed: a file name inside the engine folder',
    ),
    (lambda r: r.update(kv_dtype="float16"), "kv_dtype", 'field kv_dtype = "float16" is not allowed: "float32"'),
    (
        lambda r: r["files"]["target.onnx"].update(bytes=-1),
        'files["target.onnx"].bytes',
        'field files["target.onnx"].bytes = -1 is not allowed: an integer >= 0',
    ),
    (
        lambda r: r["files"]["target.onnx"].update(bytes="12"),
        'files["target.onnx"].bytes',
        'field files["target.onnx"].bytes = "12" is not allowed: an integer',
    ),
    (lambda r: r["files"].pop("tokenizer.json"), "files", "a record for every file of the engine ('tokenizer.json' is missing)"),
    (lambda r: r["files"]["target.onnx"].update(external=["w.data"]), 'files["target.onnx"].external', "names of files listed in files ('w.data' is not)"),
    (lambda r: r.update(format_version=3), "format_version", "format_version=3, this runtime understands 1 and 2; re-run `specrt export"),
]


@pytest.mark.parametrize("edit, param, needle", BAD_FIELDS, ids=[b[1] + str(i) for i, b in enumerate(BAD_FIELDS)])
def test_bad_manifest_field_one_line(tiny_pair, edit, param, needle):
    raw = json.loads((tiny_pair[2] / "manifest.json").read_text())
    edit(raw)
    with pytest.raises(EngineError) as e:
        validate_manifest(raw, tiny_pair[2])
    msg = str(e.value)
    assert needle in msg, msg
    assert e.value.param == param
    assert "\n" not in msg and "Traceback" not in msg and msg.startswith(str(tiny_pair[2] / "manifest.json"))


def test_several_problems_are_counted(tiny_pair):
    raw = json.loads((tiny_pair[2] / "manifest.json").read_text())
    raw.update(max_ctx="1024", k_max="8", defaults=[1])
    with pytest.raises(EngineError, match=r"field max_ctx = \"1024\" is not allowed: an integer \(2 more problems after this one\)"):
        validate_manifest(raw, tiny_pair[2])


def test_unknown_optional_fields_are_accepted(tiny_pair, tmp_path):
    """Forward compatibility: a newer exporter's optional fields (per model or top level)
    do not stop this runtime."""
    dst = _edit(_copy(tmp_path, tiny_pair[2]), lambda r: (r["target"].update(graph_form="full", quality={"x": 1}), r.update(new_top_level=[1])))
    assert Engine(dst).manifest.target.n_layers == 2


def test_bad_manifest_cli_one_line(tiny_pair, tmp_path):
    for i, (edit, _, needle) in enumerate(BAD_FIELDS[:3]):
        dst = _edit(_copy(tmp_path, tiny_pair[2], f"c{i}"), edit)
        res = CliRunner().invoke(cli, ["generate", "--engines", str(dst), "--prompt", "x"])
        assert res.exit_code == 1 and needle in res.output and "Traceback" not in res.output
        assert res.output.count("\n") == 1  # "Error: <one line>"


# ---- the graphs against the manifest --------------------------------------------------------
@pytest.mark.parametrize(
    "role, field, value, needle",
    [
        ("target", "vocab_size", 400, "logits has shape [1, 'q', 320] in the graph, but the manifest's target.vocab_size=400 implies [1, ?, 400]"),
        ("draft", "head_dim", 8, "past_key_0 has shape [1, 'past', 1, 16] in the graph, but the manifest's draft.head_dim=8 implies [1, ?, 1, 8]"),
        ("target", "n_kv_heads", 4, "past_key_0 has shape [1, 'past', 1, 16] in the graph, but the manifest's target.n_kv_heads=4 implies [1, ?, 4, 16]"),
    ],
)
def test_graph_dims_checked_against_the_manifest(ext_pair, tmp_path, role, field, value, needle):
    dst = _edit(_copy(tmp_path, ext_pair[2]), lambda r: r[role].update({field: value}))
    with pytest.raises(EngineError) as e:
        Engine(dst)
    assert needle in str(e.value) and str(dst / f"{role}.onnx") in str(e.value)


def test_graph_layers_checked_against_the_manifest(ext_pair, tmp_path):
    from specrt.runtime.manifest import ModelEntry

    ins, outs = ModelEntry.io_names(2)

    def two_layers(r):
        r["draft"].update(n_layers=2, inputs=list(ins), outputs=list(outs))

    with pytest.raises(EngineError, match=r"draft.onnx: I/O names .* differ from the manifest's"):
        Engine(_edit(_copy(tmp_path, ext_pair[2]), two_layers))


# ---- strict JSON statistics -----------------------------------------------------------------
def test_no_speculation_stats_are_strict_json(tiny_pair):
    res = CliRunner().invoke(cli, ["generate", "--engines", str(tiny_pair[2]), "--prompt", "def f(x):", "--max-new-tokens", "6", "--no-speculation"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("{"))
    assert "NaN" not in line
    stats = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {line}"))
    assert stats["acceptance_rate"] is None and stats["new_tokens"] == 6


# ---- digest cache: verify once per file identity --------------------------------------------
def _fresh_cache(monkeypatch, tmp_path, racy_ns=50_000_000):
    """A persistent digest cache under tmp_path for this test, the process's caches
    forgotten (as in a new process), and a short racy window (files written by the test
    are recorded once ``racy_ns`` old; the test sleeps past it)."""
    from specrt.runtime import integrity

    path = tmp_path / "cache" / "digests.json"
    monkeypatch.setenv(integrity.CACHE_ENV, str(path))
    monkeypatch.setattr(integrity, "_CACHES", {})
    monkeypatch.setattr(integrity, "RACY_NS", racy_ns)
    return path


def _new_process(monkeypatch):
    """Forget the in-process caches: the next lookup reads the cache file."""
    from specrt.runtime import integrity

    monkeypatch.setattr(integrity, "_CACHES", {})


def _flip_keep_mtime(p, offset):
    """Flip one bit of ``p`` in place, then set atime/mtime back (os.utime): size and mtime
    are as before, only ctime (which user space cannot set) records the write."""
    st = p.stat()
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = p.stat()
    assert (st2.st_size, st2.st_mtime_ns, st2.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert st2.st_ctime_ns != st.st_ctime_ns
    return st, st2


def _digests(folder, names):
    return {n: sha256_file(folder / n) for n in names}


def test_digest_cache_hashes_each_file_identity_once(tmp_path, monkeypatch):
    path = _fresh_cache(monkeypatch, tmp_path)
    d = tmp_path / "f"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a" * (9 << 20))
    (d / "b.bin").write_bytes(b"b" * 100)
    want = _digests(d, ["a.bin", "b.bin"])
    time.sleep(0.1)  # past the racy window
    v = Verification(d, want, "hint")
    v.wait()
    assert sorted(v.hashed) == ["a.bin", "b.bin"] and v.cached == []
    raw = json.loads(path.read_text())
    assert raw["format"] == 1 and sorted(e["sha256"] for e in raw["entries"].values()) == sorted(want.values())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    v = Verification(d, want, "hint")  # same process
    v.wait()
    assert v.hashed == [] and sorted(v.cached) == ["a.bin", "b.bin"]
    _new_process(monkeypatch)  # the next process reads the file
    v = Verification(d, want, "hint")
    v.wait()
    assert v.hashed == [] and sorted(v.cached) == ["a.bin", "b.bin"]
    # a recorded digest counts only when it is the manifest's
    v = Verification(d, {"a.bin": want["b.bin"]}, "hint")
    assert v.hashed == ["a.bin"]
    with pytest.raises(EngineError, match="a.bin does not match the SHA-256"):
        v.wait()


def test_flipped_byte_refused_after_a_cached_load(ext_pair, tmp_path, monkeypatch):
    """A load records the digests; a bit flipped afterwards (mtime set back with os.utime,
    size unchanged) is refused by the next load, in this process and in the next."""
    _fresh_cache(monkeypatch, tmp_path)
    dst = _copy(tmp_path, ext_pair[2])
    time.sleep(0.1)
    Engine(dst).close()
    from specrt.runtime.manifest import load_manifest as lm

    names = list(lm(dst, verify_hashes=False).load_files())
    v = Verification(dst, {n: lm(dst, verify_hashes=False).files[n].sha256 for n in names}, "hint")
    v.wait()
    assert v.hashed == [] and sorted(v.cached) == sorted(names)  # the load was cached
    p = dst / "target.onnx.data"
    _flip_keep_mtime(p, p.stat().st_size // 2)
    for fresh in (False, True):
        if fresh:
            _new_process(monkeypatch)
        with pytest.raises(EngineError) as e:
            Engine(dst)
        assert str(e.value).startswith(f"{p} does not match the SHA-256 recorded in the manifest") and "\n" not in str(e.value)


def test_truncated_file_refused_after_a_cached_load(tmp_path, monkeypatch):
    _fresh_cache(monkeypatch, tmp_path)
    d = tmp_path / "f"
    d.mkdir()
    p = d / "w.bin"
    p.write_bytes(bytes(range(256)) * 4096)
    want = _digests(d, ["w.bin"])
    time.sleep(0.1)
    Verification(d, want, "hint").wait()
    assert Verification(d, want, "hint").cached == ["w.bin"]
    st = p.stat()
    with open(p, "r+b") as f:  # truncated, then grown back to the same size (zeros)
        f.truncate(st.st_size - 4096)
        f.truncate(st.st_size)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (p.stat().st_size, p.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    v = Verification(d, want, "hint")
    assert v.hashed == ["w.bin"]
    with pytest.raises(EngineError, match="w.bin does not match the SHA-256"):
        v.wait()
    with open(p, "r+b") as f:  # plainly truncated: the size check refuses it before any read
        f.truncate(st.st_size - 4096)
    with pytest.raises(EngineError, match=f"w.bin has {st.st_size - 4096} bytes, the manifest records {st.st_size}"):
        check_present(d, {"w.bin": type("R", (), {"bytes": st.st_size})()}, "hint")


def test_wrong_digest_in_the_cache_file_lets_nothing_through(tmp_path, monkeypatch):
    """The cache file records the altered file's identity with a digest that is not the
    manifest's (its own digest, or garbage): the file is hashed and refused. Records that
    do not parse are skipped."""
    path = _fresh_cache(monkeypatch, tmp_path)
    d = tmp_path / "f"
    d.mkdir()
    p = d / "w.bin"
    p.write_bytes(b"good" * 1000)
    want = _digests(d, ["w.bin"])
    p.write_bytes(b"evil" * 1000)
    time.sleep(0.1)
    ident = ":".join(str(x) for x in file_identity(p.stat()))
    for wrong in (sha256_file(p), "0" * 64, want["w.bin"].upper(), want["w.bin"][:-1]):
        _new_process(monkeypatch)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"format": 1, "entries": {ident: {"sha256": wrong, "path": str(p)}}}))
        path.chmod(0o600)
        v = Verification(d, want, "hint")
        assert v.hashed == ["w.bin"]
        with pytest.raises(EngineError, match="w.bin does not match the SHA-256"):
            v.wait()


@pytest.mark.parametrize("content", [b"", b"\x00\xff garbage", b"[1, 2]", b'{"format": 1, "entries": []}', b'{"format": 9, "entries": {}}'])
def test_corrupted_cache_file_is_ignored_and_replaced(tmp_path, monkeypatch, content):
    path = _fresh_cache(monkeypatch, tmp_path)
    d = tmp_path / "f"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a" * 1000)
    want = _digests(d, ["a.bin"])
    time.sleep(0.1)
    path.parent.mkdir()
    path.write_bytes(content)
    path.chmod(0o600)
    v = Verification(d, want, "hint")
    assert v.hashed == ["a.bin"]
    v.wait()
    assert list(json.loads(path.read_text())["entries"].values())[0]["sha256"] == want["a.bin"]


def test_cache_file_writable_by_others_is_not_trusted(tmp_path, monkeypatch):
    path = _fresh_cache(monkeypatch, tmp_path)
    d = tmp_path / "f"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a" * 1000)
    want = _digests(d, ["a.bin"])
    time.sleep(0.1)
    Verification(d, want, "hint").wait()
    path.chmod(0o666)
    before = path.read_bytes()
    _new_process(monkeypatch)
    v = Verification(d, want, "hint")
    assert v.hashed == ["a.bin"]  # not read ...
    v.wait()
    assert path.read_bytes() == before  # ... nor replaced


def test_recent_files_are_not_recorded(tmp_path, monkeypatch):
    """git's racily-clean rule: a file whose ctime is within RACY_NS of the read could be
    written again in the same clock tick without a new identity, so its digest is not
    recorded (default window: 2 s)."""
    from specrt.runtime import integrity

    _fresh_cache(monkeypatch, tmp_path, racy_ns=integrity.RACY_NS)
    d = tmp_path / "f"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a" * 1000)
    want = _digests(d, ["a.bin"])
    Verification(d, want, "hint").wait()
    assert Verification(d, want, "hint").hashed == ["a.bin"]


def test_cache_off_and_default_location(tmp_path, monkeypatch):
    from specrt.runtime import integrity

    monkeypatch.setattr(integrity, "_CACHES", {})
    monkeypatch.setattr(integrity, "RACY_NS", 0)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(integrity.CACHE_ENV, "off")
    assert integrity.cache_path() is None and integrity.digest_cache() is None
    d = tmp_path / "f"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a" * 1000)
    want = _digests(d, ["a.bin"])
    time.sleep(0.05)
    for _ in range(2):
        v = Verification(d, want, "hint")
        v.wait()
        assert v.hashed == ["a.bin"]  # off: every load hashes every byte
    assert not (tmp_path / "home").exists()
    monkeypatch.delenv(integrity.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert integrity.cache_path() == tmp_path / "xdg" / "specrt" / "digests.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert integrity.cache_path() == tmp_path / "home" / ".cache" / "specrt" / "digests.json"
    Verification(d, want, "hint").wait()
    assert (tmp_path / "home" / ".cache" / "specrt" / "digests.json").is_file()
