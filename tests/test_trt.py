"""GPU backends on CPU: TensorRT profiles and shape validation, KV offsets, the precision
and dummy-row ONNX rewrites, the manifest's TensorRT record, and the call sequences of
the plan builder and of TrtModel against stand-ins for ``tensorrt`` and
``cuda.bindings.runtime`` (tests/fake_gpu.py) that execute the ONNX with onnxruntime and
refuse what TensorRT / CUDA document as refused (misaligned tensor addresses, shapes
outside the profile, a profile another context holds, bad 2D copies). Also: every address
aligned at every L, close() frees everything, TensorRT < 10.1 refused, ort-cuda fork/close.

Tests marked ``gpu`` need a real NVIDIA GPU with tensorrt / onnxruntime-gpu and
cuda-python; they skip elsewhere (nothing in this file has been run on a GPU yet).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import fake_gpu
import numpy as np
import pytest

from specrt.runtime.backends.cuda_mem import CudaRuntime
from specrt.runtime.backends.kv_layout import ALIGN, KVLayout, align_up
from specrt.runtime.backends.profiles import (
    DimRange,
    Profile,
    ProfileConfig,
    ProfileSet,
    check_engine_profiles,
    draft_profiles,
    target_profiles,
)
from specrt.runtime.errors import BackendError, EngineError, InputError
from specrt.runtime.manifest import FORMAT_VERSION, load_manifest

PREFILL = 256


# ----------------------------------------------------------------------------- profiles


@pytest.mark.parametrize("k_max", [1, 2, 4, 8, 16])
def test_target_has_one_exact_verify_profile_per_k(k_max):
    ps = target_profiles(ProfileConfig(k_max=k_max, max_ctx=1024, prefill_q=PREFILL))
    names = [p.name for p in ps.profiles]
    assert names == ["decode"] + [f"verify_k{k}" for k in range(1, k_max + 1)] + ["prefill"]
    for k in range(1, k_max + 1):
        p = ps.profiles[k]
        assert p.q.triple() == (k + 1, k + 1, k + 1)
        assert p.past.min == 0 and p.past.max == 1024 - (k + 1)
        for past in (0, 1, 500, 1024 - (k + 1)):
            assert ps.select(k + 1, past) == k, (k, past)
    assert ps.select(1, 0) == 0 and ps.select(1, 1023) == 0  # decode, q = 1
    assert ps.profiles[-1].q.triple() == (1, 128, PREFILL)
    assert ps.select(k_max + 2, 0) == len(ps.profiles) - 1  # wider than any verify -> prefill
    assert ps.select(PREFILL, 1024 - PREFILL) == len(ps.profiles) - 1


def test_draft_profiles_decode_and_prefill():
    ps = draft_profiles(ProfileConfig(k_max=8, max_ctx=512, prefill_q=PREFILL))
    assert [(p.name, p.q.triple()) for p in ps.profiles] == [("decode", (1, 1, 2)), ("prefill", (1, 128, PREFILL))]
    assert ps.select(1, 100) == 0 and ps.select(2, 100) == 0
    assert ps.select(3, 100) == 1 and ps.select(PREFILL, 0) == 1
    assert ps.max_q == PREFILL


def test_profile_shapes_with_and_without_pad():
    p = Profile("verify_k3", DimRange(4, 4, 4), DimRange(0, 10, 20))
    names = ["input_ids", "position_ids", "past_key_0", "past_value_0"]
    s = p.shapes(names, n_kv_heads=2, head_dim=16)
    assert s["input_ids"] == ((1, 4), (1, 4), (1, 4))
    assert s["past_value_0"] == ((1, 0, 2, 16), (1, 10, 2, 16), (1, 20, 2, 16))
    s1 = p.shapes(names, 2, 16, pad=1)
    assert s1["past_key_0"] == ((1, 1, 2, 16), (1, 11, 2, 16), (1, 21, 2, 16))
    assert s1["position_ids"] == s["position_ids"]
    with pytest.raises(ValueError, match="not part of the IO-bound KV interface"):
        p.shapes(["attention_mask"], 2, 16)


@pytest.mark.parametrize(
    "q, past, needle",
    [
        (0, 0, "input 'input_ids' shape (1, 0), engine supports [min, opt, max] = decode: [1, 1, 1]; verify_k1: [2, 2, 2]"),
        (300, 0, "input 'input_ids' shape (1, 300), engine supports [min, opt, max] ="),
        (3, 1022, "q=3 new tokens after past length 1022 need 1025 KV rows; past + q must be <= max_ctx=1024"),
        (2, -1, "input 'past_key_0' holds past length -1 (shape axis 1 = -1) with q=2, engine supports past [min, opt, max] = verify_k1: [0, 512, 1022]"),
    ],
)
def test_select_refuses_with_input_and_allowed_range(q, past, needle):
    ps = target_profiles(ProfileConfig(k_max=4, max_ctx=1024, prefill_q=PREFILL))
    with pytest.raises(InputError) as e:
        ps.select(q, past)
    assert needle in str(e.value)
    assert str(e.value).startswith("target engine:")


def test_bad_ranges_and_configs():
    with pytest.raises(ValueError, match="0 <= min <= opt <= max"):
        DimRange(2, 1, 3)
    with pytest.raises(ValueError, match="k_max=0"):
        ProfileConfig(k_max=0, max_ctx=64, prefill_q=8)
    with pytest.raises(ValueError, match="too small"):
        ProfileConfig(k_max=8, max_ctx=9, prefill_q=8)
    with pytest.raises(ValueError, match="pad=2"):
        ProfileConfig(k_max=2, max_ctx=64, prefill_q=8, pad=2)


def test_profile_set_json_round_trip_and_malformed():
    ps = target_profiles(ProfileConfig(k_max=3, max_ctx=300, prefill_q=64, pad=1))
    back = ProfileSet.from_json(json.loads(json.dumps(ps.to_json())))
    assert back == ps and back.pad == 1 and back.select(4, 5) == ps.select(4, 5)
    with pytest.raises(EngineError, match="rebuild the TensorRT plans"):
        ProfileSet.from_json({"role": "target", "max_ctx": 300, "profiles": [{"name": "x", "q": [3, 1, 2], "past": [0, 0, 0]}]})


def test_check_engine_profiles_catches_a_different_plan():
    ps = draft_profiles(ProfileConfig(k_max=2, max_ctx=64, prefill_q=16))
    names = ["input_ids", "position_ids", "past_key_0", "past_value_0"]
    good = [p.shapes(names, 1, 8) for p in ps.profiles]
    check_engine_profiles(ps, good, names, 1, 8)
    with pytest.raises(EngineError, match="has 1 optimization profiles, the manifest records 2"):
        check_engine_profiles(ps, good[:1], names, 1, 8)
    bad = [dict(good[0]), good[1]]
    bad[0]["input_ids"] = ((1, 1), (1, 1), (1, 3))
    with pytest.raises(EngineError, match="profile 0 \\(decode\\) input 'input_ids'"):
        check_engine_profiles(ps, bad, names, 1, 8)


# ---------------------------------------------------------------------------- KV layout


@pytest.mark.parametrize("pad", [0, 1])
def test_kv_layout_offsets(pad):
    lay = KVLayout(n_layers=3, n_kv_heads=2, head_dim=16, max_ctx=100, pad=pad)
    assert lay.row_bytes == 2 * 16 * 4
    assert lay.buffer_bytes == (100 + pad) * 128
    assert lay.stride % ALIGN == 0 and lay.stride >= lay.buffer_bytes
    bases = lay.buffer_bases(4096)
    assert len(bases) == 6 and bases[0] == 4096 and all(b - a == lay.stride for a, b in zip(bases, bases[1:]))
    assert lay.total_bytes == 6 * lay.stride
    assert lay.names()[:3] == [("past_key_0", "new_key_0"), ("past_value_0", "new_value_0"), ("past_key_1", "new_key_1")]
    for L in (0, 1, 37, 99):
        assert lay.new_offset(L) == (pad + L) * 128  # = base + L * stride of one row, after the dummy rows
        assert lay.past_shape(L) == (1, pad + L, 2, 16)
    assert lay.new_shape(5) == (1, 5, 2, 16)
    assert align_up(1) == 256 and align_up(256) == 256 and align_up(257) == 512


# ------------------------------------------------------------------- ONNX rewrites (CPU)


def _feeds(entry, past, q, pad=0, seed=0, dummy=0.0):
    rng = np.random.default_rng(seed)
    f = {
        "input_ids": rng.integers(0, entry.vocab_size, (1, q)).astype(np.int64),
        "position_ids": np.arange(past, past + q, dtype=np.int64)[None],
    }
    for i in range(entry.n_layers):
        for kind in ("key", "value"):
            x = rng.standard_normal((1, past, entry.n_kv_heads, entry.head_dim)).astype(np.float32)
            if pad:
                x = np.concatenate([np.full((1, pad, entry.n_kv_heads, entry.head_dim), dummy, np.float32), x], axis=1)
            f[f"past_{kind}_{i}"] = x
    return f


@pytest.fixture(scope="module")
def target_onnx(tiny_pair):
    import onnx

    folder = tiny_pair[2]
    m = load_manifest(folder)
    return onnx.load(str(folder / m.target.file)), m.target


def _session(model):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_precision_rewrite_wiring_runs_in_float64(target_onnx):
    from specrt.export.onnx_precision import convert_precision

    model, entry = target_onnx
    conv = convert_precision(model, "fp64")  # "low" = float64: CPU kernels exist for it
    assert [i.type.tensor_type.elem_type for i in conv.graph.input] == [i.type.tensor_type.elem_type for i in model.graph.input]
    assert [o.type.tensor_type.elem_type for o in conv.graph.output] == [1] * len(model.graph.output)  # float32 I/O
    a, b = _session(model), _session(conv)
    for past, q in ((0, 3), (37, 9), (100, 1)):
        f = _feeds(entry, past, q, seed=past)
        for x, y in zip(a.run(None, f), b.run(None, f)):
            assert y.dtype == np.float32
            np.testing.assert_allclose(y, x, atol=2e-5, rtol=1e-5)


def test_fp16_rewrite_types_and_numerics(target_onnx):
    from onnx import TensorProto

    from specrt.export.onnx_precision import FP32_OPS, convert_precision

    model, entry = target_onnx
    conv = convert_precision(model, "fp16")
    dtypes = {t.data_type for t in conv.graph.initializer}
    assert TensorProto.FLOAT16 in dtypes
    n_fp32 = sum(t.data_type == TensorProto.FLOAT for t in conv.graph.initializer)
    assert n_fp32 <= 4  # only constants read by fp32-region nodes (RoPE inv_freq, eps ...)
    assert any(n.op_type in FP32_OPS for n in conv.graph.node)
    try:
        sess = _session(conv)
    except Exception as e:  # noqa: BLE001 - missing fp16 kernels on this CPU build
        pytest.skip(f"onnxruntime CPU cannot run this fp16 graph here: {str(e)[:120]}")
    f = _feeds(entry, 37, 5, seed=3)
    ref = _session(model).run(None, f)
    got = sess.run(None, f)
    scale = float(np.abs(ref[0]).max())
    assert np.abs(got[0] - ref[0]).max() < 2e-2 * scale
    assert int(np.argmax(got[0][0, -1])) == int(np.argmax(ref[0][0, -1]))


def test_bf16_rewrite_is_valid_onnx_and_rounds_to_nearest_even(target_onnx):
    from onnx import TensorProto

    from specrt.export.onnx_precision import convert_precision, float32_to_bf16_bits

    conv = convert_precision(target_onnx[0], "bf16")  # onnx.checker runs inside
    assert TensorProto.BFLOAT16 in {t.data_type for t in conv.graph.initializer}
    x = np.array([1.0, -2.0, np.inf, -np.inf, 1.00390625, 1.01171875, np.nan], np.float32)
    bits = float32_to_bf16_bits(x)
    assert list(bits[:4]) == [0x3F80, 0xC000, 0x7F80, 0xFF80]
    assert bits[4] == 0x3F80  # 1 + 2^-8: halfway, ties to even (down)
    assert bits[5] == 0x3F82  # 1 + 3*2^-8: halfway, ties to even (up)
    assert (bits[6] & 0x7F80) == 0x7F80 and (bits[6] & 0x7F) != 0  # NaN stays NaN


def test_past_pad_rewrite_is_exact_whatever_the_dummy_row_holds(target_onnx):
    from specrt.export.onnx_precision import add_past_pad

    model, entry = target_onnx
    padded = _session(add_past_pad(model, 1))
    plain = _session(model)
    for past, q, dummy in ((0, 4, np.nan), (37, 3, 1e4), (5, 1, -3.0)):
        ref = plain.run(None, _feeds(entry, past, q, seed=past))
        got = padded.run(None, _feeds(entry, past, q, pad=1, seed=past, dummy=dummy))
        for x, y in zip(ref, got):
            np.testing.assert_array_equal(x, y)


# -------------------------------------------------- plan builder (fake tensorrt), manifest


@pytest.fixture
def engine_copy(tiny_pair, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny_pair[2], dst)
    return dst


def _build(folder, trt, verify=True, **cfg):
    from specrt.export.trt_build import TrtBuildConfig, build_plans

    m = build_plans(folder, load_manifest(folder, verify_hashes=verify), TrtBuildConfig(**cfg), trt=trt, log=lambda *_: None)
    m.write(folder)
    return m


def test_build_plans_call_sequence_and_manifest_record(engine_copy):
    log = []
    cuda = fake_gpu.FakeCuda(log)
    trt = fake_gpu.FakeTRT(log, cuda)
    before = load_manifest(engine_copy)
    _build(engine_copy, trt, precision="fp16")
    m = load_manifest(engine_copy)  # the CPU loader accepts the extra, format unchanged
    assert m.format_version == FORMAT_VERSION == before.format_version
    assert (m.draft, m.target, m.k_max, m.max_ctx) == (before.draft, before.target, before.k_max, before.max_ctx)
    rec = m.extra["tensorrt"]
    assert rec["precision"] == "fp16" and rec["strongly_typed"] and rec["past_pad"] == 0
    for role, n_prof in (("draft", 2), ("target", m.k_max + 2)):
        r = rec["models"][role]
        assert r["onnx"] == f"{role}.fp16.onnx" and r["plan"] == f"{role}.fp16.plan"
        assert (engine_copy / r["plan"]).is_file() and (engine_copy / r["onnx"]).is_file()
        assert len(r["profiles"]["profiles"]) == n_prof
    # strongly typed network (1 << STRONGLY_TYPED), both parsed from the fp16 ONNX
    assert [e for e in log if e[0] == "builder.create_network"] == [("builder.create_network", 2)] * 2
    assert [Path(e[1]).name for e in log if e[0] == "parser.parse_from_file"] == ["draft.fp16.onnx", "target.fp16.onnx"]
    assert [e[1] for e in log if e[0] == "builder.build_serialized_network"] == [2, m.k_max + 2]
    shapes = [e for e in log if e[0] == "profile.set_shape"]
    n_in = len(m.target.inputs)
    assert len(shapes) == 2 * len(m.draft.inputs) + (m.k_max + 2) * n_in  # every input, every profile
    verify3 = shapes[2 * len(m.draft.inputs) + 3 * n_in : 2 * len(m.draft.inputs) + 4 * n_in]
    assert verify3[0] == ("profile.set_shape", "input_ids", (1, 4), (1, 4), (1, 4))
    h, d = m.target.n_kv_heads, m.target.head_dim
    assert ("profile.set_shape", "past_key_0", (1, 0, h, d), (1, m.max_ctx // 2, h, d), (1, m.max_ctx - 4, h, d)) in verify3


def test_build_records_tensorrt10_flags_pool_and_a_profile_for_every_q(engine_copy):
    """What build_plans asks of TensorRT: a strongly typed network (1 << STRONGLY_TYPED, no
    EXPLICIT_BATCH), the workspace pool limit, and per model one profile per use such that
    every call width q = 1..k_max+1 has a profile tuned exactly for it (the target) and every
    width up to the prefill chunk is accepted; the plan then loads with those profiles."""
    log = []
    trt = fake_gpu.FakeTRT(log, fake_gpu.FakeCuda(log))
    m = _build(engine_copy, trt, precision="fp16", workspace_gb=2.0, prefill_q=64)
    assert [e for e in log if e[0] == "builder.create_network"] == [("builder.create_network", 1 << 1)] * 2
    assert [e for e in log if e[0] == "config.set_memory_pool_limit"] == [("config.set_memory_pool_limit", "WORKSPACE", 2 << 30)] * 2
    built, cur = [], []
    for e in log:  # input_ids (min, opt, max) of every profile, per built model
        if e[0] == "profile.set_shape" and e[1] == "input_ids":
            cur.append((e[2][1], e[3][1], e[4][1]))
        elif e[0] == "builder.build_serialized_network":
            assert e[1] == len(cur)
            built.append(cur)
            cur = []
    draft, target = built
    assert target == [(1, 1, 1)] + [(q, q, q) for q in range(2, m.k_max + 2)] + [(1, 64, 64)]
    assert draft == [(1, 1, 2), (1, 64, 64)]
    for q in range(1, m.k_max + 2):
        assert sum(t == (q, q, q) for t in target) == 1  # exactly one profile tuned for each verification width
    for q in range(1, 65):
        assert any(a <= q <= b for a, _, b in target) and any(a <= q <= b for a, _, b in draft)
    adds = [e[1] for e in log if e[0] == "config.add_optimization_profile"]
    assert adds == list(range(len(draft))) + list(range(len(target)))
    rec = m.extra["tensorrt"]["models"]["target"]
    plan = json.loads((engine_copy / rec["plan"]).read_text())  # the stand-in's plan: what the builder was given
    assert [p["input_ids"] for p in plan["profiles"]] == [[[1, a], [1, o], [1, b]] for a, o, b in target]


def test_manifest_with_trt_record_serves_unchanged_on_ort_cpu(engine_copy, tiny_pair):
    from specrt import Engine, GenerationConfig

    log = []
    _build(engine_copy, fake_gpu.FakeTRT(log, fake_gpu.FakeCuda(log)), precision="fp32")
    a = Engine(tiny_pair[2], backend="ort-cpu").generate("def add(a, b):", GenerationConfig(max_new_tokens=16, k_max=4))
    e = Engine(engine_copy, backend="ort-cpu")
    assert e.backend == "ort-cpu" and "tensorrt" in e.manifest.extra
    assert e.generate("def add(a, b):", GenerationConfig(max_new_tokens=16, k_max=4)).tokens == a.tokens


def test_plans_up_to_date_detects_changes(engine_copy):
    from specrt.export.trt_build import TrtBuildConfig, plans_up_to_date

    log = []
    trt = fake_gpu.FakeTRT(log, fake_gpu.FakeCuda(log))
    assert not plans_up_to_date(engine_copy, load_manifest(engine_copy), TrtBuildConfig(), trt.__version__)
    m = _build(engine_copy, trt, precision="fp16")
    assert plans_up_to_date(engine_copy, m, TrtBuildConfig(precision="fp16"), trt.__version__)
    assert not plans_up_to_date(engine_copy, m, TrtBuildConfig(precision="bf16"), trt.__version__)
    assert not plans_up_to_date(engine_copy, m, TrtBuildConfig(precision="fp16"), "11.0")
    (engine_copy / "target.fp16.plan").write_bytes(b"x")
    assert not plans_up_to_date(engine_copy, m, TrtBuildConfig(precision="fp16"), trt.__version__)


def test_build_without_strongly_typed_flag_and_build_failures(engine_copy):
    from specrt.export.trt_build import TrtBuildError, network_flags

    class Old:
        class NetworkDefinitionCreationFlag:
            EXPLICIT_BATCH = 0

    assert network_flags(Old) == 0
    log = []
    with pytest.raises(TrtBuildError, match="failed to build a plan"):
        _build(engine_copy, fake_gpu.FakeTRT(log, fake_gpu.FakeCuda(log), fail_build=True), precision="fp32")
    (engine_copy / "draft.onnx").write_bytes(b"not onnx")  # fp32 + pad 0: parsed as is
    with pytest.raises(TrtBuildError, match="TensorRT cannot parse"):
        _build(engine_copy, fake_gpu.FakeTRT(log, fake_gpu.FakeCuda(log)), verify=False, precision="fp32")
    assert "tensorrt" not in load_manifest(engine_copy, verify_hashes=False).extra


def test_build_skips_plainly_without_tensorrt(engine_copy, capsys):
    from click.testing import CliRunner

    from specrt.cli import cli
    from specrt.export.trt_build import tensorrt_hook, tensorrt_unavailable

    if tensorrt_unavailable() is None:
        pytest.skip("this machine can build TensorRT plans")
    msgs = []
    m = load_manifest(engine_copy)
    assert tensorrt_hook(engine_copy, m, "fp16", msgs.append) is m
    assert msgs and msgs[0].startswith("TensorRT plans: skipped (")
    r = CliRunner().invoke(cli, ["plans", "--engines", str(engine_copy), "--if-available"])
    assert r.exit_code == 0 and r.output.startswith("TensorRT plans: skipped (") and len(r.output.splitlines()) == 1, r.output
    r = CliRunner().invoke(cli, ["plans", "--engines", str(engine_copy)])
    assert r.exit_code == 2 and "TensorRT plans: skipped" in r.output


# ----------------------------------------------------- TrtModel against the stand-ins


@pytest.fixture(scope="module")
def mixed_pair(tmp_path_factory):
    """Engine folder with the default pair's two KV row shapes: the target's rows are
    1 KV head x 64 = 256 bytes (written in place), the draft's 2 KV heads x 48 = 384 bytes
    (not 256-aligned: staged). The tiny pair's rows (128 and 64 bytes) are both staged."""
    pytest.importorskip("torch")
    from helpers import make_tokenizer, save_llama

    from specrt.export.pipeline import export_pair

    root = tmp_path_factory.mktemp("mixed")
    tok = make_tokenizer()
    save_llama(root / "target", tok, seed=11, hidden=64, layers=2, heads=1, kv_heads=1)
    save_llama(root / "draft", tok, seed=12, hidden=96, layers=1, heads=2, kv_heads=2, inter=64)
    export_pair(root / "draft", root / "target", root / "engine", k_max=8, max_ctx=256, log=lambda *_: None, lazy_head=False)
    return root / "engine"


