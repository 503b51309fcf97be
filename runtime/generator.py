"""The generator loop: confidence-threshold drafting, one verification pass, early stop,
rollback; plus the target-only baseline on the same backend.

One round (Leviathan et al. 2023, Algorithm 1, greedy case; confidence-threshold drafting
as in Hugging Face assisted generation's ``assistant_confidence_threshold``)::

    1. draft: feed the tokens the draft has not seen (pending included), then propose
       c_1, c_2, ... token by token; stop when the draft's top-1 probability is below
       ``threshold``, at ``k_max``, after EOS, or at the budget/context limit
       (:func:`~specrt.runtime.speculative.draft_limit`);
    2. verify: one target pass over [pending, c_1..c_n] (q = n + 1);
    3. accept left to right, stop at the first mismatch
       (:func:`~specrt.runtime.speculative.greedy_verify`);
    4. commit c_1..c_m and the target's token (correction or bonus); the KV lengths roll
       back (:func:`~specrt.runtime.speculative.rollback_lengths`).

The output equals the target's own greedy output token for token.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import InputError
from .manifest import Manifest, load_manifest
from .ort_backend import OrtModel, ThreadConfig
from .speculative import argmax_token, draft_limit, greedy_verify, rollback_lengths, top1
from .tokenizer import TextCodec

PREFILL_CHUNK = 256  # widest prefill call; longer prompts are fed in chunks


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings for one call (``None`` = the engine manifest's default).

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1); output never overshoots.
        k_max: most draft candidates per verification pass (1..manifest k_max).
        threshold: draft confidence threshold in [0, 1]; drafting stops when the draft's
            top-1 probability is below it (0 = fixed k_max).
        speculative: False runs the target alone (the baseline), one token per pass.
    """

    max_new_tokens: int = 128
    k_max: int | None = None
    threshold: float | None = None
    speculative: bool = True


@dataclass
class Stats:
    """What one generation did (times in seconds, counts in tokens or passes).

    ``accepted_hist[m]`` counts verification passes that accepted m candidates.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    passes: int = 0  # target passes after prefill (verification or plain decode)
    draft_calls: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    ttft_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (nan when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else math.nan

    @property
    def mean_accepted(self) -> float:
        """Mean accepted candidates per verification pass."""
        return self.accepted / self.passes if self.passes else math.nan

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens committed per target pass (accepted + correction/bonus)."""
        return (self.new_tokens - 1) / self.passes if self.passes else math.nan

    @property
    def tokens_per_second(self) -> float:
        """New tokens / total wall time of the call (prefill included)."""
        return self.new_tokens / self.total_seconds if self.total_seconds else math.nan

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted=self.mean_accepted,
            tokens_per_pass=self.tokens_per_pass,
            tokens_per_second=self.tokens_per_second,
        )
        return d


@dataclass
class GenerationResult:
    """Output of :meth:`Engine.generate`.

    Attributes:
        tokens: generated ids (EOS included when it ended the output).
        text: decoded text of ``tokens`` (special tokens left out).
        finish_reason: ``"stop"`` (EOS) or ``"length"`` (max_new_tokens or context full).
        stats: :class:`Stats`.
    """

    tokens: list[int]
    text: str
    finish_reason: str
    stats: Stats


