"""Train two tiny models on the CPU from the Python standard library's source.

(a) a small DeepSeek-V4-architecture model (sliding / CSA-with-indexer / HCA attention, hash and
top-k MoE, ``hc_mult`` = 2 hyper-connections) with one MTP layer trained jointly, saved with the
MTP weights under ``mtp.0.*`` (the layout ``pypto_serving_deepseek_mtp`` reads, docs/deepseek_mtp.md);
(b) a small Qwen3 model (transformers ``Qwen3ForCausalLM``).

Both share one byte-level BPE tokenizer (``tokenizers``) with a ChatML chat template.

    python tools/train_tiny.py --out /tmp/tiny --minutes 40

writes ``/tmp/tiny/deepseek_v4_mtp`` and ``/tmp/tiny/qwen3``, each a Hugging Face model directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json) plus
``training_split.json``: the corpus files it trained on and the held-out ones, the one record of the
split that every benchmark and test wanting held-out text reads (``benchmarks/held_out.py``).
``python tools/train_tiny.py --write-split DIR...`` writes that record into existing model
directories (the split of the running interpreter's standard library; nothing is retrained).
See docs/training.md. Not part of any installed package.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HELD_OUT_EVERY = 50  # sorted file index % 50 == 0 -> held out
SPLIT_FILE = "training_split.json"  # written into every model directory: its training and held-out files
DS_DIR, QWEN_DIR = "deepseek_v4_mtp", "qwen3"


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------------------- corpus


def corpus_files(limit: int | None = None) -> list[Path]:
    """The stdlib's *.py files (site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        (f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts)),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    return files[:limit] if limit else files


def read_texts(files: list[Path]) -> list[str]:
    out = []
    for f in files:
        try:
            out.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a handful of test files are deliberately not UTF-8
    return out


def split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0]
    return train, held