@pytest.fixture
def mixed_copy(mixed_pair, tmp_path):
    dst = tmp_path / "mixed"
    shutil.copytree(mixed_pair, dst)
    return dst


def _trt_model(folder, role, pad=0, log=None, max_q=PREFILL, prefill_q=PREFILL):
    from specrt.runtime.backends.trt import TrtModel

    log = [] if log is None else log
    cuda = fake_gpu.FakeCuda(log)
    trt = fake_gpu.FakeTRT(log, cuda)
    m = load_manifest(folder)
    _build(folder, trt, precision="fp32", past_pad=pad, prefill_q=prefill_q)
    rec = load_manifest(folder).extra["tensorrt"]["models"][role]
    entry = getattr(m, role)
    model = TrtModel(folder / rec["plan"], entry, ProfileSet.from_json(rec["profiles"]), max_q, trt=trt, cuda=CudaRuntime(cuda))
    return model, m, log


def _refusals(log):
    return [e for e in log if e[0] == "refused"]


def test_trt_model_setup_sequence(engine_copy):
    model, m, log = _trt_model(engine_copy, "target")
    cuda = model.cuda.rt
    n_prof = m.k_max + 2
    ctxs = [e for e in log if e[0] == "engine.create_execution_context"]
    assert ctxs == [("engine.create_execution_context", "USER_MANAGED")] * n_prof
    mem = [e for e in log if e[0] == "ctx.set_device_memory"]
    assert len(mem) == n_prof and len({(e[2], e[3]) for e in mem}) == 1  # one shared scratch
    sizes = [model.engine.get_device_memory_size_for_profile_v2(i) for i in range(n_prof)]
    assert len(set(sizes)) > 1  # the engine reports a different size per profile ...
    assert mem[0][3] == model.scratch_bytes == max(sizes)  # ... and the scratch is the largest
    assert cuda.device[mem[0][2]] >= max(sizes) and mem[0][2] % ALIGN == 0
    prof = [e for e in log if e[0] == "ctx.set_optimization_profile_async"]
    assert [e[2] for e in prof] == list(range(n_prof)) and {e[3] for e in prof} == {model.stream}
    # constant addresses, bound once at load: past inputs at the buffer bases, ids and
    # positions in two aligned rows, new-KV outputs at the staging buffers (128-byte rows)
    addr = [e for e in log if e[0] == "ctx.set_tensor_address"]
    assert all(e[3] % ALIGN == 0 for e in addr) and not _refusals(log)
    past_addr = [e for e in addr if e[2].startswith("past_")]
    assert len(past_addr) == n_prof * 2 * m.target.n_layers
    assert {e[3] for e in past_addr if e[2] == "past_value_1"} == {model.kv_bases[3]}
    assert {e[3] for e in addr if e[2] == "position_ids"} == {model.d_pos} and model.d_pos - model.d_ids == align_up(8 * model.max_q)
    assert not model.in_place and {e[3] for e in addr if e[2] == "new_value_1"} == {model.stage_bases[3]}