class Engine:
    """A loaded engine folder: manifest, tokenizer, and both models on onnxruntime.

    One generation at a time per Engine (it owns the KV buffers): concurrent calls from
    threads are serialised by a lock. Load several Engines for parallel generations.

    Args:
        folder: the engine folder written by ``specrt export``.
        threads: onnxruntime thread settings for both sessions.
        verify_hashes: check the files' SHA-256 against the manifest at load.
        backend: ``"ort-cpu"``, ``"ort-cuda"`` or ``"tensorrt"``; None picks the first
            usable of tensorrt, ort-cuda, ort-cpu (:mod:`specrt.runtime.backends`; the GPU
            backends are not verified on a GPU yet, see docs/GPU.md). Stored as ``backend``.

    Raises:
        EngineError: missing/half-written folder, unknown manifest version, mismatched pair,
            altered files.
        BackendError: a backend this machine or folder cannot run (the message lists the
            available ones).
    """

    def __init__(self, folder: str | Path, threads: ThreadConfig | None = None, verify_hashes: bool = True, backend: str | None = None):
        self.folder = Path(folder)
        self.manifest: Manifest = load_manifest(self.folder, verify_hashes=verify_hashes)
        m = self.manifest
        threads = threads or ThreadConfig()
        self.codec = TextCodec(self.folder / m.tokenizer_file, m.bos_token_id, m.add_bos)
        from .backends import load_models, resolve_backend

        self.backend = resolve_backend(backend, m)
        self.target, self.draft = load_models(
            self.backend, self.folder, m, threads, max(PREFILL_CHUNK, m.k_max + 1), PREFILL_CHUNK, verify_hashes
        )
        self._scratch = np.empty(m.draft.vocab_size, np.float32)
        self._lock = threading.Lock()

    # ---- validation ------------------------------------------------------------------
    def resolve(self, config: GenerationConfig) -> GenerationConfig:
        """Fill defaults from the manifest and validate.

        Raises:
            InputError: k_max outside 1..manifest k_max, threshold outside [0, 1],
                max_new_tokens < 1, wrong types.
        """
        m = self.manifest
        k = config.k_max if config.k_max is not None else m.defaults.get("k_max", m.k_max)
        th = config.threshold if config.threshold is not None else m.defaults.get("threshold", 0.0)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not m.k_min <= k <= m.k_max:
            raise InputError(f"k_max={k!r}; k_max must be an integer in {m.k_min}..{m.k_max}, the range these engines were built for")
        if isinstance(th, bool) or not isinstance(th, (int, float)) or not 0.0 <= th <= 1.0:
            raise InputError(f"threshold={th!r}; threshold must be a number in [0, 1]")
        n = config.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise InputError(f"max_new_tokens={n!r}; max_new_tokens must be an integer >= 1")
        return replace(config, k_max=int(k), threshold=float(th), max_new_tokens=int(n))

    def prompt_ids(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        """Token ids for a text prompt or validated ids for an id prompt.

        Raises:
            InputError: empty prompt, ids not 1-D integers, ids outside the vocab, or a
                prompt that leaves no room in the context (needs < max_ctx tokens).
        """
        m = self.manifest
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        else:
            arr = np.asarray(prompt)
            if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
                raise InputError(f"prompt ids must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= m.vocab_size):
                raise InputError(f"prompt ids must be in 0..{m.vocab_size - 1}; got min {arr.min()} max {arr.max()}")
            ids = arr.astype(np.int64).tolist()
        if not ids:
            raise InputError("empty prompt; give at least one token")
        if len(ids) >= m.max_ctx:
            raise InputError(
                f"prompt has {len(ids)} tokens; the engines' context is max_ctx={m.max_ctx}, so a prompt may have at most {m.max_ctx - 1}"
            )
        return ids

    # ---- generation ------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig()) -> GenerationResult:
        """Generate greedily (speculative or target-only); see the module docstring.

        Args:
            prompt: text, or token ids (list / int32 / int64 array).
            config: :class:`GenerationConfig`.

        Returns:
            :class:`GenerationResult`.

        Raises:
            InputError: bad prompt or config (see :meth:`resolve`, :meth:`prompt_ids`).
            NumericsError: NaN/inf logits.
        """
        cfg = self.resolve(config)
        ids = self.prompt_ids(prompt)
        stats = Stats()
        out: list[int] = []
        finish = "length"
        for piece, reason in self._rounds(ids, cfg, stats):
            out.extend(piece)
            if reason:
                finish = reason
        return GenerationResult(tokens=out, text=self.codec.decode(out), finish_reason=finish, stats=stats)

    def stream(self, prompt: str | Sequence[int] | np.ndarray, config: GenerationConfig = GenerationConfig()) -> Iterator[str]:
        """Yield the output text in pieces as rounds commit tokens.

        Text is released only at UTF-8-safe points (a token that ends inside a multi-byte
        character waits for the next one); the pieces concatenate to the final text.
        Raises what :meth:`generate` raises.
        """
        cfg = self.resolve(config)
        ids = self.prompt_ids(prompt)
        out: list[int] = []
        sent = ""
        for piece, _ in self._rounds(ids, cfg, Stats()):
            out.extend(piece)
            text = self.codec.decode(out)
            if text.endswith("\ufffd"):
                continue
            if len(text) > len(sent):
                yield text[len(sent) :]
                sent = text
        text = self.codec.decode(out)
        if len(text) > len(sent):
            yield text[len(sent) :]

    def _feed(self, model: OrtModel, tokens: Sequence[int], start: int) -> np.ndarray:
        """Run ``tokens`` from KV length ``start`` in chunks; returns the last logits row."""
        step = model.max_q
        for i in range(0, len(tokens), step):
            logits = model.run(tokens[i : i + step], start + i)
        return logits[-1]

    def _rounds(self, prompt: list[int], cfg: GenerationConfig, stats: Stats) -> Iterator[tuple[list[int], str | None]]:
        """Core loop: yields (newly committed tokens, finish reason or None) per round."""
        with self._lock:
            m = self.manifest
            vocab, eos, max_ctx = m.vocab_size, m.eos_token_id, m.max_ctx
            k_max, threshold, budget = cfg.k_max, cfg.threshold, cfg.max_new_tokens
            target, draft, scratch = self.target, self.draft, self._scratch
            clock = time.perf_counter
            stats.prompt_tokens = len(prompt)
            stats.accepted_hist = [0] * (k_max + 1)
            hist = stats.accepted_hist
            t_start = clock()
            seq = list(prompt)
            first = argmax_token(self._feed(target, seq, 0), vocab)
            seq.append(first)
            t1 = clock()
            stats.prefill_seconds = stats.ttft_seconds = t1 - t_start
            n_prompt = len(prompt)
            draft_len = 0
            t_draft = t_target = 0.0
            reason = None
            if first == eos:
                reason = "stop"
            elif budget == 1 or len(seq) >= max_ctx:
                reason = "length"
            yield [first], reason
            while reason is None:
                seq_len = len(seq)
                n_max = draft_limit(k_max, budget - (seq_len - n_prompt), seq_len, max_ctx) if cfg.speculative else 0
                cands: list[int] = []
                if n_max:
                    t0 = clock()
                    row = self._feed(draft, seq[draft_len:], draft_len)
                    draft_len = seq_len
                    stats.draft_calls += 1
                    while True:
                        tok, conf = top1(row, vocab, scratch)
                        if conf < threshold:
                            break
                        cands.append(tok)
                        if len(cands) == n_max or tok == eos:
                            break
                        row = draft.run((tok,), draft_len)[0]
                        draft_len += 1
                        stats.draft_calls += 1
                    t_draft += clock() - t0
                t0 = clock()
                logits = target.run([seq[-1], *cands], seq_len - 1)
                n_acc, nxt = greedy_verify(cands, logits, vocab)
                t_target += clock() - t0
                stats.passes += 1
                stats.proposed += len(cands)
                stats.accepted += n_acc
                hist[n_acc] += 1
                new = cands[:n_acc]
                new.append(nxt)
                if eos in new:
                    new = new[: new.index(eos) + 1]
                    reason = "stop"
                seq.extend(new)
                _, draft_len = rollback_lengths(seq_len, draft_len, n_acc)
                if reason is None and (len(seq) - n_prompt >= budget or len(seq) >= max_ctx):
                    reason = "length"
                yield new, reason
            stats.new_tokens = len(seq) - n_prompt
            stats.draft_seconds = t_draft
            stats.target_seconds = t_target
            stats.total_seconds = clock() - t_start
