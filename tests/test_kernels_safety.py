"""specrt's kernels under deployment events and misuse: no crash, hang or silent change.

Each case was a crash, a hang or a silent wrong answer before (issue 51; the repro scripts of
../shared/research/c-safety/): a panels file rewritten under a running model, ``fork()`` after
the thread team started, a failed ``pthread_create``, a closed model reaching C, a record with a
wrong shape, int64 ids wrapping into int32 buffers, a ``start`` that overflows the C bounds
check, an infinite activation reaching a float-to-int cast, the scratch never freed. The oracle
is the model's own output before the event (bit for bit) or a one-line specrt error.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

import kernel_ref as R  # noqa: E402

from specrt.runtime import kernels as K  # noqa: E402
from specrt.runtime.errors import EngineError, InputError  # noqa: E402

if K.status() is not None:
    pytest.skip(f"kernels not available: {K.status()}", allow_module_level=True)

ISAS = K.ISAS[: K.ISAS.index(K.cpu_isa()) + 1]
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 512, 24)]
HERE = Path(__file__).resolve().parent


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, gguf, record) of a random 2-layer qwen2 decoder's panels."""
    from specrt.export.kernel_pack import write_panels

    out = tmp_path_factory.mktemp("kern_safety")
    g = R.write_gguf(out / "m.gguf", "qwen2")
    rec = write_panels(g, out, "target", log=lambda *_: None)
    K.start_team(2)
    return out, g, rec


def weights(folder: Path, rec: dict, verified=None, name: str = "target.panels"):
    from specrt.runtime.kernels.weights import KernelWeights

    return KernelWeights(folder / name, rec, 64, 32, verified)


def model(w, isa=None):
    from specrt.runtime.backends.kern import KernelModel

    return KernelModel(w, isa or K.cpu_isa())


# ---------------------------------------------------------------- deployment: files


def test_a_reexport_into_the_folder_leaves_a_running_model_unchanged(tiny, tmp_path):
    """write_panels into a folder whose panels a model has mapped (a re-export beside a running
    server): the model keeps its bytes and gives the same bits (an in-place write gave SIGBUS on
    truncation or silently changed logits); the file at the name is a new inode with the new
    weights, which a new load maps."""
    from specrt.export.kernel_pack import write_panels

    folder, _, _ = tiny
    shutil.copytree(folder, tmp_path / "f")
    f = tmp_path / "f"
    rec = write_panels(f / "m.gguf", f, "target", log=lambda *_: None)
    m = model(weights(f, rec))
    base = m.run(PROMPT, 0).copy()
    ino = os.stat(f / "target.panels").st_ino
    other = R.write_gguf(tmp_path / "other.gguf", "qwen2", seed=7)  # the same shapes, other weights
    rec2 = write_panels(other, f, "target", log=lambda *_: None)
    assert rec2["tensors"] == rec["tensors"] and os.stat(f / "target.panels").st_ino != ino
    np.testing.assert_array_equal(bits(m.run(PROMPT, 0)), bits(base))
    fresh = model(weights(f, rec2)).run(PROMPT, 0)
    assert not np.array_equal(bits(fresh), bits(base))  # the new file holds the new weights
    assert not [p for p in f.iterdir() if p.name.endswith(".tmp")]  # no temporary left behind


def test_the_loader_maps_only_the_file_that_was_verified(tiny, tmp_path):
    """The loader opens the panels once and maps that descriptor: a file at the name that is
    not the one verified (another identity) runs only if its mapped bytes have the manifest's
    digest; else one line, before C sees a pointer."""
    from specrt.runtime.integrity import file_identity, sha256_file
    from specrt.runtime.kernels.weights import RecordError

    folder, _, rec = tiny
    shutil.copy(folder / "target.panels", tmp_path / "target.panels")
    p = tmp_path / "target.panels"
    ident, digest = file_identity(os.stat(p)), sha256_file(p)
    base = model(weights(tmp_path, rec, (ident, digest))).run(PROMPT[:4], 0).copy()
    data = bytearray(p.read_bytes())
    data[4096 * 2 + 5] ^= 1
    tmp = tmp_path / "new"
    tmp.write_bytes(bytes(data))
    os.replace(tmp, p)  # swapped after the verification
    with pytest.raises(RecordError, match="changed after it was verified"):
        weights(tmp_path, rec, (ident, digest))
    os.replace(p, tmp)
    shutil.copy(folder / "target.panels", p)  # another inode, the verified bytes: runs
    np.testing.assert_array_equal(bits(model(weights(tmp_path, rec, (ident, digest))).run(PROMPT[:4], 0)), bits(base))