def _per_call(log, model, q, L, profile):
    """Common checks of one run's log; returns (per-call addresses, copies)."""
    i = [p.name for p in model.profiles.profiles].index(profile)
    assert {e[1] for e in log if e[0].startswith("ctx.")} == {id(model.contexts[i])}, "only the selected profile's context is used"
    lay = model.layout
    shapes = {e[2]: e[3] for e in log if e[0] == "ctx.set_input_shape"}
    assert shapes["input_ids"] == shapes["position_ids"] == (1, q)
    assert all(shapes[p] == lay.past_shape(L) for p, _ in lay.names())
    assert [e[0] for e in log].count("ctx.execute_async_v3") == 1
    assert [e[0] for e in log].count("cudaStreamSynchronize") == 1
    assert not any(e[0].startswith("cudaMalloc") for e in log), "no allocation on the hot path"
    assert not _refusals(log)
    addr = {e[2]: e[3] for e in log if e[0] == "ctx.set_tensor_address"}
    copies = [e for e in log if e[0].startswith("cudaMemcpy")]
    return addr, copies


CALLS = ((1, 0, "decode"), (5, 10, "verify_k4"), (9, 21, "verify_k8"), (30, 43, "prefill"), (2, 71, "verify_k1"), (3, 1, "verify_k2"))


