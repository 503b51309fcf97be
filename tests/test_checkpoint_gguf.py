"""Checkpoints that are not GGUF files on the kernels (issue 52 item 4): a Hugging Face folder
quantized by specrt (export/checkpoint_gguf.py) into llama.cpp's blocks, packed like a GGUF
file's. Oracle: the checkpoint in float32 PyTorch (transformers), as for every export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from specrt.runtime import kernels as K

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(K.status() is not None, reason=f"specrt's kernels are not built here: {K.status()}")


def _logits(folder: Path, precision: str, tmp: Path, role: str = "target") -> tuple[np.ndarray, np.ndarray]:
    """(kernels' logits, PyTorch float32 logits) of the first HumanEval dev prompt (64 tokens)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.export.checkpoint_gguf import write_checkpoint_gguf
    from specrt.export.kernel_pack import write_panels
    from specrt.runtime.backends.kern import KernelModel
    from specrt.runtime.kernels.weights import KernelWeights

    write_checkpoint_gguf(folder, tmp / f"{role}.gguf", precision)
    rec = write_panels(tmp / f"{role}.gguf", tmp, role, log=lambda *_: None)
    assert rec is not None
    prompt = json.loads((REPO / "data" / "humaneval_dev.jsonl").read_text().splitlines()[0])["prompt"]
    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt").input_ids[:, :64]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits[0].numpy().astype(np.float64)
    K.start_team(2)
    got = KernelModel(KernelWeights(tmp / f"{role}.panels", rec, 256, 64), K.cpu_isa()).run(ids[0].tolist(), 0)[:, : ref.shape[1]]
    return got, ref


def _assert_close_to_pytorch(folder: Path, tmp: Path) -> None:
    """A saved random model, given the embedded pair's tokenizer, written at Q8_0: its kernels'
    logits within 2% of PyTorch float32, top-1 >= 0.9."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "models" / "target" / f, folder / f)
    got, ref = _logits(folder, "int8", tmp)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.02
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9


@pytest.mark.parametrize("precision,bound", [("int8", 0.01), ("int4", 0.04)])
def test_embedded_target_logits_match_pytorch(tmp_path, precision, bound):
    """models/target (llama: q/k rows permuted to GGUF's interleaved RoPE pairs, tied head):
    Q8_0 within 1% of PyTorch float32 (measured 0.45%), Q4_0 layers within 4% (measured 2.1%)."""
    got, ref = _logits(REPO / "models" / "target", precision, tmp_path)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel < bound, rel
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.93


def test_qwen2_checkpoint_logits_match_pytorch(tmp_path):
    """qwen2 (NEOX RoPE: no permutation; q/k/v biases kept in float32)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.2)  # biases are zeros at init: make them matter
    folder = tmp_path / "qwen2"
    model.save_pretrained(folder)
    _assert_close_to_pytorch(folder, tmp_path)


def test_phi3_checkpoint_logits_match_pytorch(tmp_path):
    """phi3: the GGUF keeps its fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up rows) as
    convert_hf_to_gguf writes them; the packer splits them by rows (kernel_pack.FUSED); NEOX
    RoPE. Against transformers' Phi3ForCausalLM in float32."""
    torch = pytest.importorskip("torch")
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=None, pad_token_id=0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(1)
    folder = tmp_path / "phi3"
    Phi3ForCausalLM(cfg).float().eval().save_pretrained(folder)
    _assert_close_to_pytorch(folder, tmp_path)


def test_fused_rows_that_do_not_add_up_are_refused(tmp_path):
    """A phi3 file whose ``attn_qkv`` rows are not q + k + v rows is refused in one line."""
    import gguf

    from specrt.export.checkpoint_gguf import write_checkpoint_gguf
    from specrt.export.kernel_pack import plan_tensors

    cfg = {**json.loads((REPO / "models" / "draft" / "config.json").read_text()), "model_type": "phi3"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.numpy import load_file, save_file

    w = load_file(str(REPO / "models" / "draft" / "model.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.qkv_proj.weight"] = np.concatenate([w.pop(p + f"self_attn.{c}_proj.weight") for c in "qkv"])[:-16]  # 16 rows short
        w[p + "mlp.gate_up_proj.weight"] = np.concatenate([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])
    save_file(w, str(tmp_path / "model.safetensors"))
    write_checkpoint_gguf(tmp_path, tmp_path / "p.gguf", "int8")
    why = plan_tensors(gguf.GGUFReader(str(tmp_path / "p.gguf")))[2]
    assert why == "blk.0.attn_qkv.weight has 368 rows; attn_q+attn_k+attn_v need 384", why


@pytest.mark.parametrize(
    "change,why",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3"}}, "rope type 'llama3'"),
        ({"model_type": "mistral", "sliding_window": 512}, "sliding-window attention (512 positions)"),
        ({"attention_bias": True}, "llama with attention biases"),
    ],
)
def test_unsupported_checkpoints_say_why(tmp_path, change, why):
    from specrt.export.checkpoint_gguf import checkpoint_unsupported, write_checkpoint_gguf

    cfg = {**json.loads((REPO / "models" / "draft" / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert why in checkpoint_unsupported(tmp_path)
    with pytest.raises(ValueError, match="the kernels cannot run this checkpoint"):
        write_checkpoint_gguf(tmp_path, tmp_path / "x.gguf", "int4")


def test_default_engine_records_the_checkpoint_panels():
    """engines/default (make export): both models' panels quantized by specrt, the target's
    quality on the kernels recorded and within the bounds, the scratch GGUF files gone."""
    folder = REPO / "engines" / "default"
    if not (folder / "manifest.json").is_file():
        pytest.skip("engines/default not exported: run `make export`")
    m = json.loads((folder / "manifest.json").read_text())
    kern = m["extra"]["kernels"]
    assert kern["target"]["checkpoint"]["types"] == {"layers": "Q4_0", "embd": "Q8_0"}
    assert kern["draft"]["checkpoint"]["folder"] == "draft" and "gguf" not in kern["target"]
    q = m["extra"]["quality"]["kernels"]
    assert q["holds"] and q["humaneval"]["top1_agreement"] >= 0.95
    assert not (folder / ".kernels_scratch").exists() and {"target.panels", "draft.panels"} <= set(m["files"])


def test_bf16_checkpoint(tmp_path):
    """A bfloat16 checkpoint (most released ones): read through safetensors' torch framework
    (numpy has no bfloat16), quantized like a float16 one."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(REPO / "models" / "draft", folder)
    w = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(folder / "model.safetensors"))
    got, ref = _logits(folder, "int8", tmp_path, role="draft")
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.02
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9


def test_a_checkpoint_the_kernels_cannot_read_keeps_the_export(tmp_path):
    """The panels are an optional step: a tensor the layout does not know (here an extra
    projection) writes no panels, with one line, and no scratch file or half-written panels
    stay; the export's graphs are not touched."""
    from types import SimpleNamespace

    from safetensors.numpy import load_file, save_file

    from specrt.export.pipeline import ExportOptions, _kernel_records

    folder = tmp_path / "odd"
    shutil.copytree(REPO / "models" / "draft", folder)
    w = load_file(str(folder / "model.safetensors"))
    w["model.layers.0.mlp.extra_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"]
    save_file(w, str(folder / "model.safetensors"))
    out = tmp_path / "engine"
    out.mkdir()
    lines: list[str] = []
    meter = SimpleNamespace(phase=lambda *_: None)
    got = _kernel_records(folder, folder, out, {}, ExportOptions(precision="int4"), (0,), {}, meter, lines.append)
    assert got is None and lines[-1] == (
        "  kernels: no panels: checkpoint tensor model.layers.0.mlp.extra_proj.weight: not a tensor of the llama/qwen2/qwen3/phi3 layout the kernels run"
    )
    assert sorted(p.name for p in out.iterdir()) == []