def test_every_record_is_checked_against_its_block_type_and_dims(tiny):
    """A record whose shapes do not match the file or the dims is refused in one line (C would
    read other tensors' bytes): a wrong n, bytes, type, a missing tensor, an unaligned or
    out-of-file offset, a 1-D tensor of the wrong length."""
    from specrt.runtime.kernels.weights import RecordError, check_record

    folder, _, rec = tiny
    size = (folder / "target.panels").stat().st_size
    assert check_record(rec, size) is None
    cases = {
        "token_embd is [1024, 256]; the dims make it [512, 256]": lambda r: r["tensors"]["token_embd"].update(n=1024),
        "blk.1.ffn_down: 1 bytes": lambda r: r["tensors"]["blk.1.ffn_down"].update(bytes=1),
        "type 16 is not one the kernels run": lambda r: r["tensors"]["blk.0.attn_q"].update(type=16),  # IQ2_XXS
        "tensor blk.1.attn_v is missing": lambda r: r["tensors"].pop("blk.1.attn_v"),
        "not 4-byte aligned": lambda r: r["tensors"]["output"].update(offset=3),
        "inside the file's": lambda r: r["tensors"]["output"].update(offset=size),
        "tensor output_norm: type 0, [255, 1]": lambda r: r["tensors"]["output_norm"].update(n=255),
        "dims n_head_kv must be positive": lambda r: r["dims"].update(n_head_kv=0),
        "tensor blk.0.attn_k is [128, 256]; the dims make it [64, 256]": lambda r: r["dims"].update(n_head_kv=1),
        "dims ffn_act 'relu' must be one of silu, gelu": lambda r: r["dims"].update(ffn_act="relu"),
        "dims attn_softcap must be a finite number >= 0": lambda r: r["dims"].update(attn_softcap=float("nan")),
        "dims rope_scale must be a finite number > 0": lambda r: r["dims"].update(rope_scale=0.0),
        "dims swa must be 2 sliding windows": lambda r: r["dims"].update(swa=[16]),
        "tensor blk.0.post_attention_norm is missing": lambda r: r["dims"].update(arch="gemma2"),  # gemma's layers have post norms
    }
    for want, change in cases.items():
        r = copy.deepcopy(rec)
        change(r)
        assert want in (check_record(r, size) or ""), (want, check_record(r, size))
    r = copy.deepcopy(rec)
    r["tensors"]["token_embd"]["n"] = 1024
    with pytest.raises(RecordError, match="token_embd"):
        weights(folder, r)


def test_a_kernels_record_whose_file_is_not_hashed_is_refused():
    """A kernels record naming a file the manifest's files map does not list would be loaded
    unhashed: refused in one line."""
    from types import SimpleNamespace

    from specrt.runtime.backends import kernel_files

    ok = SimpleNamespace(files={"target.panels": SimpleNamespace(sha256="ab" * 32)}, extra={"kernels": {"target": {"file": "target.panels"}}})
    assert kernel_files(ok) == {"target.panels": "ab" * 32}
    bad = SimpleNamespace(files={}, extra={"kernels": {"target": {"file": "target.panels"}}})
    with pytest.raises(EngineError, match="names 'target.panels', which its files map does not list"):
        kernel_files(bad)


# ---------------------------------------------------------------- threads


