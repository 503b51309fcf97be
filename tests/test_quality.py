"""The quality scorer (:mod:`specrt.runtime.lab.quality`) against hand-computed values and
independent oracles, so that a wrong scorer fails: an agreement computed against itself, a
loss scored on the wrong token or over padding columns. And the PyTorch reference model the
export scores large targets against (:class:`specrt.export.torch_reference.TorchModel`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specrt.runtime.lab.quality import Scores, compare, score_model, score_rows


def test_score_rows_hand_computed():
    # vocab 2 (a third, padding column must be ignored even though it is the largest)
    logits = np.array([[0.0, math.log(3.0), 50.0], [math.log(2.0), 0.0, 50.0]], np.float32)
    s = score_rows(logits, np.array([1, 1]), vocab=2)
    assert s.argmax.tolist() == [1, 0]
    assert s.logprob == pytest.approx([math.log(3 / 4), math.log(1 / 3)], abs=1e-6)
    # scored a block of rows at a time (bounded memory): every block size gives the same scores
    rng = np.random.default_rng(1)
    big, tgt = rng.normal(size=(70, 9)).astype(np.float32), rng.integers(0, 8, size=70)
    whole = score_rows(big, tgt, vocab=8, block=70)
    for block in (1, 3, 32):
        part = score_rows(big, tgt, vocab=8, block=block)
        assert part.argmax.tolist() == whole.argmax.tolist() and part.logprob.tolist() == whole.logprob.tolist()
    x = big[:, :8].astype(np.float64)
    assert whole.logprob == pytest.approx(x[np.arange(70), tgt] - np.log(np.exp(x).sum(-1)), abs=1e-9)


def test_compare_hand_computed():
    ref = Scores(np.array([1, 0, 2, 2]), np.log(np.array([0.5, 0.25, 0.5, 1.0])))
    got = Scores(np.array([1, 1, 2, 0]), np.log(np.array([0.25, 0.25, 0.5, 0.5])))
    c = compare(ref, got)
    assert c["positions"] == 4 and c["top1_agreement"] == 0.5
    assert c["loss_reference"] == pytest.approx(-(math.log(0.5) * 2 + math.log(0.25)) / 4)
    assert c["loss"] == pytest.approx(-(math.log(0.25) * 2 + math.log(0.5) * 2) / 4)
    assert c["loss_delta"] == pytest.approx(c["loss"] - c["loss_reference"])


def _full_forward_scores(model, seq: list[int], first: int, vocab: int) -> Scores:
    """The oracle: one call over the whole sequence, log-softmax by hand at the true next
    tokens (the scorer calls the model in chunks and reads the rows itself)."""
    rows = model.run(seq[:-1], 0)[:, :vocab].astype(np.float64)[first:]
    nxt = np.asarray(seq[first + 1 :])
    lse = np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) + rows.max(-1)
    return Scores(rows.argmax(-1), rows[np.arange(len(rows)), nxt] - lse)


class _Narrow:
    """A model seen through a narrower ``max_q`` (so the scorer must chunk its calls)."""

    def __init__(self, model, max_q: int):
        self.model, self.max_q, self.max_ctx, self.widths = model, max_q, model.max_ctx, []

    def run(self, tokens, start):
        self.widths.append(len(tokens))
        return self.model.run(tokens, start)


def test_score_model_matches_a_full_forward_and_itself(tiny_pair):
    from specrt import Engine

    e = Engine(tiny_pair[2])
    vocab = e.manifest.vocab_size
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, vocab, size=n).tolist() for n in (40, 23, 65)]
    firsts = [0, 5, 30]
    got = score_model(e.target, seqs, firsts, vocab)
    want = [_full_forward_scores(e.target, s, f, vocab) for s, f in zip(seqs, firsts)]
    assert got.argmax.tolist() == np.concatenate([w.argmax for w in want]).tolist()
    assert got.logprob == pytest.approx(np.concatenate([w.logprob for w in want]), abs=1e-5)
    assert len(got.argmax) == sum(len(s) - 1 - f for s, f in zip(seqs, firsts))
    # called 7 rows at a time, calls wholly before ``first`` still fill the KV rows the rest read
    narrow = _Narrow(e.target, 7)
    got7 = score_model(narrow, seqs, firsts, vocab)
    assert narrow.widths and max(narrow.widths) == 7
    assert got7.argmax.tolist() == got.argmax.tolist()
    assert got7.logprob == pytest.approx(got.logprob, abs=1e-5)
    self_cmp = compare(got, score_model(e.target, seqs, firsts, vocab))
    assert self_cmp["top1_agreement"] == 1.0 and self_cmp["loss_delta"] == 0.0
    # a different model is scored as different (the scorer does not compare a model with itself)
    other = compare(got, score_model(e.draft, seqs, firsts, vocab))
    assert other["top1_agreement"] < 1.0 and other["loss_delta"] != 0.0


def test_torch_reference_rolls_back_like_a_runtime_model(tiny_pair):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from specrt.export.torch_reference import TorchModel

    target = tiny_pair[1]
    tm = TorchModel(target, max_ctx=128, max_q=64)
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, tm.vocab, size=40).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(tm.run(ids[:30], 0), ref[:30], atol=1e-4)
    np.testing.assert_allclose(tm.run(ids[30:], 30), ref[30:], atol=1e-4)
    np.testing.assert_allclose(tm.run(ids[20:25], 20), ref[20:25], atol=1e-4)  # rolled back to 20
    np.testing.assert_allclose(tm.run(ids[:10], 0), ref[:10], atol=1e-4)  # a new sequence
    from specrt.runtime.errors import InputError

    with pytest.raises(InputError):
        tm.run(ids[:5], 20)  # beyond the cache


def test_export_quality_record_scores_the_export_against_fp32_pytorch(int4_pair):
    """Guards the call site of the scorer (export_pair -> export_quality): the quality record
    an export writes must score the *exported* target against the *fp32* target. Recomputed
    here from independent models on the record's own sets: the fp32 reference is the
    checkpoint run by PyTorch (TorchModel; the record's fp32 ONNX graph equals it to ~1e-5),
    the exported target is the int4 engine's. A record comparing the reference with itself
    (or the export with itself) has loss == loss_reference and agreement 1.0: int4 of this
    model differs measurably (measured: top-1 agreement 0.77 held-out and 0.69 HumanEval,
    |loss delta| 0.030 and 0.145 nats), so the checks below fail on it."""
    pytest.importorskip("torch")
    import json
    from pathlib import Path

    from tokenizers import Tokenizer

    from specrt import Engine
    from specrt.export.torch_reference import TorchModel
    from specrt.runtime.lab.quality import encode_texts, heldout_windows, stdlib_heldout_texts

    _, target_dir, folder = int4_pair
    e = Engine(folder)
    m = e.manifest
    rec, vocab = m.extra["quality"], m.vocab_size
    assert m.target.precision == "int4"
    ref = TorchModel(target_dir, m.max_ctx, 256)
    h, he = rec["heldout_stdlib"], rec["humaneval"]
    tok = Tokenizer.from_file(str(folder / m.tokenizer_file))
    data = encode_texts(lambda t: tok.encode(t, add_special_tokens=False).ids, stdlib_heldout_texts(), m.eos_token_id)
    wins = heldout_windows(data, h["windows"], h["window"]).tolist()
    prompts = [json.loads(x)["prompt"] for x in Path(he["file"]).read_text().splitlines() if x.strip()][: he["prompts"]]
    seqs, firsts = [], []
    for p in prompts:  # each prompt and the fp32 reference's greedy continuation (full forwards)
        ids, out = e.codec.encode(p), []
        while len(out) < he["new_tokens"] and not (out and out[-1] in m.stop_ids()):
            out.append(int(ref.run(ids + out, 0)[-1, :vocab].argmax()))
        seqs.append(ids + out)
        firsts.append(len(ids) - 1)
    assert (h["windows"], h["window"], he["prompts"], he["new_tokens"]) == (2, 32, 2, 8)  # conftest's int4_pair
    for name, (s, f) in {"heldout_stdlib": (wins, [0] * len(wins)), "humaneval": (seqs, firsts)}.items():
        fp32, int4 = score_model(ref, s, f, vocab), score_model(e.target, s, f, vocab, m.min_q())
        got = rec[name]
        assert got["positions"] == len(fp32.argmax) == (64 if name == "heldout_stdlib" else 16), name
        assert got["loss_reference"] == pytest.approx(-fp32.logprob.mean(), abs=1e-6), name  # the reference is fp32 (measured 2e-8)
        assert got["loss"] == pytest.approx(-int4.logprob.mean(), abs=1e-9), name  # the scored model is the export (measured 0)
        assert got["top1_agreement"] == pytest.approx(float((fp32.argmax == int4.argmax).mean())), name
        # int4 differs from fp32: a self-comparison (delta 0, agreement 1) cannot pass
        assert abs(got["loss_delta"]) > 0.01 and got["top1_agreement"] < 0.95, (name, got)
