"""Progress lines of the long export phases and the silenced third-party INFO floods (issue 32, item 4)."""

from __future__ import annotations

import logging
import sys

import numpy as np

from specrt.export.progress import Progress, format_seconds, quiet_third_party_logs


class Clock:
    """A settable clock for :class:`Progress` (seconds)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_throttled_and_says_what_is_done_and_left():
    clock, lines = Clock(), []
    p = Progress("quality record", 40, lines.append, unit="rows", every=5, clock=clock)
    for t in (1, 2, 3):  # within the first 5 s: nothing
        clock.now = t
        p.advance()
    assert lines == []
    clock.now = 180.0
    p.update(12)
    assert lines == ["quality record: 12/40 rows, 3 min elapsed, ~7 min left"]
    clock.now = 181.0
    p.advance()  # 1 s after the last line: nothing
    assert len(lines) == 1
    clock.now = 600.0
    p.update(40)
    p.done()  # the last line already said 40/40: not repeated
    assert lines[1:] == ["quality record: 40/40 rows, 10 min elapsed"]
    p2 = Progress("x", 3, lines.append, every=5, clock=clock)
    p2.advance()
    p2.done()
    p2.done()  # once
    assert lines[2:] == ["x: 1/3 items, 0 s elapsed, ~0 s left"]


def test_a_fast_phase_writes_one_line():
    clock, lines = Clock(), []
    p = Progress("exactness probe", None, lines.append, unit="patterns", clock=clock)
    for i in range(30):
        clock.now = i * 0.1
        p(i + 1, 30)  # the callback form sets the total
    p.done()
    assert lines == ["exactness probe: 30/30 patterns, 3 s elapsed"]


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 42, 89, 180, 3600, 5400, 7500)] == ["0 s", "42 s", "89 s", "3 min", "60 min", "1 h 30 min", "2 h 05 min"]


class Fake:
    """A runtime model stand-in: logits rows of zeros (a uniform distribution)."""

    def __init__(self, vocab=16, max_q=8, max_ctx=64):
        self.vocab, self.max_q, self.max_ctx = vocab, max_q, max_ctx

    def run(self, tokens, start):
        return np.zeros((len(tokens), self.vocab), np.float32)


def test_quality_scoring_reports_every_row():
    """score_model (the quality record's loop) calls its progress callback once per sequence."""
    from specrt.runtime.lab.quality import score_model

    calls = []
    seqs = [list(range(10)), list(range(5)), list(range(12))]
    s = score_model(Fake(), seqs, [0, 2, 0], 16, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert len(s.argmax) == 9 + 2 + 11


def test_exactness_probe_reports_every_pattern():
    from specrt.runtime.lab.exactness import measure

    calls = []
    measure([("t2", Fake(max_q=20)), ("t1", Fake(max_q=20))], 16, [1, 2, 3], offsets=(0, 1), length=12, progress=lambda d, t: calls.append((d, t)))
    # the reference, q1, then q2/q3 at 2 offsets, then q1..q3 on the second model
    assert [d for d, _ in calls] == list(range(1, 1 + 1 + 4 + 3 + 1)) and {t for _, t in calls} == {9}


def test_third_party_info_floods_are_silenced_within_the_export_only(caplog):
    """onnx_ir's "Replaced initializer" records (INFO) are dropped inside the block, its
    warnings are not, and the level is restored afterwards; the user's own INFO stays."""
    root = logging.getLogger()
    saved = root.level
    root.setLevel(logging.WARNING)  # Python's default when the export starts
    caplog.handler.setLevel(logging.NOTSET)
    lg = logging.getLogger("onnx_ir.passes.common.initializer_deduplication")
    try:
        with quiet_third_party_logs():
            root.setLevel(logging.INFO)  # what importing onnxruntime's quantizer does (logging.basicConfig)
            lg.info("Replaced initializer 'val_25' with existing initializer 'val_22'")
            lg.warning("a warning still shows")
            logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").info("skip to quantize /model/x ...")
            logging.getLogger("onnxscript.optimizer._constant_folding").info("Skipping constant folding")
            logging.getLogger("user").info("the user's own record")
        lg.info("after the export")
    finally:
        root.setLevel(saved)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["a warning still shows", "the user's own record", "after the export"]


def test_child_process_heartbeat():
    """The model builder's child process: a line every `every` seconds while it runs."""
    from specrt.export.resources import run_measured

    lines = []
    code, out, _ = run_measured([sys.executable, "-c", "import time; time.sleep(0.7); print('ok')"], lines.append, "builder", every=0.2)
    assert code == 0 and out.strip() == "ok"
    assert len(lines) >= 2 and all(ln.startswith("builder: running, ") and ln.endswith(" elapsed") for ln in lines)