def split_record(files: list[Path]) -> dict[str, Any]:
    """The split of ``files`` as written next to each model (:data:`SPLIT_FILE`): paths relative to the
    standard library, in corpus order; files that are not UTF-8 were skipped by :func:`read_texts`, so
    they are listed apart rather than as trained on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = split(files)

    def readable(group: list[Path]) -> list[str]:
        return [f.relative_to(root).as_posix() for f in group if read_texts([f])]

    skipped = [f.relative_to(root).as_posix() for f in files if not read_texts([f])]
    return {
        "corpus": "the *.py files of the Python standard library (sysconfig stdlib), site-packages excluded",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "rule": f"files sorted by relative path; sorted index % {HELD_OUT_EVERY} == 0 held out, the rest train",
        "train_files": readable(train),
        "held_out_files": readable(held),
        "skipped_not_utf8": skipped,
    }


def write_split(model_dir: Path, record: dict[str, Any]) -> None:
    (model_dir / SPLIT_FILE).write_text(json.dumps(record, indent=1) + "\n")


# -------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Any, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s, i in ids.items()
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def encode(tok: Any, texts: list[str]) -> torch.Tensor:
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


# ----------------------------------------------------------------------------------------- models


def deepseek_config(vocab: int, eos: list[int], seq_len: int) -> Any:
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=128,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=64,
        partial_rotary_factor=0.5,
        n_routed_experts=6,
        n_shared_experts=1,
        num_experts_per_tok=2,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        hc_mult=2,
        sliding_window=64,
        o_groups=2,
        o_lora_rank=64,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        max_position_embeddings=max(2048, seq_len),
        initializer_range=0.02,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )


def qwen_config(vocab: int, eos: list[int], seq_len: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max(2048, seq_len),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos[0],
    )


class MTPLayer(nn.Module):
    """One MTP depth (DeepSeek-V3/V4): ``x = e_proj(enorm(embed(t[i+1]))) + h_proj(hnorm(h[i]))``
    per hyper-connection stream, one sliding-attention top-k-MoE block, its own hyper head and
    norm, and the main model's (shared) LM head; predicts t[i+2]. The block, hyper head and norm
    live in a one-layer ``DeepseekV4ForCausalLM`` so that ``save_pretrained`` writes them in the
    checkpoint layout (its embedding / LM head are unused and not saved)."""

    def __init__(self, cfg: Any) -> None:
        from transformers import DeepseekV4ForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

        super().__init__()
        mcfg = type(cfg).from_dict(
            {
                **cfg.to_dict(),
                "num_hidden_layers": 1,
                "layer_types": ["sliding_attention"],
                "mlp_layer_types": ["moe"],
                "num_nextn_predict_layers": 0,
            }
        )
        self.one = DeepseekV4ForCausalLM(mcfg)
        self.one.model.embed_tokens.weight.requires_grad_(False)
        self.one.lm_head.weight.requires_grad_(False)
        h = cfg.hidden_size
        self.enorm = DeepseekV4RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(h, eps=cfg.rms_norm_eps)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        std = cfg.initializer_range
        nn.init.normal_(self.e_proj.weight, std=std)
        nn.init.normal_(self.h_proj.weight, std=std)
        self.window = cfg.sliding_window

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [
            (n, p) for n, p in self.named_parameters() if not n.startswith(("one.model.embed_tokens", "one.lm_head"))
        ]

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, embed: nn.Module, head: nn.Module) -> torch.Tensor:
        """streams [B, n, hc, D] (main model's last-layer streams at positions 0..n-1),
        next_ids [B, n] (tokens 1..n) -> logits [B, n, V] for tokens 2..n+1."""
        b, n = next_ids.shape
        pos = torch.arange(n, device=next_ids.device)[None].expand(b, n)
        diff = pos[0][:, None] - pos[0][None, :]
        mask = torch.where((diff >= 0) & (diff < self.window), 0.0, float("-inf"))[None, None]
        x = self.e_proj(self.enorm(embed(next_ids)))
        x = x.unsqueeze(2) + self.h_proj(self.hnorm(streams))
        m = self.one.model
        emb = {t: m.rotary_emb(x, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        hidden = m.layers[0](
            x, position_embeddings=emb, position_ids=pos, attention_mask=mask, input_ids=next_ids, cache=None
        )
        return head(m.norm(m.hc_head(hidden)))

    def checkpoint_tensors(self, depth: int = 0) -> dict[str, torch.Tensor]:
        """This depth's tensors under ``mtp.{depth}.`` in the layout our loader reads."""
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as tmp:
            self.one.save_pretrained(tmp)
            mt = load_file(str(Path(tmp) / "model.safetensors"))
        p = f"mtp.{depth}."
        out = {p + k[len("model.layers.0.") :]: v for k, v in mt.items() if k.startswith("model.layers.0.")}
        out[p + "norm.weight"] = mt["model.norm.weight"]
        for a in ("fn", "base", "scale"):
            out[p + f"hc_head_{a}"] = mt[f"model.hc_head.hc_{a}"]
        out[p + "e_proj.weight"] = self.e_proj.weight.detach()
        out[p + "h_proj.weight"] = self.h_proj.weight.detach()
        out[p + "enorm.weight"] = self.enorm.weight.detach()
        out[p + "hnorm.weight"] = self.hnorm.weight.detach()
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


class DeepseekWithMTP(nn.Module):
    def __init__(self, cfg: Any, seed: int) -> None:
        from transformers import DeepseekV4ForCausalLM

        super().__init__()
        self.main = DeepseekV4ForCausalLM(cfg)
        self.mtp = MTPLayer(cfg)
        gen = torch.Generator().manual_seed(seed + 17)
        with torch.no_grad():
            for name, buf in self.main.named_buffers():
                if name.endswith("tid2eid"):  # the frozen token -> experts hash of the hash-MoE layers
                    buf.copy_(
                        torch.stack(
                            [
                                torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                                for _ in range(cfg.vocab_size)
                            ]
                        )
                    )
        self._streams: list[torch.Tensor] = []
        self.main.model.layers[-1].register_forward_hook(lambda _m, _i, out: self._streams.append(out))

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"main.{n}", p) for n, p in self.main.named_parameters()] + [
            (f"mtp.{n}", p) for n, p in self.mtp.trainable()
        ]

    def losses(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """chunk [B, T+1] -> (main loss, MTP loss, MTP top-1 correct count) with the MTP head
        predicting token i+2 from the main streams at i and the embedding of token i+1."""
        x, y = chunk[:, :-1], chunk[:, 1:]
        self._streams.clear()
        logits = self.main(input_ids=x).logits
        streams = self._streams[-1]
        self._streams.clear()
        main_loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        mtp_logits = self.mtp(streams[:, :-1], x[:, 1:], self.main.model.embed_tokens, self.main.lm_head)
        target = y[:, 1:]
        mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1).float(), target.flatten())
        correct = (mtp_logits.argmax(-1) == target).sum()
        return main_loss, mtp_loss, correct


class LoadBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step every top-k router's
    ``e_score_correction_bias`` moves by ``gamma`` towards under-loaded experts."""

    def __init__(self, model: nn.Module, gamma: float = 1e-3) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        self.gamma = gamma
        self.counts: dict[nn.Module, torch.Tensor] = {}
        for mod in model.modules():
            if isinstance(mod, DeepseekV4TopKRouter):
                self.counts[mod] = torch.zeros(mod.num_experts)
                mod.register_forward_hook(self._hook)

    def _hook(self, mod: nn.Module, _inp: Any, out: Any) -> None:
        if mod.training:
            self.counts[mod] += torch.bincount(out[2].flatten(), minlength=mod.num_experts).float()

    @torch.no_grad()
    def update(self) -> None:
        for mod, c in self.counts.items():
            if c.sum() > 0:
                mod.e_score_correction_bias += self.gamma * torch.sign(c.mean() - c)
            c.zero_()


# --------------------------------------------------------------------------------------- training


def batches(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    hi = len(data) - seq_len - 1
    while True:
        starts = torch.randint(0, max(hi, 1), (batch,), generator=gen)
        yield torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()


def eval_chunks(data: torch.Tensor, seq_len: int, max_windows: int) -> list[torch.Tensor]:
    """Up to ``max_windows`` non-overlapping windows spread evenly over the held-out tokens."""
    total = (len(data) - 1) // seq_len
    n = min(total, max_windows)
    picks = sorted({i * total // n for i in range(n)}) if n else []
    return [data[i * seq_len : i * seq_len + seq_len + 1].long() for i in picks]


def lr_at(progress: float, base: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    if progress < warmup:
        return base * max(progress / warmup, 0.02)
    t = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(params: list[tuple[str, nn.Parameter]], lr: float, wd: float) -> torch.optim.Optimizer:
    decay = [p for n, p in params if p.requires_grad and p.dim() >= 2]
    other = [p for n, p in params if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def train_loop(
    name: str,
    step_fn: Any,
    params: list[tuple[str, nn.Parameter]],
    data: torch.Tensor,
    args: argparse.Namespace,
    budget_s: float,
    after_step: Any = None,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    opt = make_optimizer(params, args.lr, args.weight_decay)
    trainable = [p for _, p in params if p.requires_grad]
    it = batches(data, args.batch, args.seq_len, gen)
    t0, c0 = time.monotonic(), time.process_time()
    step, curve = 0, []
    ema: dict[str, float] = {}
    log(f"[{name}] training: budget {budget_s / 60:.1f} min" + (f", at most {args.steps} steps" if args.steps else ""))
    while True:
        elapsed = time.monotonic() - t0
        if args.steps and step >= args.steps:
            break
        if elapsed >= budget_s and step > 0:
            break
        # Schedule by steps when capped by --steps (deterministic), else by the time budget.
        progress = step / args.steps if args.steps else elapsed / max(budget_s, 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, args.lr)
        parts = step_fn(next(it))
        loss = parts["loss"]
        parts = {k: v.detach() for k, v in parts.items()}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        if after_step is not None:
            after_step()
        step += 1
        for k, v in parts.items():
            v = float(v)
            ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
        if step == 1 or step % args.log_every == 0:
            el, cpu = time.monotonic() - t0, time.process_time() - c0
            pct = max(el / max(budget_s, 1.0), step / args.steps if args.steps else 0.0) * 100
            vals = " ".join(f"{k} {float(v):.3f} (ema {ema[k]:.3f})" for k, v in parts.items())
            log(
                f"[{name}] step {step} {pct:5.1f}% {el:7.1f}s {el / step:.2f}s/step (cpu {cpu / step:.2f}s) "
                f"lr {g['lr']:.2e} {vals}"
            )
            curve.append({"step": step, "time_s": round(el, 1), **{k: round(float(v), 4) for k, v in parts.items()}})
    el, cpu = time.monotonic() - t0, time.process_time() - c0
    log(
        f"[{name}] done: {step} steps in {el:.1f}s ({el / max(step, 1):.2f} s/step wall, "
        f"{cpu / max(step, 1):.2f} s/step cpu over {torch.get_num_threads()} threads)"
    )
    return {
        "steps": step,
        "seconds": round(el, 1),
        "s_per_step": round(el / max(step, 1), 3),
        "cpu_s_per_step": round(cpu / max(step, 1), 3),
        "curve": curve,
    }


@torch.no_grad()
def eval_deepseek(model: DeepseekWithMTP, chunks: list[torch.Tensor], batch: int) -> dict[str, float]:
    model.eval()
    tot = {"main": 0.0, "mtp": 0.0, "correct": 0.0, "n_main": 0, "n_mtp": 0}
    for i in range(0, len(chunks), batch):
        c = torch.stack(chunks[i : i + batch])
        m, t, corr = model.losses(c)
        n_main, n_mtp = c.shape[0] * (c.shape[1] - 1), c.shape[0] * (c.shape[1] - 2)
        tot["main"] += float(m) * n_main
        tot["mtp"] += float(t) * n_mtp
        tot["correct"] += float(corr)
        tot["n_main"] += n_main
        tot["n_mtp"] += n_mtp
    model.train()
    return {
        "heldout_main_loss": round(tot["main"] / max(tot["n_main"], 1), 4),
        "heldout_mtp_loss": round(tot["mtp"] / max(tot["n_mtp"], 1), 4),
        "heldout_mtp_top1_acc": round(tot["correct"] / max(tot["n_mtp"], 1), 4),
        "heldout_tokens": tot["n_main"],
    }


@torch.no_grad()
def eval_qwen(model: nn.Module, chunks: list[torch.Tensor], batch: int) -> dict[str, float]:
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(chunks), batch):
        c = torch.stack(chunks[i : i + batch])
        logits = model(input_ids=c[:, :-1]).logits
        tot += float(F.cross_entropy(logits.flatten(0, 1).float(), c[:, 1:].flatten())) * c[:, 1:].numel()
        n += c[:, 1:].numel()
    model.train()
    return {"heldout_main_loss": round(tot / max(n, 1), 4), "heldout_tokens": n}


# ----------------------------------------------------------------------------------------- saving


def write_generation_config(out: Path, eos: list[int], pad: int) -> None:
    cfg = {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def save_deepseek(model: DeepseekWithMTP, tok: Any, out: Path, eos: list[int]) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    model.main.save_pretrained(out)
    file = out / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update(model.mtp.checkpoint_tensors(0))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    save_tokenizer(tok, out)
    write_generation_config(out, eos, eos[0])


def save_qwen(model: nn.Module, tok: Any, out: Path, eos: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    write_generation_config(out, eos, eos[0])


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6


# -------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory (two model dirs go inside)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget of the whole run")
    p.add_argument("--steps", type=int, default=0, help="cap on optimizer steps per model (0: none)")
    p.add_argument("--models", default="deepseek,qwen", help="comma-separated subset of deepseek,qwen")
    p.add_argument(
        "--deepseek-share",
        type=float,
        default=0.75,
        help="share of the training time for DeepSeek when the models train one after the other",
    )
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128, help="training window (tokens)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-lambda", type=float, default=0.3, help="weight of the MTP loss")
    p.add_argument("--eval-windows", type=int, default=128, help="held-out windows of --seq-len tokens")
    p.add_argument("--eval-reserve", type=float, default=60.0, help="seconds kept back for eval and saving")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N corpus files (tests)")
    p.add_argument("--tokenizer-files", type=int, default=0, help="train the BPE on every k-th train file only")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--jobs", type=int, default=2, help="models trained in parallel processes (1: in turn)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per model (0: cores / models when parallel, else torch's default)",
    )
    p.add_argument("--prepared", type=Path, default=None, help=argparse.SUPPRESS)  # internal: worker of a parallel run
    return p.parse_args(argv)


def prepare(args: argparse.Namespace) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Corpus split, BPE tokenizer and token ids (train, held-out)."""
    files = corpus_files(args.max_files or None)
    train_files, held_files = split(files)
    log(
        f"corpus: {len(files)} files from {sysconfig.get_paths()['stdlib']} "
        f"({len(train_files)} train, {len(held_files)} held out: sorted index % {HELD_OUT_EVERY} == 0)"
    )
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tok_texts = train_texts[:: args.tokenizer_files] if args.tokenizer_files else train_texts
    t = time.monotonic()
    tok = train_tokenizer(tok_texts, args.vocab)
    train_ids, held_ids = encode(tok, train_texts), encode(tok, held_texts)
    log(
        f"tokenizer: vocab {tok.get_vocab_size()}, {time.monotonic() - t:.1f}s; {len(train_ids)} train / "
        f"{len(held_ids)} held-out tokens ({sum(map(len, train_texts)) / max(len(train_ids), 1):.2f} chars/token)"
    )
    return tok, train_ids, held_ids