@pytest.mark.parametrize("pad", [0, 1])
def test_trt_model_call_sequence_staged_rows(engine_copy, pad):
    model, m, log = _trt_model(engine_copy, "target", pad=pad)
    lay, V = model.layout, m.target.vocab_size
    assert lay.row_bytes % ALIGN and not model.in_place
    for q, L, profile in CALLS:
        del log[:]
        model.run(list(range(1, q + 1)), L)
        addr, copies = _per_call(log, model, q, L, profile)
        assert addr == {}, "every address is constant: set once at load"
        assert copies == [
            ("cudaMemcpy2DAsync", "H2D", 8 * q, 2),  # ids and positions, one copy, two aligned rows
            ("cudaMemcpy2DAsync", "D2D", q * lay.row_bytes, 2 * lay.n_layers),  # new rows: staging -> base + (pad+L)*row
            ("cudaMemcpyAsync", "D2H", 4 * q * V),  # only the q logits rows
        ]


@pytest.mark.parametrize("pad", [0, 1])
def test_trt_model_call_sequence_in_place_rows(mixed_copy, pad):
    model, m, log = _trt_model(mixed_copy, "target", pad=pad)
    lay, V = model.layout, m.target.vocab_size
    assert lay.row_bytes == 256 and model.in_place and model.stage_bases == []
    for q, L, profile in CALLS:
        del log[:]
        model.run(list(range(1, q + 1)), L)
        addr, copies = _per_call(log, model, q, L, profile)
        assert addr == {new: base + (pad + L) * lay.row_bytes for (_, new), base in zip(lay.names(), model.kv_bases)}
        assert all(a % ALIGN == 0 for a in addr.values())
        assert copies == [("cudaMemcpy2DAsync", "H2D", 8 * q, 2), ("cudaMemcpyAsync", "D2H", 4 * q * V)]


