"""Reproducible trainer for specrt's embedded default draft/target pair.

Builds, from the Python standard library's own source (``*.py`` of the running
interpreter, test folders and site-packages excluded, files sorted):

1. a byte-level BPE tokenizer (``tokenizers`` library);
2. a Llama-architecture target model (``LlamaForCausalLM``, grouped-query attention),
   trained from scratch with next-token cross-entropy;
3. a much smaller Llama-architecture draft model, distilled from the target's logits
   (forward KL, Hinton et al. 2015 "Distilling the Knowledge in a Neural Network").

Everything is seeded and runs a fixed number of steps, so the same interpreter, torch
version and command give the same weights. Both models are saved with
``save_pretrained`` (fp16 safetensors) plus the tokenizer, so they load like any Hugging
Face checkpoint. Figures (losses, agreement, timings) go to ``OUT/train_log.json``.

Usage::

    python scripts/train_default_pair.py --out models --target-steps 1200 --draft-steps 600

Needs the ``[export]`` extra (torch, transformers). Not part of the runtime.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# the held-out split and windows have one definition, shared with the quality scores of exports
from specrt.runtime.lab.quality import HELDOUT_EVERY, heldout_windows, stdlib_files

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class ModelSize:
    """Llama dimensions for one model of the pair."""

    hidden: int  # hidden size d_model
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention when < heads)
    intermediate: int  # SwiGLU inner width


TARGET = ModelSize(hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1408)
DRAFT = ModelSize(hidden=192, layers=2, heads=4, kv_heads=2, intermediate=512)
VOCAB = 4096
SEQ = 256
MAX_POS = 2048


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def llama_config(size: ModelSize, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def batches(data: np.ndarray, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - SEQ - 1, size=batch)
        x = np.stack([data[s : s + SEQ + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(x)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def eval_loss(model, windows: torch.Tensor) -> float:
    model.eval()
    losses = []
    for chunk in windows.split(8):
        logits = model(chunk[:, :-1]).logits
        losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1)).item())
    model.train()
    return float(np.mean(losses))


@torch.no_grad()
def agreement(draft, target, windows: torch.Tensor) -> float:
    draft.eval()
    target.eval()
    agree = total = 0
    for chunk in windows.split(8):
        a = draft(chunk[:, :-1]).logits.argmax(-1)
        b = target(chunk[:, :-1]).logits.argmax(-1)
        agree += (a == b).sum().item()
        total += a.numel()
    draft.train()
    return agree / total


def train(model, data, steps, batch, peak_lr, seed, log, name, teacher=None):
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = batches(data, batch, seed)
    model.train()
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup=min(100, steps // 10 + 1))
        x = next(gen)
        logits = model(x[:, :-1]).logits
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        else:
            with torch.no_grad():
                t_logits = teacher(x[:, :-1]).logits
            # forward KL(p_target || q_draft), per token
            loss = F.kl_div(
                F.log_softmax(logits, -1).reshape(-1, VOCAB),
                F.log_softmax(t_logits, -1).reshape(-1, VOCAB),
                log_target=True,
                reduction="batchmean",
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            el = time.time() - t0
            tps = (step + 1) * batch * SEQ / el
            print(f"[{name}] step {step}/{steps} loss {loss.item():.4f} {tps:.0f} tok/s {el:.0f}s", flush=True)
            log.setdefault(f"{name}_curve", []).append([step, round(loss.item(), 4)])
    log[f"{name}_train_seconds"] = round(time.time() - t0, 1)
    log[f"{name}_final_train_loss"] = round(loss.item(), 4)


def grow_depth(model, shallow_state: dict) -> None:
    """Initialise ``model`` (n layers) from the state dict of a shallower model (m layers, n % m == 0).

    Layer i of the deep model copies layer ``i // (n // m)`` of the shallow one; in every copy
    but the first of each group, ``o_proj`` and ``down_proj`` are zeroed so that the block
    adds nothing to the residual stream: the deep model starts with the shallow model's
    exact function and training only improves on it (function-preserving growth, as in
    Chen et al. 2016 "Net2Net" and Gong et al. 2019 "progressive stacking").
    Raises ``ValueError`` when the layer counts do not divide.
    """
    n = model.config.num_hidden_layers
    m = 1 + max(int(k.split(".")[2]) for k in shallow_state if k.startswith("model.layers."))
    if n % m:
        raise ValueError(f"cannot grow {m} layers to {n}: {n} is not a multiple of {m}")
    rep = n // m
    new = {}
    for k, v in shallow_state.items():
        if not k.startswith("model.layers."):
            new[k] = v
            continue
        parts = k.split(".")
        i = int(parts[2])
        for j in range(rep):
            parts[2] = str(i * rep + j)
            w = v.clone()
            if j and (k.endswith("o_proj.weight") or k.endswith("down_proj.weight")):
                w.zero_()
            new[".".join(parts)] = w
    missing, unexpected = model.load_state_dict(new, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k and k != "lm_head.weight"]:
        raise ValueError(f"growth left keys unmatched: missing {missing}, unexpected {unexpected}")


def save(model, tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None).save_pretrained(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--work", type=Path, default=Path(".work"))
    ap.add_argument("--target-steps", type=int, default=1200)
    ap.add_argument("--draft-steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stage", choices=["all", "data", "target", "draft"], default="all")
    ap.add_argument("--init-draft", type=Path, default=None, help="continue distilling from this saved draft (fp16 -> fp32)")
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--target-layers", type=int, default=TARGET.layers, help="decoder layers of the target (default %(default)s)")
    ap.add_argument(
        "--grow-from",
        type=Path,
        default=None,
        help="initialise the target by depth growth from this fp32 state dict of a shallower target "
        "(each layer copied; the copies' o_proj and down_proj zeroed, so training starts from the "
        "shallower model's exact function)",
    )
    ap.add_argument("--target-lr", type=float, default=2e-3)
    args = ap.parse_args(argv)
    target_size = replace(TARGET, layers=args.target_layers)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "train_log.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}
    log.update(
        command=" ".join([Path(sys.executable).name] + sys.argv),
        seed=args.seed,
        python=sys.version.split()[0],
        torch=torch.__version__,
        vocab=VOCAB,
        seq=SEQ,
        batch=args.batch,
        target_size=asdict(target_size),
        draft_size=asdict(DRAFT),
    )
    tok_path = args.work / "tokenizer.json"
    if args.stage in ("all", "data") or not tok_path.exists():
        files = stdlib_files()
        train_files = [f for i, f in enumerate(files) if i % HELDOUT_EVERY]
        held_files = [f for i, f in enumerate(files) if not i % HELDOUT_EVERY]
        t0 = time.time()
        tok = train_tokenizer(read_texts(train_files))
        tok.save(str(tok_path))
        np.save(args.work / "train.npy", encode(tok, read_texts(train_files)))
        np.save(args.work / "heldout.npy", encode(tok, read_texts(held_files)))
        log.update(files_train=len(train_files), files_heldout=len(held_files), tokenizer_seconds=round(time.time() - t0, 1))
    tok = Tokenizer.from_file(str(tok_path))
    eos_id = tok.token_to_id(EOS)
    train_data = np.load(args.work / "train.npy")
    held = np.load(args.work / "heldout.npy")
    log.update(tokens_train=int(len(train_data)), tokens_heldout=int(len(held)))
    windows = torch.from_numpy(heldout_windows(held, 64, SEQ))

    target_ckpt = args.work / ("target_fp32.pt" if target_size == TARGET else f"target_fp32_L{target_size.layers}.pt")
    if args.stage in ("all", "target"):
        torch.manual_seed(args.seed)
        target = LlamaForCausalLM(llama_config(target_size, eos_id))
        name = "target"
        if args.grow_from is not None:
            grow_depth(target, torch.load(args.grow_from))
            name = "target_grown"
            log["target_grown_from"] = str(args.grow_from)
            log["target_loss_at_growth"] = round(eval_loss(target, windows), 4)
        log["target_params"] = sum(p.numel() for p in target.parameters())
        train(target, train_data, args.target_steps, args.batch, args.target_lr, args.seed, log, name)
        log["target_heldout_loss"] = round(eval_loss(target, windows), 4)
        torch.save(target.state_dict(), target_ckpt)
        save(target, tok, args.out / "target")
        args.out.mkdir(parents=True, exist_ok=True)
        log_path.write_text(json.dumps(log, indent=1))
    if args.stage in ("all", "draft"):
        target = LlamaForCausalLM(llama_config(target_size, eos_id))
        target.load_state_dict(torch.load(target_ckpt))
        target.eval()
        for p in target.parameters():
            p.requires_grad_(False)
        torch.manual_seed(args.seed + 1)
        draft = LlamaForCausalLM(llama_config(DRAFT, eos_id))
        name = "draft"
        if args.init_draft is not None:
            draft = LlamaForCausalLM.from_pretrained(str(args.init_draft), dtype=torch.float32)
            name = "draft_continued"
            log["draft_continued_from"] = {k: log.get(k) for k in ("draft_train_seconds", "draft_target_top1_agreement_heldout")}
        log["draft_params"] = sum(p.numel() for p in draft.parameters())
        train(draft, train_data, args.draft_steps, args.batch, args.draft_lr, args.seed + 2 if args.init_draft else args.seed + 1, log, name, teacher=target)
        log["draft_heldout_loss"] = round(eval_loss(draft, windows), 4)
        log["draft_target_top1_agreement_heldout"] = round(agreement(draft, target, windows), 4)
        save(draft, tok, args.out / "draft")
        log_path.write_text(json.dumps(log, indent=1))
    print(json.dumps({k: v for k, v in log.items() if not k.endswith("curve")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