def _in_child(fn, timeout: float) -> tuple[int, bytes]:
    """Run ``fn() -> bytes`` in a forked child; (exit status or -signal, its bytes). The child is
    killed after ``timeout`` seconds (a hang fails the test, not the run)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        code = 1
        try:
            os.close(r)
            os.write(w, fn())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child did not finish its step in {timeout} s (a hang)")
        time.sleep(0.01)
    out = b""
    while chunk := os.read(r, 1 << 20):
        out += chunk
    os.close(r)
    return (os.waitstatus_to_exitcode(status), out)


def test_a_child_forked_after_a_step_steps_with_the_same_bits(tiny):
    """fork() after the team ran a step (multiprocessing's fork, gunicorn --preload): the
    child's step finishes (it hung at 100% CPU) with the parent's bits, on a team of the size
    asked for; the parent's team still works after."""
    folder, _, rec = tiny
    K.start_team(2)
    m = model(weights(folder, rec))
    base = m.run(PROMPT, 0).copy()
    code, out = _in_child(lambda: m.run(PROMPT, 0).tobytes() + bytes([K.library().sk_team_threads()]), timeout=20)
    assert code == 0
    np.testing.assert_array_equal(np.frombuffer(out[:-1], np.float32).view(np.uint32), bits(base).ravel())
    assert out[-1] == 2  # the child's team restarted at its first step
    np.testing.assert_array_equal(bits(m.run(PROMPT, 0)), bits(base))


def test_a_fork_while_another_thread_steps_leaves_no_lock_held(tiny):
    """A fork while another thread is inside a step: the C team waits for the step to end
    before the fork, and the weights' step lock (held by that thread at the fork) is new in
    the child, so the child's own step runs."""
    import threading

    folder, _, rec = tiny
    K.start_team(2)
    w = weights(folder, rec)
    m, busy = model(w), model(w)
    base = m.run(PROMPT, 0).copy()
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            busy.run(PROMPT, 0)

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        code, out = _in_child(lambda: m.run(PROMPT, 0).tobytes(), timeout=20)
    finally:
        stop.set()
        t.join()
    assert code == 0
    np.testing.assert_array_equal(np.frombuffer(out, np.float32).view(np.uint32), bits(base).ravel())


SHIM = r"""
/* LD_PRELOAD shim: the FAIL_SK_CREATE_AT-th pthread_create called from the kernels library fails (EAGAIN) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
static int calls;
int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*f)(void *), void *arg) {
    static int (*real)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
    if (!real) real = (int (*)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *))dlsym(RTLD_NEXT, "pthread_create");
    Dl_info info;
    if (dladdr(__builtin_return_address(0), &info) && info.dli_fname && strstr(info.dli_fname, "_sk")) {
        const char *s = getenv("FAIL_SK_CREATE_AT");
        if (s && ++calls == atoi(s)) return EAGAIN;
    }
    return real(t, a, f, arg);
}
"""


def test_a_failed_thread_creation_leaves_no_worker_and_the_retry_works(tiny, tmp_path):
    """The 3rd pthread_create of a 4-thread team fails (a pids cgroup, RLIMIT_NPROC): one
    line, the two workers started are joined (none left behind), and the next start builds a
    whole team whose steps give the 1-thread bits (the retry used to deadlock on a team with
    duplicate thread ids)."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler for the pthread_create shim")
    shim = tmp_path / "failcreate.so"
    (tmp_path / "failcreate.c").write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-o", shim, tmp_path / "failcreate.c", "-ldl"], check=True)
    folder, _, rec = tiny
    script = textwrap.dedent(
        f"""
        import os, sys
        import numpy as np
        sys.path.insert(0, {str(HERE)!r})
        from test_kernels_safety import weights, model, PROMPT
        from specrt.runtime import kernels as K
        from pathlib import Path
        import json
        rec = json.loads({__import__("json").dumps(__import__("json").dumps(rec))})
        threads = lambda: len(os.listdir("/proc/self/task"))
        K.start_team(1)
        m = model(weights(Path({str(folder)!r}), rec))
        ref = m.run(PROMPT, 0).copy()
        before = threads()
        try:
            K.start_team(4)
            print("no failure")
        except RuntimeError as e:
            print("refused:", e)
        print("left", threads() - before, K.library().sk_team_threads())
        K.start_team(4)
        print("team", threads() - before, K.library().sk_team_threads())
        same = all(np.array_equal(m.run(PROMPT, 0).view(np.uint32), ref.view(np.uint32)) for _ in range(20))
        print("same", same)
        """
    )
    env = dict(os.environ, LD_PRELOAD=" ".join([str(shim), os.environ.get("LD_PRELOAD", "")]).strip(), FAIL_SK_CREATE_AT="3")
    if os.environ.get("LD_PRELOAD"):  # a sanitizer run (make test-sanitize): its runtime after the shim
        env["ASAN_OPTIONS"] = os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0"
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "refused: sk_team_start: could not start the thread team", lines
    assert lines[1] == "left 0 1", lines  # no orphan worker; the team is the caller alone
    assert lines[2] == "team 3 4", lines
    assert lines[3] == "same True", lines


def test_threads_over_the_limit_are_refused_by_thread_config():
    from specrt.runtime.backends.base import MAX_THREADS, ThreadConfig

    assert MAX_THREADS == K.MAX_THREADS == K.library().sk_max_threads()
    assert ThreadConfig(MAX_THREADS).intra_op == MAX_THREADS
    for bad in (MAX_THREADS + 1, 0, -2, 2.0, True):
        with pytest.raises(InputError, match=rf"threads={bad!r}: allowed 1\.\.{MAX_THREADS}"):
            ThreadConfig(bad)
    with pytest.raises(InputError, match="draft threads=96"):
        ThreadConfig(2, False, 96)


def test_the_isa_names_are_the_librarys():
    lib = K.library()
    lib.sk_isa_name.restype = ctypes.c_char_p
    assert tuple(lib.sk_isa_name(i).decode() for i in range(len(K.ISAS))) == K.ISAS
    assert lib.sk_isa_name(len(K.ISAS)) is None


# ---------------------------------------------------------------- closed objects, bad arguments


def test_every_call_after_close_raises_a_specrt_error(tiny):
    """A closed model (or one over closed weights) never reaches C (run_argmax/run_top1 after
    close() wrote KV rows into unmapped memory: SIGSEGV)."""
    from specrt.runtime.backends.kern_batch import KernelBatch

    folder, _, rec = tiny
    w = weights(folder, rec)
    m, other = model(w), model(w)
    m.close()
    m.close()  # idempotent
    calls = {
        "run": lambda: m.run([1, 2], 0),
        "run_rows": lambda: m.run_rows([1, 2], 0, 1),
        "run_argmax": lambda: m.run_argmax([1, 2], 0, 512),
        "run_top1": lambda: m.run_top1([1, 2], 0, 512, 1.0),
        "fork": m.fork,
        "swap_kv": lambda: other.swap_kv(m),
    }
    for name, call in calls.items():
        with pytest.raises(EngineError, match="this kernels model is closed"):
            call()
        assert name
    assert m.release_rows(0) == 0 and m.release_logits(0) == 0
    batch = KernelBatch(other, 2)
    w.close()
    assert w.closed and w.scratch is None
    for call in (lambda: other.run_argmax([1], 0, 512), lambda: other.run_top1([1], 0, 512, 1.0), lambda: batch.step([1, 2], [0, 0])):
        with pytest.raises(EngineError, match="closed"):
            call()
    batch.close()
    with pytest.raises(EngineError, match="batch is closed"):
        batch.step([1], [0])


def test_ids_and_positions_are_checked_before_any_int32_cast(tiny):
    """An int64 id 2**32 + 7 ran as token 7 (numpy wraps it into the int32 buffer), and a
    batched row at position 2**32 + 3 passed as row 3: both refused before the cast."""
    from specrt.runtime.backends.kern_batch import KernelBatch

    folder, _, rec = tiny
    m = model(weights(folder, rec))
    for bad in (np.array([2**32 + 7]), np.array([-1]), [512], np.array([7.0]), np.array([True]), [[1, 2]]):
        with pytest.raises(InputError):
            m.run(bad, 0)
    with pytest.raises(InputError, match=r"outside the vocabulary 0\.\.511"):
        m.run_argmax(np.array([2**32 + 7], np.int64), 0, 512)
    b = KernelBatch(m, 2)
    with pytest.raises(InputError, match="positions must be in 0..63"):
        b.rows([0, 0], [1, 2], [3, 2**32 + 3])
    with pytest.raises(InputError, match="outside the vocabulary"):
        b.rows([0, 1], [1, 2**32 + 2], [0, 0])
    with pytest.raises(InputError, match="slots"):
        b.rows([0, 5], [1, 2], [0, 0])
    np.testing.assert_array_equal(bits(b.rows([0], np.array([7], np.int64), np.array([0], np.int64))[0]), bits(model(m.w).run([7], 0)[0]))


def test_c_refuses_what_python_would_never_send(tiny):
    """The C entry points check on their own (defence in depth): a start whose start + q
    overflows int32 (it wrapped past the check: SIGSEGV), a model whose matrix shapes do not
    agree with its dims (it read other tensors' bytes), architecture numbers it cannot run
    (an unknown activation, NaN or negative caps, a negative window), a scratch too small for
    the model."""
    folder, _, rec = tiny
    w = weights(folder, rec)
    m = model(w)
    lib, isa = w.lib, K.isa_id(K.cpu_isa())
    ids = np.array([1], np.int32)
    out = np.zeros((1, 512), np.float32)
    aid, av = np.zeros(1, np.int32), np.zeros(1, np.float32)
    kv = ctypes.byref(m._kv)
    assert lib.sk_step(isa, ctypes.byref(w.model), kv, w.scratch, ids.ctypes.data, 1, 2**31 - 1, out.ctypes.data, 512, 0) == -2
    assert (
        lib.sk_step_argmax(isa, ctypes.byref(w.model), kv, w.scratch, ids.ctypes.data, 1, 2**31 - 1, aid.ctypes.data, av.ctypes.data, 512, 0.0, 0, None) == -2
    )
    assert lib.sk_step(isa, ctypes.byref(w.model), kv, w.scratch, ids.ctypes.data, 1, 64, out.ctypes.data, 512, 0) == -2
    bad = K.SkModel.from_buffer_copy(w.model)
    bad.tok_embd = K.SkMat(w.model.tok_embd.type, 1024, w.model.tok_embd.k, 0, w.model.tok_embd.w)
    assert lib.sk_step(isa, ctypes.byref(bad), kv, w.scratch, ids.ctypes.data, 1, 0, out.ctypes.data, 512, 0) == -6
    layers = (K.SkLayer * 2)(*w.layers)
    layers[1].wdown = K.SkMat(layers[1].wdown.type, layers[1].wdown.n, 2 * layers[1].wdown.k, 0, layers[1].wdown.w)  # k != n_ff
    bad = K.SkModel.from_buffer_copy(w.model)
    bad.layers = ctypes.cast(layers, ctypes.POINTER(K.SkLayer))
    assert lib.sk_step(isa, ctypes.byref(bad), kv, w.scratch, ids.ctypes.data, 1, 0, out.ctypes.data, 512, 0) == -6
    # the architecture's numbers: an activation the step does not know, a NaN or negative cap,
    # an infinite scale, a negative window, one RoPE table of a pair
    for field, value in (("ffn_act", 2), ("attn_softcap", float("nan")), ("final_softcap", -1.0), ("emb_scale", float("inf"))):
        bad = K.SkModel.from_buffer_copy(w.model)
        setattr(bad, field, value)
        assert lib.sk_step(isa, ctypes.byref(bad), kv, w.scratch, ids.ctypes.data, 1, 0, out.ctypes.data, 512, 0) == -6, field
    for field, value in (("swa", -1), ("rope_cos", w.model.rope_cos)):
        layers = (K.SkLayer * 2)(*w.layers)
        setattr(layers[0], field, value)
        bad = K.SkModel.from_buffer_copy(w.model)
        bad.layers = ctypes.cast(layers, ctypes.POINTER(K.SkLayer))
        assert lib.sk_step(isa, ctypes.byref(bad), kv, w.scratch, ids.ctypes.data, 1, 0, out.ctypes.data, 512, 0) == -6, field
    small = lib.sk_scratch_new(32, 128, 256, 128, 512, 64)  # n_embd 128 < the model's 256
    try:
        assert lib.sk_step(isa, ctypes.byref(w.model), kv, small, ids.ctypes.data, 1, 0, out.ctypes.data, 512, 0) == -6
    finally:
        lib.sk_scratch_free(small)
    assert lib.sk_scratch_attention(ctypes.c_void_p(w.scratch), 1, 10**6, out.ctypes.data) == -2  # wider than the scratch's rows
    np.testing.assert_array_equal(bits(m.run([1], 0)), bits(model(w).run([1], 0)))  # the model still runs


def test_the_test_entry_points_check_their_buffers(tiny):
    rng = np.random.default_rng(0)
    raw = R.random_tensor(rng, R.Q8_0, 32, 64)
    from specrt.runtime.kernels import panels as PN

    pan = PN.pack(raw, R.Q8_0, 32, 64)
    with pytest.raises(ValueError, match=r"x is \[2, 32\]; the matrix takes rows of 64"):
        K.matmul(R.Q8_0, 32, 64, pan, np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError, match="panels hold 100 bytes"):
        K.matmul(R.Q8_0, 32, 64, pan[:100], np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="panels hold 100 bytes"):
        K.dequant(R.Q8_0, 32, 64, pan[:100])
    with pytest.raises(ValueError, match="rows 0..40 of 32"):
        K.dequant(R.Q8_0, 32, 64, pan, 0, 40)
    with pytest.raises(ValueError, match="panels must be a contiguous uint8 array"):
        K.dequant(R.Q8_0, 32, 64, pan.astype(np.int16))


@pytest.mark.parametrize("ty", [R.Q4_K, R.Q8_0], ids=["Q8_K-activations", "Q8_0-activations"])
def test_an_infinite_activation_makes_its_row_nan_on_every_path(ty):
    """+inf or -inf among finite activations: the row is NaN on every ISA path (the caller
    refuses it), no float-to-int cast of a non-finite value (undefined: x86 happened to give 0);
    the other rows are unchanged."""
    from specrt.runtime.kernels import panels as PN

    rng = np.random.default_rng(1)
    raw = R.random_tensor(rng, ty, 32, 512)
    pan = PN.pack(raw, ty, 32, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    base = K.matmul(ty, 32, 512, pan, x)
    x[1, 7], x[2, 300] = np.inf, -np.inf
    for isa in ISAS:
        y = K.matmul(ty, 32, 512, pan, x, isa=isa)
        assert np.isnan(y[1:]).all(), isa
        np.testing.assert_array_equal(bits(y[0]), bits(base[0]), err_msg=isa)


def test_a_rope_scaling_factor_of_zero_is_one_and_the_legacy_key_is_read(tiny, tmp_path):
    """llama.cpp reads the linear RoPE factor from rope.scaling.factor, else rope.scale_linear,
    and takes 0 as 1: a 0 there must not divide the positions by 0 (NaN tables, NaN logits)."""
    from specrt.export.kernel_pack import write_panels

    folder, _, rec = tiny
    base = model(weights(folder, rec)).run(PROMPT, 0)
    for floats, want in (({"rope.scaling.factor": 0.0}, 1.0), ({"rope.scale_linear": 4.0}, 4.0)):
        out = tmp_path / str(want)
        out.mkdir()
        r = write_panels(R.write_gguf(out / "m.gguf", "qwen2", floats=floats), out, "target", log=lambda *_: None)
        assert r["dims"]["rope_scale"] == want
        got = model(weights(out, r)).run(PROMPT, 0)
        assert np.isfinite(got).all()
        assert np.array_equal(bits(got), bits(base)) == (want == 1.0)  # the same weights (seed 0): unscaled == the fixture's


def test_the_scratch_is_freed_with_its_weights(tiny, monkeypatch):
    """Each load's C scratch went with nothing (50 loads: +2.5 GB virtual): it is freed when the
    weights are dropped (not while a model still holds them), or at close()."""
    folder, _, rec = tiny
    lib = K.library()
    real, freed = lib.sk_scratch_free, []
    monkeypatch.setattr(lib, "sk_scratch_free", lambda p: freed.append(p.value if hasattr(p, "value") else p) or real(p))
    w = weights(folder, rec)
    ptr = w.scratch
    m = model(w)
    del w
    gc.collect()
    assert ptr not in freed  # a model still holds the weights: the scratch stays
    m.run([1], 0)
    del m
    gc.collect()
    assert freed.count(ptr) == 1
    freed.clear()
    w = weights(folder, rec)
    ptr = w.scratch
    w.close()
    w.close()
    del w
    gc.collect()
    assert freed.count(ptr) == 1  # once, at close()


# ---------------------------------------------------------------- the block-type tables


def test_the_c_and_python_block_type_tables_agree():
    """One table per language (types.c, panels.TABLE), checked against each other row by row,
    and against gguf-py's block sizes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from specrt.runtime.kernels import panels as PN

    c = K.c_types()
    assert sorted(c) == sorted(t.ggml_type for t in PN.TABLE)
    for t in PN.TABLE:
        row = c[t.ggml_type]
        assert (row["name"], row["block"], row["gguf_bytes"], row["panel_bytes"], row["act"]) == (t.name, t.block, t.gguf_bytes, t.panel_bytes, t.activation), (
            t.name
        )
        assert row["isas"][: len(ISAS)] == ISAS, t.name  # a kernel on every path this CPU runs
        assert GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)] == (t.block, t.gguf_bytes), t.name
        assert GGMLQuantizationType(t.ggml_type).name == t.name


def test_the_kernels_model_declares_its_capabilities(tiny):
    """The optional capabilities the loop probes (backends/base.py's protocols, with isinstance)."""
    from specrt.runtime.backends import base as B

    folder, _, rec = tiny
    m = model(weights(folder, rec))
    for proto in (B.Model, B.ProjectsRows, B.ReducesHead, B.DraftsTop1, B.WidthExact, B.ReleasesRows, B.ReleasesLogits):
        assert isinstance(m, proto), proto.__name__
    assert not isinstance(m, B.SplitsHead)
    assert B.reduces_head(m) and B.is_width_exact(m)
    assert not B.reduces_head(object()) and not B.is_width_exact(object())