def test_stand_in_refuses_misaligned_addresses_shapes_and_a_taken_profile(engine_copy):
    model, m, log = _trt_model(engine_copy, "draft")
    lay, ctx = model.layout, model.contexts[0]
    assert lay.row_bytes == 64
    # the old binding: positions at arange + 8*L, new rows at base + L*row_bytes
    assert ctx.set_tensor_address("position_ids", model.d_pos + 8) is False
    assert ctx.set_tensor_address("new_key_0", model.kv_bases[0] + lay.new_offset(1)) is False
    assert ctx.addresses["position_ids"] == model.d_pos and ctx.addresses["new_key_0"] == model.stage_bases[0]
    assert [e[1] for e in _refusals(log)] == ["address not 256-byte aligned"] * 2
    assert ctx.set_tensor_address("position_ids", model.d_pos) is True
    assert ctx.set_input_shape("input_ids", (1, 3)) is False  # the draft's decode profile takes q <= 2
    # one context per profile: a second context of the same engine can take none of them
    other = model.engine.create_execution_context(fake_gpu.FakeTRT.ExecutionContextAllocationStrategy.USER_MANAGED)
    assert all(other.set_optimization_profile_async(i, model.stream) is False for i in range(len(model.contexts)))
    assert other.set_input_shape("input_ids", (1, 1)) is False  # no profile selected
    del other
    np.testing.assert_array_equal(model.run([5, 6], 0), model.run([5, 6], 0))  # still serves
    with pytest.raises(BackendError, match="cannot fork a model: TensorRT allows one execution context per optimization profile"):
        model.fork()


