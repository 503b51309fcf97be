"""GPU backends on CPU: TensorRT profiles and shape validation, KV offsets, the precision
and dummy-row ONNX rewrites, the manifest's TensorRT record, and the call sequences of
the plan builder and of TrtModel against recording stand-ins for ``tensorrt`` and
``cuda.bindings.runtime`` (tests/fake_gpu.py) that execute the ONNX with onnxruntime.

Tests marked ``gpu`` need a real NVIDIA GPU with tensorrt / onnxruntime-gpu and
cuda-python; they skip elsewhere (nothing in this file has been run on a GPU yet).
"""

from __future__ import annotations

import json
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
    from specrt.export.trt_build import main, tensorrt_hook, tensorrt_unavailable

    if tensorrt_unavailable() is None:
        pytest.skip("this machine can build TensorRT plans")
    msgs = []
    m = load_manifest(engine_copy)
    assert tensorrt_hook(engine_copy, m, "fp16", msgs.append) is m
    assert msgs and msgs[0].startswith("TensorRT plans: skipped (")
    assert main([str(engine_copy), "--if-available"]) == 0
    assert main([str(engine_copy)]) == 2
    assert "TensorRT plans: skipped" in capsys.readouterr().err


# ----------------------------------------------------- TrtModel against the stand-ins


def _trt_model(folder, role, pad=0, log=None, max_q=PREFILL):
    from specrt.runtime.backends.trt import TrtModel

    log = [] if log is None else log
    cuda = fake_gpu.FakeCuda(log)
    trt = fake_gpu.FakeTRT(log, cuda)
    m = load_manifest(folder)
    _build(folder, trt, precision="fp32", past_pad=pad)
    rec = load_manifest(folder).extra["tensorrt"]["models"][role]
    entry = getattr(m, role)
    model = TrtModel(folder / rec["plan"], entry, ProfileSet.from_json(rec["profiles"]), max_q, trt=trt, cuda=CudaRuntime(cuda))
    return model, m, log


def test_trt_model_setup_sequence(engine_copy):
    model, m, log = _trt_model(engine_copy, "target")
    n_prof = m.k_max + 2
    ctxs = [e for e in log if e[0] == "engine.create_execution_context"]
    assert ctxs == [("engine.create_execution_context", "USER_MANAGED")] * n_prof
    mem = [e for e in log if e[0] == "ctx.set_device_memory"]
    assert len(mem) == n_prof and len({(e[2], e[3]) for e in mem}) == 1  # one shared scratch
    assert mem[0][3] == 4096 * n_prof  # the largest profile's size
    prof = [e for e in log if e[0] == "ctx.set_optimization_profile_async"]
    assert [e[2] for e in prof] == list(range(n_prof)) and {e[3] for e in prof} == {model.stream}
    # past inputs bound once, at load, to the buffer bases
    past_addr = [e for e in log if e[0] == "ctx.set_tensor_address" and e[2].startswith("past_")]
    assert len(past_addr) == n_prof * 2 * m.target.n_layers
    assert {e[3] for e in past_addr if e[2] == "past_value_1"} == {model.kv_bases[3]}


@pytest.mark.parametrize("pad", [0, 1])
def test_trt_model_call_sequence(engine_copy, pad):
    model, m, log = _trt_model(engine_copy, "target", pad=pad)
    lay = model.layout
    V, h, d = m.target.vocab_size, m.target.n_kv_heads, m.target.head_dim
    for q, L, profile in ((1, 0, "decode"), (5, 10, "verify_k4"), (9, 20, "verify_k8"), (30, 40, "prefill"), (2, 70, "verify_k1")):
        del log[:]
        model.run(list(range(1, q + 1)), L)
        i = [p.name for p in model.profiles.profiles].index(profile)
        ctx_id = id(model.contexts[i])
        assert {e[1] for e in log if e[0].startswith("ctx.")} == {ctx_id}, "only the selected profile's context is used"
        shapes = {e[2]: e[3] for e in log if e[0] == "ctx.set_input_shape"}
        assert shapes["input_ids"] == shapes["position_ids"] == (1, q)
        assert all(shapes[f"past_{k}_{j}"] == (1, pad + L, h, d) for j in range(m.target.n_layers) for k in ("key", "value"))
        addr = {e[2]: e[3] for e in log if e[0] == "ctx.set_tensor_address"}
        assert addr["position_ids"] == model.d_pos + 8 * L
        for j, (_, new) in enumerate(lay.names()):
            assert addr[new] == model.kv_bases[j] + (pad + L) * lay.row_bytes  # base + L * row stride
        assert not any(n.startswith("past_") or n in ("input_ids", "logits") for n in addr)  # constant, set at load
        copies = [e for e in log if e[0] == "cudaMemcpyAsync"]
        assert copies == [("cudaMemcpyAsync", "H2D", 8 * q), ("cudaMemcpyAsync", "D2H", 4 * q * V)]  # only what is needed
        assert [e[0] for e in log].count("ctx.execute_async_v3") == 1
        assert [e[0] for e in log].count("cudaStreamSynchronize") == 1
        assert not any(e[0].startswith("cudaMalloc") for e in log), "no allocation on the hot path"


