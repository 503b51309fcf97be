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

With ``temperature > 0`` the same loop does exact speculative *sampling*
(:mod:`~specrt.runtime.sampling`; Leviathan et al. 2023, Algorithm 1): the draft samples
each candidate from its warped distribution q, the target accepts it with probability
min(1, p/q), samples a correction from norm(max(0, p - q)) at the first rejection, or a
bonus token from p; the output follows the target's warped distribution exactly.
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
from .sampling import check_sampling_params, sample_token, speculative_verify, warp
from .speculative import argmax_token, draft_limit, greedy_verify, rollback_lengths, top1
from .tokenizer import TextCodec

PREFILL_CHUNK = 256  # widest prefill call; longer prompts are fed in chunks


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings for one call (``None`` = the engine manifest's default).

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1); output never overshoots.
        k_max: most draft candidates per verification pass (1..manifest k_max).
        threshold: draft confidence threshold in [0, 1] (0 = fixed k_max). Greedy: drafting
            stops, without proposing it, at a token whose raw top-1 probability is below it.
            Sampling: drafting stops *after* a sampled token whose *warped* draft
            probability q(x) is below it; that token is still proposed (see
            :meth:`Engine._rounds` for why).
        speculative: False runs the target alone (the baseline), one token per pass.
        temperature: 0 = greedy (bit-identical to the greedy path); > 0 samples from the
            warped distributions (exact speculative sampling).
        top_k: keep the k most probable tokens (ties kept); 0 = off. Sampling only.
        top_p: nucleus mass in (0, 1]; 1 = off. Sampling only (applied after top-k).
        seed: seed of the call's ``numpy.random.Generator(PCG64(seed))``; None = fresh
            entropy. The same seed and settings (k_max included) give the same tokens,
            whatever k_max is; different k_max values draw different tokens from the
            same distribution.
    """

    max_new_tokens: int = 128
    k_max: int | None = None
    threshold: float | None = None
    speculative: bool = True
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


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


class _WarpedRows:
    """Target logits rows warped on first access into preallocated float64 rows, so that
    :func:`~specrt.runtime.sampling.speculative_verify` warps only the rows it reads
    (none after the first rejection). ``logits`` is set per verification pass."""

    __slots__ = ("out", "args", "logits")

    def __init__(self, out: np.ndarray, args: tuple):
        self.out, self.args, self.logits = out, args, None

    def __getitem__(self, i: int) -> np.ndarray:
        return warp(self.logits[i], *self.args, out=self.out[i])


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
                max_new_tokens < 1, temperature < 0, top_k < 0, top_p outside (0, 1],
                seed < 0, wrong types.
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
        check_sampling_params(config.temperature, config.top_k, config.top_p, config.seed)
        return replace(
            config,
            k_max=int(k),
            threshold=float(th),
            max_new_tokens=int(n),
            temperature=float(config.temperature),
            top_k=int(config.top_k),
            top_p=float(config.top_p),
            seed=None if config.seed is None else int(config.seed),
        )

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
        """Generate, greedy or sampled (speculative or target-only); see the module docstring.

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

    def _sampling_buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float64 work buffers of the sampling path, allocated on first use and reused:
        q rows ``[k_max, vocab]``, p rows ``[k_max + 1, vocab]``, scratch ``[2, vocab]``."""
        bufs = getattr(self, "_sample_bufs", None)
        if bufs is None:
            k, v = self.manifest.k_max, self.manifest.vocab_size
            bufs = self._sample_bufs = (np.empty((k, v)), np.empty((k + 1, v)), np.empty((2, v)))
        return bufs

    def _rounds(self, prompt: list[int], cfg: GenerationConfig, stats: Stats) -> Iterator[tuple[list[int], str | None]]:
        """Core loop: yields (newly committed tokens, finish reason or None) per round.

        Sampling (``temperature > 0``): one ``Generator(PCG64(seed))`` per call; the first
        token and target-only tokens are sampled from the warped p; draft candidates from
        the warped q; verification is :func:`~specrt.runtime.sampling.speculative_verify`.

        Confidence threshold when sampling: the draft samples x ~ q, *proposes* it, and
        stops drafting after it when its warped probability q(x) < threshold (what Hugging
        Face's ``assistant_confidence_threshold`` does: its stopping criterion reads the
        processed scores of the token just generated). Warped, because q is the
        distribution x was drawn from and the one in the ratio p(x)/q(x): it is the
        draft's actual confidence in the proposal (raw probabilities ignore temperature,
        top-k and top-p). Proposed rather than dropped, because dropping x when q(x) is
        small would make the proposal follow q restricted to {q >= threshold}, not q, and
        the ratio p/q would then bias the output; stopping *after* x only shortens the
        round, a decision made from the draft's own information, which keeps the output
        exactly p. (Greedy keeps its own rule, bit for bit: drop a token whose raw top-1
        probability is below the threshold; exact there because it precedes the proposal.)
        """
        with self._lock:
            m = self.manifest
            vocab, eos, max_ctx = m.vocab_size, m.eos_token_id, m.max_ctx
            k_max, threshold, budget = cfg.k_max, cfg.threshold, cfg.max_new_tokens
            target, draft, scratch = self.target, self.draft, self._scratch
            sampling = cfg.temperature > 0.0
            if sampling:
                rng = np.random.Generator(np.random.PCG64(cfg.seed))
                q_rows, p_rows, work = self._sampling_buffers()
                wargs = (vocab, cfg.temperature, cfg.top_k, cfg.top_p)
                p_lazy = _WarpedRows(p_rows, wargs)
            clock = time.perf_counter
            stats.prompt_tokens = len(prompt)
            stats.accepted_hist = [0] * (k_max + 1)
            hist = stats.accepted_hist
            t_start = clock()
            seq = list(prompt)
            row = self._feed(target, seq, 0)
            first = sample_token(warp(row, *wargs, out=p_rows[0]), rng, work[1]) if sampling else argmax_token(row, vocab)
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
                        if sampling:
                            q_row = warp(row, *wargs, out=q_rows[len(cands)])
                            tok = sample_token(q_row, rng, work[1])
                            cands.append(tok)
                            if q_row[tok] < threshold:  # propose x, then stop (see docstring)
                                break
                        else:
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
                if sampling:
                    p_lazy.logits = logits
                    n_acc, nxt = speculative_verify(cands, q_rows[: len(cands)], p_lazy, rng, work)
                else:
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