def test_stand_in_cuda_enforces_its_documented_refusals():
    log = []
    cuda = fake_gpu.FakeCuda(log)
    rt = CudaRuntime(cuda)
    s = rt.stream_create()
    d, h = rt.malloc(1024), rt.malloc_host(1024)
    pageable = np.zeros(1024, np.uint8)
    rt.htod_2d_async(d, 512, h, 512, 64, 2, s)
    with pytest.raises(EngineError, match="cudaMemcpy2DAsync.*cudaErrorInvalidValue"):
        rt.htod_2d_async(d, 512, pageable.ctypes.data, 512, 64, 2, s)  # 2D copies need pinned memory
    with pytest.raises(EngineError, match="cudaErrorInvalidPitchValue"):
        rt.dtod_2d_async(d, 64, d + 512, 64, 128, 2, s)  # width > pitch
    with pytest.raises(EngineError, match="cudaErrorInvalidValue"):
        rt.dtod_2d_async(d + 256, 256, d, 256, 256, 3, s)  # overlapping areas
    with pytest.raises(EngineError, match="cudaErrorInvalidValue"):
        rt.htod_async(d + 1000, h, 64, s)  # past the end of the allocation
    assert cuda.outstanding() == {"device": 1, "pinned": 1, "streams": 1}
    rt.free(d), rt.free_host(h), rt.stream_destroy(s)
    assert cuda.outstanding() == {"device": 0, "pinned": 0, "streams": 0}
    with pytest.raises(EngineError, match="cudaFree failed: cudaErrorInvalidValue"):
        rt.free(d)  # double free


def _device_rows(model, j, rows):
    """KV rows [0, rows) of buffer j read from the stand-in's device memory."""
    lay = model.layout
    return fake_gpu._read(model.kv_bases[j] + lay.pad * lay.row_bytes, (rows, lay.n_kv_heads, lay.head_dim), np.float32)