@pytest.mark.parametrize("role, pad", [("target", 0), ("draft", 0), ("target", 1)])
def test_trt_model_matches_ort_model(engine_copy, role, pad):
    from specrt.runtime.backends.ort import OrtModel

    model, m, _ = _trt_model(engine_copy, role, pad=pad)
    entry = getattr(m, role)
    ref = OrtModel(engine_copy / entry.file, entry, m.max_ctx, PREFILL)
    rng = np.random.default_rng(7)
    toks = rng.integers(0, m.vocab_size, 80).tolist()
    L = 0
    for q in (33, 1, 2, 5, 9, 1, 2) if role == "target" else (33, 1, 2, 1, 2, 7):
        np.testing.assert_array_equal(model.run(toks[L : L + q], L), ref.run(toks[L : L + q], L))
        L += q
    np.testing.assert_array_equal(model.run(toks[3:5], 3), ref.run(toks[3:5], 3))  # rollback: a smaller L


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


def test_cuda_errors_name_the_call():
    log = []
    cuda = fake_gpu.FakeCuda(log)
    cuda.fail_malloc = True
    with pytest.raises(EngineError, match=r"cudaMalloc\(64\) failed: cudaError2"):
        CudaRuntime(cuda).malloc(64)


@pytest.mark.parametrize("pad", [0, 1])
def test_engine_on_tensorrt_stand_in_equals_ort_cpu(engine_copy, tiny_pair, monkeypatch, pad):
    from specrt import Engine, GenerationConfig

    log = []
    _build(engine_copy, fake_gpu.FakeTRT(log, fake_gpu.FakeCuda(log)), precision="fp32", past_pad=pad)
    fake_gpu.install(monkeypatch)  # sys.modules: tensorrt, cuda.bindings.runtime
    trt_engine = Engine(engine_copy, backend="tensorrt")
    assert trt_engine.backend == "tensorrt" and Engine(engine_copy).backend == "ort-cpu"  # ort-cpu unless named
    cpu = Engine(tiny_pair[2], backend="ort-cpu")
    long_prompt = "class Foo:\n    def __init__(self, x):\n        self.x = x\n" * 8
    for prompt in ("def add(a, b):", long_prompt):
        for k in (1, 3, 8):
            for th in (0.0, 0.5):
                cfg = GenerationConfig(max_new_tokens=24, k_max=k, threshold=th)
                assert trt_engine.generate(prompt, cfg).tokens == cpu.generate(prompt, cfg).tokens
        base = GenerationConfig(max_new_tokens=24, speculative=False)
        assert trt_engine.generate(prompt, base).tokens == cpu.generate(prompt, base).tokens


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


def test_gpu_backends_refused_clearly_without_a_gpu(tiny_pair):
    from click.testing import CliRunner

    from specrt import Engine
    from specrt.cli import cli
    from specrt.runtime.backends import backend_status, resolve_backend

    status = backend_status(load_manifest(tiny_pair[2]))
    assert status["ort-cpu"] is None
    with pytest.raises(BackendError, match="backend='cpu'; choose one of ort-cpu, ort-cuda, tensorrt"):
        resolve_backend("cpu")
    for name in ("ort-cuda", "tensorrt"):
        if status[name] is None:
            continue
        with pytest.raises(BackendError, match=f"backend '{name}' is unavailable here: .*; available: ort-cpu"):
            Engine(tiny_pair[2], backend=name)
        res = CliRunner().invoke(cli, ["generate", "--engines", str(tiny_pair[2]), "--prompt", "x", "--backend", name])
        assert res.exit_code == 1 and f"backend '{name}' is unavailable here" in res.output
        assert "Traceback" not in res.output
    if status["ort-cuda"] and status["tensorrt"]:
        assert Engine(tiny_pair[2]).backend == "ort-cpu"


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