def train_model(
    name: str, args: argparse.Namespace, tok: Any, train_ids: torch.Tensor, held_ids: torch.Tensor, budget: float
) -> dict[str, Any]:
    """Train, evaluate on the held-out windows and save one model; returns its report."""
    torch.manual_seed(args.seed)
    vocab = tok.get_vocab_size()
    eos = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]
    chunks = eval_chunks(held_ids, args.seq_len, args.eval_windows)
    if name == "deepseek":
        cfg = deepseek_config(vocab, eos, args.seq_len)
        model = DeepseekWithMTP(cfg, args.seed)
        model.train()
        n_main = sum(p.numel() for p in model.main.parameters())
        n_mtp = sum(p.numel() for _, p in model.mtp.trainable())
        log(f"[deepseek] {n_main / 1e6:.2f}M main parameters + {n_mtp / 1e6:.2f}M MTP layer")
        balancer = LoadBalancer(model)

        def step_fn(c: torch.Tensor) -> dict[str, torch.Tensor]:
            m, t, _ = model.losses(c)
            return {"loss": m + args.mtp_lambda * t, "main": m, "mtp": t}

        stats = train_loop("deepseek", step_fn, model.trainable(), train_ids, args, budget, balancer.update)
        ev = eval_deepseek(model, chunks, args.batch)
        out = args.out / DS_DIR
        save_deepseek(model, tok, out, eos)
        log(
            f"[deepseek] held-out: main loss {ev['heldout_main_loss']:.4f}, MTP loss "
            f"{ev['heldout_mtp_loss']:.4f}, MTP top-1 next-next-token accuracy {ev['heldout_mtp_top1_acc']:.4f} "
            f"({ev['heldout_tokens']} tokens); saved {out} ({dir_mb(out):.1f} MB)"
        )
        return {
            **stats,
            **ev,
            "params_main": n_main,
            "params_mtp": n_mtp,
            "dir": str(out),
            "size_mb": round(dir_mb(out), 2),
        }

    from transformers import Qwen3ForCausalLM

    qmodel = Qwen3ForCausalLM(qwen_config(vocab, eos, args.seq_len))
    qmodel.train()
    n = sum(p.numel() for p in qmodel.parameters())
    log(f"[qwen] {n / 1e6:.2f}M parameters")

    def qstep(c: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = qmodel(input_ids=c[:, :-1]).logits
        return {"loss": F.cross_entropy(logits.flatten(0, 1).float(), c[:, 1:].flatten())}

    stats = train_loop("qwen", qstep, list(qmodel.named_parameters()), train_ids, args, budget)
    ev = eval_qwen(qmodel, chunks, args.batch)
    out = args.out / QWEN_DIR
    save_qwen(qmodel, tok, out, eos)
    log(
        f"[qwen] held-out: main loss {ev['heldout_main_loss']:.4f} ({ev['heldout_tokens']} tokens); "
        f"saved {out} ({dir_mb(out):.1f} MB)"
    )
    return {**stats, **ev, "params": n, "dir": str(out), "size_mb": round(dir_mb(out), 2)}


#: The fixed prompt of the shipped models' golden tokens (the tests store what this script prints).
GOLDEN_PROMPT = "def main():\n"
GOLDEN_TOKENS = 24


def golden(model_dir: Path) -> dict[str, Any]:
    """transformers' greedy continuation of :data:`GOLDEN_PROMPT` (``GOLDEN_TOKENS`` tokens, EOS ignored)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(GOLDEN_PROMPT).ids
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(GOLDEN_TOKENS):  # full recompute: no cache code path of either side involved
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return {"prompt": GOLDEN_PROMPT, "prompt_ids": ids, "tokens": seq[len(ids) :]}


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    if raw_argv[:1] == ["--golden"]:  # regenerate the golden tokens of existing model directories
        for path in raw_argv[1:]:
            print(json.dumps({path: golden(Path(path))}))
        return 0
    if raw_argv[:1] == ["--write-split"]:  # record the split next to existing model directories
        record = split_record(corpus_files())
        for path in raw_argv[1:]:
            write_split(Path(path), record)
        return 0
    args = parse_args(raw_argv)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = set(models) - {"deepseek", "qwen"}
    if bad or not models:
        raise SystemExit(f"unknown model(s) {sorted(bad)}; choose from deepseek, qwen")
    parallel = args.jobs > 1 and len(models) > 1 and not args.prepared
    threads = args.threads or (max(1, (os.cpu_count() or 1) // len(models)) if parallel else 0)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    if args.prepared:  # a worker of a parallel run: one model, tokenizer and token ids from the parent
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.prepared / "tokenizer.json"))
        data = torch.load(args.prepared / "corpus.pt")
        (name,) = models
        budget = max(0.0, deadline - time.monotonic() - args.eval_reserve)
        rep = train_model(name, args, tok, data["train"], data["held"], budget)
        (args.prepared / f"report.{name}.json").write_text(json.dumps(rep, indent=2) + "\n")
        return 0

    tok, train_ids, held_ids = prepare(args)
    report: dict[str, Any] = {
        "seed": args.seed,
        "vocab": tok.get_vocab_size(),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "mtp_lambda": args.mtp_lambda,
        "parallel": parallel,
        "threads_per_model": threads or torch.get_num_threads(),
    }
    if parallel:
        # One process per model, each on its own core(s): the models' small ops scale badly over
        # threads, so two single-threaded trainings use 2 cores far better than one after the other.
        prep = args.out / "_prepared"
        prep.mkdir(exist_ok=True)
        tok.save(str(prep / "tokenizer.json"))
        torch.save({"train": train_ids, "held": held_ids}, prep / "corpus.pt")
        left_min = max(0.0, deadline - time.monotonic()) / 60
        procs = []
        for name in models:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                *raw_argv,
                "--models",
                name,
                "--prepared",
                str(prep),
                "--minutes",
                f"{left_min:.4f}",
                "--threads",
                str(threads),
            ]
            procs.append((name, subprocess.Popen(cmd)))
        try:
            failed = [name for name, p in procs if p.wait() != 0]
        finally:
            for _, p in procs:  # interrupted: do not leave a worker training on
                if p.poll() is None:
                    p.terminate()
                    p.wait()
        if failed:
            raise SystemExit(f"training failed for {failed} (see the log above)")
        for name in models:
            report[name] = json.loads((prep / f"report.{name}.json").read_text())
        shutil.rmtree(prep)
    else:
        train_left = max(0.0, deadline - time.monotonic() - args.eval_reserve)
        for name in models:
            if name == "deepseek" and len(models) > 1:
                budget = train_left * args.deepseek_share
            else:
                budget = max(0.0, deadline - time.monotonic() - args.eval_reserve / 2)
            report[name] = train_model(name, args, tok, train_ids, held_ids, budget)

    record = split_record(corpus_files(args.max_files or None))
    for name in models:
        report[name]["golden"] = golden(Path(report[name]["dir"]))
        write_split(Path(report[name]["dir"]), record)
    report["total_seconds"] = round(time.monotonic() - start, 1)
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    short = {
        k: {kk: vv for kk, vv in v.items() if kk != "curve"} if isinstance(v, dict) else v for k, v in report.items()
    }
    log("summary: " + json.dumps(short))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