@pytest.mark.parametrize("pair, role, pad", [("tiny", "target", 0), ("tiny", "draft", 1), ("mixed", "draft", 0), ("mixed", "draft", 1), ("mixed", "target", 1)])
def test_trt_model_aligned_at_every_L_and_equal_to_ort_model(engine_copy, mixed_copy, pair, role, pad):
    """A walk over the whole context with speculative-like commits and rollbacks: every
    address TensorRT is given is 256-byte aligned, the logits equal OrtModel's at every
    call and the device KV equals OrtModel's KV at the end."""
    from specrt.runtime.backends.ort import OrtModel

    folder = engine_copy if pair == "tiny" else mixed_copy
    model, m, log = _trt_model(folder, role, pad=pad)
    entry = getattr(m, role)
    assert model.in_place == (entry.n_kv_heads * entry.head_dim * 4 % ALIGN == 0)
    ref = OrtModel(folder / entry.file, entry, m.max_ctx, PREFILL)
    rng = np.random.default_rng(3)
    toks = rng.integers(0, m.vocab_size, m.max_ctx).tolist()
    widths = [17, 1, 2, 3, 9, 5, 1, 4, 2, 7, 6, 8, 1, 2] if role == "target" else [17, 1, 2, 1, 2, 5, 2, 1]
    L, n, seen = 0, 0, set()
    while True:
        q = widths[n % len(widths)]
        if L + q > m.max_ctx:
            break
        np.testing.assert_array_equal(model.run(toks[L : L + q], L), ref.run(toks[L : L + q], L))
        seen.add(L % 4)
        L += 1 + int(rng.integers(0, q))  # commit 1..q rows; the rest is rolled back
        n += 1
    assert n > 40 and seen == {0, 1, 2, 3}  # offsets (pad + L) * row_bytes of every residue mod 256
    addrs = [e[3] for e in log if e[0] == "ctx.set_tensor_address"]
    assert addrs and all(a % ALIGN == 0 for a in addrs) and not _refusals(log)
    for j in range(2 * entry.n_layers):  # device KV = OrtModel's KV (the rows both committed)
        kv = (ref.keys if j % 2 == 0 else ref.values)[j // 2][0, :L]
        np.testing.assert_array_equal(_device_rows(model, j, L), kv)


def test_trt_model_refuses_before_any_tensorrt_call(engine_copy):
    model, m, log = _trt_model(engine_copy, "draft")
    del log[:]
    with pytest.raises(InputError, match="engine supports"):
        model.run([1] * (PREFILL + 1), 0)
    with pytest.raises(InputError, match="past \\+ q must be <= max_ctx"):
        model.run([1, 2], m.max_ctx - 1)
    assert log == []


def test_trt_model_refuses_a_plan_from_another_build(engine_copy):
    from specrt.runtime.backends.trt import TrtModel

    model, m, log = _trt_model(engine_copy, "target")
    other = target_profiles(ProfileConfig(k_max=m.k_max - 1, max_ctx=m.max_ctx, prefill_q=PREFILL))
    rec = load_manifest(engine_copy).extra["tensorrt"]["models"]["target"]
    cuda = fake_gpu.FakeCuda(log)
    with pytest.raises(EngineError, match="rebuild the TensorRT plans"):
        TrtModel(engine_copy / rec["plan"], m.target, other, PREFILL, trt=fake_gpu.FakeTRT(log, cuda), cuda=CudaRuntime(cuda))
    (engine_copy / "garbage.plan").write_bytes(b"\x00not a plan")
    with pytest.raises(EngineError, match="could not deserialize"):
        TrtModel(engine_copy / "garbage.plan", m.target, other, PREFILL, trt=fake_gpu.FakeTRT(log, cuda), cuda=CudaRuntime(cuda))
    assert cuda.outstanding() == {"device": 0, "pinned": 0, "streams": 0}


def test_trt_model_close_frees_everything_once(engine_copy):
    model, m, log = _trt_model(engine_copy, "target")
    cuda = model.cuda.rt
    assert cuda.outstanding() == {"device": 5, "pinned": 2, "streams": 1}  # scratch, KV, ids+positions, logits, staging
    engine = model.engine
    model.run([1, 2, 3], 0)
    model.close()
    assert cuda.outstanding() == {"device": 0, "pinned": 0, "streams": 0}
    assert len(engine.contexts) == 0  # the contexts are gone (their profiles free again)
    n = len(log)
    model.close()  # idempotent: nothing is freed twice
    assert len(log) == n
    with pytest.raises(EngineError, match="closed"):
        model.run([1], 0)


def test_trt_model_failed_load_frees_what_it_allocated(engine_copy):
    from specrt.runtime.backends.trt import TrtModel

    _, m, log = _trt_model(engine_copy, "target")
    rec = load_manifest(engine_copy).extra["tensorrt"]["models"]["target"]
    for n_ok in (0, 2, 4):
        cuda = fake_gpu.FakeCuda(log)
        cuda.fail_malloc_after = n_ok
        with pytest.raises(EngineError, match=r"cudaMalloc\(\d+\) failed: cudaErrorMemoryAllocation"):
            TrtModel(
                engine_copy / rec["plan"], m.target, ProfileSet.from_json(rec["profiles"]), PREFILL, trt=fake_gpu.FakeTRT(log, cuda), cuda=CudaRuntime(cuda)
            )
        assert cuda.outstanding() == {"device": 0, "pinned": 0, "streams": 0}


def test_cuda_errors_name_the_call():
    log = []
    cuda = fake_gpu.FakeCuda(log)
    cuda.fail_malloc = True
    with pytest.raises(EngineError, match=r"cudaMalloc\(64\) failed: cudaErrorMemoryAllocation"):
        CudaRuntime(cuda).malloc(64)


@pytest.mark.parametrize("version", ["9.3.0.1", "8.6.1", "10.0.1.6", "unknown"])
def test_tensorrt_older_than_10_1_refused_with_its_version(engine_copy, monkeypatch, capsys, version):
    from specrt.export.trt_build import TrtBuildConfig, build_folder, build_plans, tensorrt_unavailable
    from specrt.runtime.backends.trt import TrtModel, load_tensorrt

    trt, cuda, log = fake_gpu.install(monkeypatch, version=version)
    line = f"specrt needs TensorRT >= 10.1, the installed tensorrt is {version} ("
    with pytest.raises(BackendError) as e:
        load_tensorrt()
    assert str(e.value).startswith(f"backend 'tensorrt': {line}") and "\n" not in str(e.value)
    with pytest.raises(BackendError, match=re.escape(line)):
        TrtModel(
            engine_copy / "target.fp32.plan", load_manifest(engine_copy).target, target_profiles(ProfileConfig(8, 256, 16)), 16, trt=trt, cuda=CudaRuntime(cuda)
        )
    assert tensorrt_unavailable().startswith(line)
    with pytest.raises(BackendError, match=re.escape(line)):
        build_plans(engine_copy, load_manifest(engine_copy), TrtBuildConfig(precision="fp32"), trt=trt, log=lambda *_: None)
    lines = []
    assert (
        build_folder(engine_copy, TrtBuildConfig(), log=lines.append) == 2
        and build_folder(engine_copy, TrtBuildConfig(), if_available=True, log=lines.append) == 0
    )
    assert all(x.startswith(f"TensorRT plans: skipped ({line}") for x in lines) and len(lines) == 2
    assert not any(e[0].startswith(("builder.", "runtime.", "cudaMalloc")) for e in log)  # refused before any work
    assert "tensorrt" not in load_manifest(engine_copy).extra and not list(engine_copy.glob("*.plan"))


@pytest.mark.parametrize("version", ["10.1.0", "10.13.3.9", "11.0.0"])
def test_tensorrt_10_1_and_later_accepted(version):
    from types import SimpleNamespace

    from specrt.runtime.backends.trt import tensorrt_version_problem

    assert tensorrt_version_problem(SimpleNamespace(__version__=version)) is None


def _trt_engine(folder, monkeypatch, pad=0, prefill_q=16):
    """Plans built with the stand-in (prefill width ``prefill_q``), Engine on backend tensorrt."""
    from specrt import Engine

    log = []
    _build(folder, fake_gpu.FakeTRT(log, fake_gpu.FakeCuda(log)), precision="fp32", past_pad=pad, prefill_q=prefill_q)
    trt, cuda, log = fake_gpu.install(monkeypatch)  # sys.modules: tensorrt, cuda.bindings.runtime
    return Engine(folder, backend="tensorrt"), cuda, log


LONG_PROMPT = "class Foo:\n    def __init__(self, x):\n        self.x = x\n" * 8


@pytest.mark.parametrize("pair, pad", [("tiny", 0), ("tiny", 1), ("mixed", 0)])
def test_engine_on_tensorrt_stand_in_equals_ort_cpu(engine_copy, mixed_copy, tiny_pair, mixed_pair, monkeypatch, pair, pad):
    """Greedy tokens equal ort-cpu's for several k and thresholds, with prompts longer than
    the plans' prefill width (16: fed in chunks) and every TensorRT address aligned."""
    from specrt import Engine, GenerationConfig

    folder, src = (engine_copy, tiny_pair[2]) if pair == "tiny" else (mixed_copy, mixed_pair)
    trt_engine, cuda, log = _trt_engine(folder, monkeypatch, pad)
    assert trt_engine.backend == "tensorrt" and Engine(folder).backend == "ort-cpu"  # ort-cpu unless named
    assert trt_engine.target.max_q == trt_engine.draft.max_q == 16
    cpu = Engine(src, backend="ort-cpu")
    assert len(cpu.prompt_ids(LONG_PROMPT)) > 3 * 16
    for prompt in ("def add(a, b):", LONG_PROMPT):
        for k in (1, 3, 8):
            for th in (0.0, 0.5):
                cfg = GenerationConfig(max_new_tokens=24, k_max=k, threshold=th)
                assert trt_engine.generate(prompt, cfg).tokens == cpu.generate(prompt, cfg).tokens
        base = GenerationConfig(max_new_tokens=24, speculative=False)
        assert trt_engine.generate(prompt, base).tokens == cpu.generate(prompt, base).tokens
    assert not _refusals(log) and all(e[3] % ALIGN == 0 for e in log if e[0] == "ctx.set_tensor_address")
    with pytest.raises(BackendError, match="cannot fork"):
        trt_engine.fork()
    trt_engine.close()
    assert cuda.outstanding() == {"device": 0, "pinned": 0, "streams": 0}  # both models, everything


# ------------------------------------------------------------------- ort-cuda, selection


def test_ort_cuda_model_code_path_on_cpu_equals_ort_model(tiny_pair):
    from specrt.runtime.backends.ort import OrtModel
    from specrt.runtime.backends.ort_cuda import OrtCudaModel

    folder = tiny_pair[2]
    m = load_manifest(folder)
    a = OrtCudaModel(folder / m.target.file, m.target, m.max_ctx, PREFILL, device_type="cpu")
    b = OrtModel(folder / m.target.file, m.target, m.max_ctx, PREFILL)
    toks = np.random.default_rng(1).integers(0, m.vocab_size, 60).tolist()
    L = 0
    for q in (20, 1, 9, 2, 5):
        np.testing.assert_array_equal(a.run(toks[L : L + q], L), b.run(toks[L : L + q], L))
        L += q
    np.testing.assert_array_equal(a.kv_rows(1, "value", L), b.values[1][0, :L])
    with pytest.raises(InputError, match="past \\+ q <= max_ctx"):
        a.run([1, 2], m.max_ctx - 1)


def test_ort_cuda_model_fork_and_close(tiny_pair):
    from specrt.runtime.backends.ort import OrtModel
    from specrt.runtime.backends.ort_cuda import OrtCudaModel

    folder = tiny_pair[2]
    m = load_manifest(folder)
    a = OrtCudaModel(folder / m.target.file, m.target, m.max_ctx, PREFILL, device_type="cpu")
    b = a.fork()
    assert b.session is a.session and b._kv_value is not a._kv_value and b.kv_bases[0] != a.kv_bases[0]
    ra, rb = (OrtModel(folder / m.target.file, m.target, m.max_ctx, PREFILL) for _ in range(2))
    rng = np.random.default_rng(2)
    ta, tb = rng.integers(0, m.vocab_size, 40).tolist(), rng.integers(0, m.vocab_size, 40).tolist()
    L = 0
    for q in (12, 1, 5, 2, 9):  # interleaved calls: each object keeps its own KV
        np.testing.assert_array_equal(a.run(ta[L : L + q], L), ra.run(ta[L : L + q], L))
        np.testing.assert_array_equal(b.run(tb[L : L + q], L), rb.run(tb[L : L + q], L))
        L += q
    a.close()
    a.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        a.run([1], 0)
    with pytest.raises(EngineError, match="closed"):
        a.fork()
    np.testing.assert_array_equal(b.run(tb[L : L + 1], L), rb.run(tb[L : L + 1], L))  # the fork lives on
    b.close()


def test_gpu_backends_refused_clearly_where_unavailable(tiny_pair):
    """On any machine: ort-cpu unless a backend is named; a GPU backend this machine or
    folder cannot run is refused with its reason (API and CLI); one it can run resolves.
    The tiny folder has no TensorRT plans, so tensorrt is refused on a GPU machine too."""
    from click.testing import CliRunner

    from specrt import Engine
    from specrt.cli import cli
    from specrt.runtime.backends import backend_status, resolve_backend

    m = load_manifest(tiny_pair[2])
    status = backend_status(m)
    assert status["ort-cpu"] is None and status["tensorrt"] is not None
    assert resolve_backend(None, m) == "ort-cpu" and Engine(tiny_pair[2]).backend == "ort-cpu"
    with pytest.raises(BackendError, match="backend='cpu'; choose one of ort-cpu, kernels, ort-cuda, tensorrt"):
        resolve_backend("cpu")
    for name in ("ort-cuda", "tensorrt"):
        if status[name] is None:  # a GPU machine with onnxruntime-gpu
            assert resolve_backend(name, m) == name
            continue
        with pytest.raises(BackendError, match=f"backend '{name}' is unavailable here: .*; available: ort-cpu"):
            Engine(tiny_pair[2], backend=name)
        res = CliRunner().invoke(cli, ["generate", "--engines", str(tiny_pair[2]), "--prompt", "x", "--backend", name])
        assert res.exit_code == 1 and f"backend '{name}' is unavailable here" in res.output
        assert "Traceback" not in res.output


# ------------------------------------------------------------------ real GPU (skip here)


def _need(backend: str, folder=None):
    from specrt.runtime.backends import backend_status

    reason = backend_status(load_manifest(folder) if folder else None)[backend]
    if reason:
        pytest.skip(f"needs a GPU for backend {backend}: {reason}")


@pytest.mark.gpu
def test_gpu_ort_cuda_matches_ort_cpu(tiny_pair):
    from specrt import Engine, GenerationConfig

    _need("ort-cuda")
    gpu, cpu = Engine(tiny_pair[2], backend="ort-cuda"), Engine(tiny_pair[2], backend="ort-cpu")
    for k in (1, 4, 8):
        cfg = GenerationConfig(max_new_tokens=32, k_max=k)
        assert gpu.generate("def add(a, b):", cfg).tokens == cpu.generate("def add(a, b):", cfg).tokens


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [0, 1])
def test_gpu_tensorrt_fp32_plans_match_ort_cpu(engine_copy, tiny_pair, pad):
    from specrt import Engine, GenerationConfig
    from specrt.export.trt_build import TrtBuildConfig, build_plans, tensorrt_unavailable

    reason = tensorrt_unavailable()
    if reason:
        pytest.skip(f"needs TensorRT and a GPU: {reason}")
    m = build_plans(engine_copy, load_manifest(engine_copy), TrtBuildConfig(precision="fp32", past_pad=pad, workspace_gb=1.0), log=lambda *_: None)
    m.write(engine_copy)
    trt, cpu = Engine(engine_copy, backend="tensorrt"), Engine(tiny_pair[2], backend="ort-cpu")
    # fp32 TensorRT may pick other reduction orders than onnxruntime: compare logits with a
    # tolerance, then greedy tokens (ties aside, they agree)
    ref = cpu.target.run(list(range(1, 20)), 0).copy()
    np.testing.assert_allclose(trt.target.run(list(range(1, 20)), 0), ref, atol=1e-3, rtol=1e-3)
    for k in (1, 4, 8):
        cfg = GenerationConfig(max_new_tokens=32, k_max=k)
        assert trt.generate("def add(a, b):", cfg).tokens == cpu.generate("def add(a, b):", cfg).tokens


@pytest.mark.gpu
def test_gpu_tensorrt_fp16_plans_build_and_run(engine_copy):
    from specrt import Engine, GenerationConfig
    from specrt.export.trt_build import TrtBuildConfig, build_plans, tensorrt_unavailable

    reason = tensorrt_unavailable()
    if reason:
        pytest.skip(f"needs TensorRT and a GPU: {reason}")
    build_plans(engine_copy, load_manifest(engine_copy), TrtBuildConfig(precision="fp16", workspace_gb=1.0), log=lambda *_: None).write(engine_copy)
    r = Engine(engine_copy, backend="tensorrt").generate("def add(a, b):", GenerationConfig(max_new_tokens=32, k_max=4))
    assert len(r.tokens) == 32 or r.finish_reason == "stop"
