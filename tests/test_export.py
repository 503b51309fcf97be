"""Export parity: the oracle is PyTorch. A q-token call with past length P through the
runtime's IO-bound backend equals a full PyTorch forward over P+q tokens (fp32, 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.backends.ort import OrtModel
from specrt.runtime.manifest import load_manifest


@pytest.mark.parametrize("past", [0, 1, 37])
@pytest.mark.parametrize("q", [1, 5, 9])
def test_runtime_call_matches_full_pytorch_forward(tiny_pair, past, q):
    import torch
    from transformers import AutoModelForCausalLM

    _, target_dir, folder = tiny_pair
    m = load_manifest(folder)
    model = OrtModel(folder / m.target.file, m.target, m.max_ctx, 64)
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    rng = np.random.default_rng(past * 10 + q)
    ids = rng.integers(0, m.vocab_size, size=past + q).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, past:].numpy()
    if past:
        model.run(ids[:past], 0)  # fills KV rows [0, past) through the runtime
    got = model.run(ids[past:], past).copy()
    assert np.abs(got - ref).max() < 1e-4


def test_manifest_records_parity_and_dims(tiny_pair):
    m = load_manifest(tiny_pair[2])
    for e in (m.draft, m.target):
        assert e.parity and max(e.parity.values()) < 1e-4
        assert set(e.parity) >= {"logits_q1_L0", "logits_q9_L37", "kv_q9_L37"}
        assert e.inputs[:2] == ("input_ids", "position_ids") and e.outputs[0] == "logits"
    assert m.target.n_layers == 2 and m.target.n_kv_heads == 2 and m.draft.n_layers == 1
    assert m.k_min == 1 and m.k_max == 8 and m.max_ctx == 256
    assert m.tools["torch"].startswith("2.13")


def test_export_drops_only_the_torchvision_notices():
    """torch.onnx logs "torchvision is not installed. Skipping torchvision::<op>" per op when
    its registry is built (logger ``torch.onnx._internal.exporter._registration``); specrt's
    export filters exactly those records, every other record of that logger still passes."""
    import inspect
    import logging

    from torch.onnx._internal.exporter import _registration

    import specrt.export.onnx_export  # noqa: F401  (installs the filter)

    assert _registration.logger.name == "torch.onnx._internal.exporter._registration"
    assert 'logger.warning("torchvision is not installed. Skipping %s"' in inspect.getsource(_registration)  # what torch logs
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    _registration.logger.addHandler(handler)
    try:
        _registration.logger.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
        _registration.logger.warning("another warning")
    finally:
        _registration.logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning"]
