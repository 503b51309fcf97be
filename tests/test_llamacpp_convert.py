"""Architectures on the kernels against llama.cpp's own converter (issue 52 item 3): tiny random
Hugging Face models of each family the kernels run (llama: the embedded target; qwen2 with
biases; qwen3 with q/k norms and head_dim 64 over n_embd 128; phi3 with fused projections;
gemma2 with soft-caps and gemma3 with q/k norms, both with sliding layers) are converted by
llama.cpp's ``convert_hf_to_gguf.py`` from the pinned llama-cpp-python source the Makefile
builds llama.cpp from (its sdist from the package registry, cached), at Q8_0 (gemma: F32).

- The kernels' logits over that file agree with the PyTorch float32 model (transformers).
- specrt's own writer (export/checkpoint_gguf.py, what an int8 export of a checkpoint packs)
  writes every tensor byte for byte as the converter does (names, types, blocks, the llama
  q/k permutation, phi3's fused rows)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from specrt.runtime import kernels as K

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(K.status() is not None, reason=f"specrt's kernels are not built here: {K.status()}")
VERSION = re.search(r"^LLAMA_CPP_PYTHON \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)  # the Makefile's pin


@pytest.fixture(scope="module")
def converter() -> Path:
    """llama.cpp's converter (``vendor/llama.cpp``: convert_hf_to_gguf.py, conversion/,
    gguf-py/) from the llama-cpp-python sdist of the Makefile's pin, cached in
    ``$SPECRT_LLAMA_CPP_SRC`` or ``~/.cache/specrt/llama_cpp_src/<version>``."""
    root = Path(os.environ.get("SPECRT_LLAMA_CPP_SRC") or Path.home() / ".cache" / "specrt" / "llama_cpp_src") / VERSION
    src = root / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    tmp = root.with_name(root.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps", "-d", str(tmp), f"llama-cpp-python=={VERSION}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        if os.environ.get("CI"):
            raise RuntimeError(f"cannot download llama-cpp-python {VERSION}'s source: {r.stderr[-500:]}")
        pytest.skip(f"cannot download llama-cpp-python {VERSION}'s source here")
    keep = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")
    with tarfile.open(next(tmp.glob("*.tar.gz"))) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and any(k in m.name for k in keep)]
        for m in members:
            m.name = m.name.split("/", 1)[1]  # without the top folder
        tar.extractall(tmp / "src", members=members, filter="data")
    shutil.rmtree(root, ignore_errors=True)
    (tmp / "src").rename(root)
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def _tiny(kind: str, folder: Path) -> Path:
    """A random 2-layer model of ``kind`` (norms and biases moved off their init values, so a
    misplaced one shows), saved with the embedded pair's tokenizer."""
    torch = pytest.importorskip("torch")
    import transformers as T

    common = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    common |= dict(rms_norm_eps=1e-6, tie_word_embeddings=False)
    gemma = common | dict(tie_word_embeddings=True, head_dim=32, query_pre_attn_scalar=32)
    cfg, cls = {
        "qwen2": (T.Qwen2Config(**common), T.Qwen2ForCausalLM),
        "qwen3": (T.Qwen3Config(**common, head_dim=64), T.Qwen3ForCausalLM),
        "phi3": (T.Phi3Config(**common, sliding_window=None, pad_token_id=0, bos_token_id=0, eos_token_id=0), T.Phi3ForCausalLM),
        # gemma: the head tied (the converter drops lm_head), head_dim = query_pre_attn_scalar
        # (llama.cpp's scale below 27B), a 16-position window the 48-token prompt slides past
        # (gemma3: 6 layers, the 6th global); gemma2 with caps small enough to bite
        "gemma2": (T.Gemma2Config(**gemma, sliding_window=16, attn_logit_softcapping=0.5, final_logit_softcapping=1.0), T.Gemma2ForCausalLM),
        "gemma3": (T.Gemma3TextConfig(**gemma | dict(num_hidden_layers=6), sliding_window=16), T.Gemma3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    m = cls(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    m.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "models" / "target" / f, folder / f)
    return folder


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_converted_files_run_on_the_kernels_as_pytorch(converter, tmp_path, kind):
    torch = pytest.importorskip("torch")
    import gguf
    from transformers import AutoModelForCausalLM

    from specrt.export.checkpoint_gguf import checkpoint_unsupported, write_checkpoint_gguf
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.backends.kern import KernelModel
    from specrt.runtime.kernels.weights import KernelWeights

    folder = REPO / "models" / "target" if kind == "llama" else _tiny(kind, tmp_path / kind)
    # gemma at F32: its post norms bring each block's output to the residual's scale, so Q8_0's
    # error reaches ~2% of the logits on these random weights; float weights check the layers
    # themselves (the kernels' F32 panels read unquantized activations: the f16 KV cache remains)
    outtype, bound = ("f32", 2e-3) if kind.startswith("gemma") else ("q8_0", 0.02)
    theirs = tmp_path / "llamacpp.gguf"
    cmd = [sys.executable, str(Path(__file__).with_name("llamacpp_convert.py")), str(converter), str(folder), "--outtype", outtype, "--outfile", str(theirs)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    # specrt's writer: the converter's bytes, tensor for tensor (gemma checkpoints it refuses:
    # the kernels run gemma from GGUF files)
    if kind.startswith("gemma"):
        assert "model_type" in (checkpoint_unsupported(folder) or "")
    else:
        write_checkpoint_gguf(folder, tmp_path / "specrt.gguf", "int8")
        a = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
        b = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "specrt.gguf")).tensors}
        assert set(a) == set(b)
        for n in a:
            assert a[n].tensor_type == b[n].tensor_type and np.array_equal(np.asarray(a[n].data).view(np.uint8), np.asarray(b[n].data).view(np.uint8)), n
    # the kernels over llama.cpp's file, against PyTorch float32
    rec = write_panels(theirs, tmp_path, "target", log=lambda *_: None)
    assert rec is not None and rec["dims"]["arch"] == kind
    ids = [int(x) for x in np.random.default_rng(7).integers(1, 4096, 48)]
    with torch.no_grad():
        # eager attention: transformers' sdpa path has no soft-capping (gemma2)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        ref = hf(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
    K.start_team(2)
    got = KernelModel(KernelWeights(tmp_path / "target.panels", rec, 256, 64), K.cpu_isa()).run(ids, 0)[:, : ref.shape[1]]
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < bound, rel  # Q8_0: 8-bit weights and activations, as llama.cpp
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9
