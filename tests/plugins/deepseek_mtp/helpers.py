"""Test helpers: tiny random DeepSeek-V4 checkpoints and a minimal stand-in for the core's batching."""

from __future__ import annotations

import math
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

MTP_EXTRA = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")


@dataclass
class Checkpoint:
    path: Path
    hf: Any  # transformers DeepseekV4ForCausalLM (main model)
    mtp: list[dict[str, Any]] = field(default_factory=list)  # per depth: {"hf": one-layer model, extra tensors}


def _randomise(model: Any, vocab: int, n_experts: int, top_k: int, gen: torch.Generator) -> None:
    """Give the parameters transformers initialises to zero/one random values so tests see them."""
    for name, t in model.state_dict().items():
        if name.endswith("tid2eid"):
            t.copy_(torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(vocab)]))
        elif name.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base", "hc_base")):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
        elif name.endswith(("norm.weight", ".scale", "hc_scale")):
            t.copy_(1.0 + torch.randn(t.shape, generator=gen) * 0.2)


def build_checkpoint(tmp: Path, n_mtp: int = 0, seed: int = 0, **overrides: Any) -> Checkpoint:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        partial_rotary_factor=0.5,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        hc_mult=2,
        sliding_window=4,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=8,
        index_head_dim=8,
        index_topk=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        num_nextn_predict_layers=n_mtp,
        eos_token_id=None,
        bos_token_id=None,
    )
    kw.update(overrides)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**kw)
    hf = DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        _randomise(hf, cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok, gen)
    hf.save_pretrained(tmp)
    ckpt = Checkpoint(tmp, hf)
    if n_mtp:
        files = list(tmp.glob("*.safetensors"))
        assert len(files) == 1
        tensors = load_file(str(files[0]))
        for d in range(n_mtp):
            mkw = dict(kw, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
            mcfg = DeepseekV4Config(**mkw)
            one = DeepseekV4ForCausalLM(mcfg).eval()
            with torch.no_grad():
                _randomise(one, mcfg.vocab_size, mcfg.n_routed_experts, mcfg.num_experts_per_tok, gen)
            mdir = tmp / f"_mtp{d}"
            one.save_pretrained(mdir)
            mt = load_file(str(mdir / "model.safetensors"))
            h = cfg.hidden_size
            extra = {
                "e_proj.weight": torch.randn(h, h, generator=gen) * 0.2,
                "h_proj.weight": torch.randn(h, h, generator=gen) * 0.2,
                "enorm.weight": 1.0 + torch.randn(h, generator=gen) * 0.2,
                "hnorm.weight": 1.0 + torch.randn(h, generator=gen) * 0.2,
            }
            for k, v in mt.items():
                if k.startswith("model.layers.0."):
                    tensors[f"mtp.{d}." + k[len("model.layers.0.") :]] = v
            tensors[f"mtp.{d}.norm.weight"] = mt["model.norm.weight"]
            for a in ("fn", "base", "scale"):
                tensors[f"mtp.{d}.hc_head_{a}"] = mt[f"model.hc_head.hc_{a}"]
            for k, v in extra.items():
                tensors[f"mtp.{d}.{k}"] = v.contiguous()
            ckpt.mtp.append({"hf": one, **extra})
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(files[0]), metadata={"format": "pt"})
    return ckpt


def make_executor(path: Path, k: int = 0, block_size: int = 4, max_num_seqs: int = 4, **more: Any) -> tuple[Any, Any]:
    from pypto_serving.config import ServingSettings
    from pypto_serving_deepseek_mtp import DeepseekMTPExecutor

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    settings = ServingSettings(
        model=str(path),
        dtype="float32",
        device="cpu",
        block_size=block_size,
        speculative_config=spec,
        max_num_seqs=max_num_seqs,
        **more,
    )
    ex = DeepseekMTPExecutor(settings)
    info = ex.load()
    return ex, info


class FakeCore:
    """Lays requests out the way the core does: per-group block tables sized by tokens_per_entry."""

    def __init__(self, executor: Any, info: Any, num_blocks: int = 64) -> None:
        self.ex = executor
        self.groups = {g.name: g for g in info.cache_groups}
        self.ex.init_kv_cache({g: num_blocks for g in self.groups})
        # Hand out blocks in a scrambled order so paging bugs cannot hide behind identity layouts.
        self.free = {g: list(torch.randperm(num_blocks - 1).add(1).tolist()) for g in self.groups}
        self.blocks: dict[str, dict[str, list[int]]] = {}

    def _ensure(self, rid: str, num_tokens: int) -> None:
        table = self.blocks.setdefault(rid, {g: [] for g in self.groups})
        for name, g in self.groups.items():
            need = math.ceil(math.ceil((num_tokens + g.slot_shift) / g.tokens_per_entry) / g.block_size)
            while len(table[name]) < need:
                table[name].append(self.free[name].pop())

    def free_request(self, rid: str) -> None:
        for name, blocks in self.blocks.pop(rid, {}).items():
            self.free[name].extend(blocks)

    def batch(self, entries: list[tuple[str, list[int], int, int]]) -> Any:
        """``entries``: (request id, token ids, first position, logits rows from the end)."""
        from pypto_serving import BatchInput

        ids, pos, qsl, seq_lens, logits_idx, nlog = [], [], [0], [], [], []
        for rid, toks, start, n_logits in entries:
            self._ensure(rid, start + len(toks))
            ids += toks
            pos += range(start, start + len(toks))
            qsl.append(len(ids))
            seq_lens.append(start + len(toks))
            logits_idx += range(len(ids) - n_logits, len(ids))
            nlog.append(n_logits)
        tables, slots = {}, {}
        for name, g in self.groups.items():
            width = max(len(self.blocks[e[0]][name]) for e in entries)
            t = torch.zeros((len(entries), width), dtype=torch.int32)
            for r, e in enumerate(entries):
                b = self.blocks[e[0]][name]
                t[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
            tables[name] = t
            if g.tokens_per_entry == 1:
                sm = []
                for r, (_, toks, start, _) in enumerate(entries):
                    for p in range(start, start + len(toks)):
                        sm.append(int(t[r, p // g.block_size]) * g.block_size + p % g.block_size)
                slots[name] = torch.tensor(sm, dtype=torch.int64)
        return BatchInput(
            request_ids=[e[0] for e in entries],
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=slots,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64),
            num_logits=nlog,
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
            input_ids_host=ids,
        )


def greedy_generate(
    core: FakeCore,
    prompts: dict[str, list[int]],
    max_new: int,
    k: int = 0,
    chunk: int = 0,
    preempt_at: dict[str, int] | None = None,
    on_step: Any = None,
    accept: Any = None,
    draft_depth: Any = None,
    num_drafts: Any = None,
    start: dict[str, int] | None = None,
) -> dict[str, list[int]]:
    """Drive the executor like the core: chunked prefill, greedy verification of MTP drafts, and
    optional preemption (release + recompute from scratch) once a request has N output tokens.
    ``draft_depth(step) -> int | None`` sets each step's ``BatchInput.draft_depth``, and
    ``num_drafts(step, request_id) -> int`` its ``BatchInput.num_drafts``. ``start`` gives the
    requests that begin at a prefix-cache hit their first position (their tables hold the hit's blocks)."""
    steps = 0
    out = {rid: [] for rid in prompts}
    done = {rid: (start or {}).get(rid, 0) for rid in prompts}  # tokens whose KV is computed
    drafts: dict[str, list[int]] = {rid: [] for rid in prompts}
    preempt_at = dict(preempt_at or {})
    while any(len(out[r]) < max_new for r in prompts):
        entries, meta = [], []
        for rid, prompt in prompts.items():
            if len(out[rid]) >= max_new:
                continue
            hist = prompt + out[rid]
            if done[rid] < len(hist) - 1 or not out[rid]:  # prefill (or recompute after preemption)
                end = len(hist) if not chunk else min(len(hist), done[rid] + chunk)
                final = end == len(hist)
                entries.append((rid, hist[done[rid] : end], done[rid], 1 if final else 0))
                meta.append((rid, end, final, []))
            else:
                dr = drafts[rid][:k]
                entries.append((rid, [hist[-1], *dr], len(hist) - 1, 1 + len(dr)))
                meta.append((rid, None, True, dr))
        batch = core.batch(entries)
        logits = core.ex.execute(batch)
        accepted: list[list[int]] = []
        row = 0
        for (rid, end, sampled, dr), n in zip(meta, batch.num_logits):
            if not sampled:
                done[rid] = end
                accepted.append([])
                continue
            greedy = logits[row : row + n].argmax(-1).tolist()
            row += n
            acc = [greedy[0]]
            for j, d in enumerate(dr):
                if d != greedy[j]:
                    break
                acc.append(greedy[j + 1])
            if accept is not None and dr:
                # Forced acceptance: pretend the first ``a`` drafts matched. The history stays a valid
                # one (the main model ran on exactly those tokens) and exercises multi-token commits.
                a = accept(len(dr))
                acc = [*dr[:a], greedy[a]]
            room = max_new - len(out[rid])
            acc = acc[:room]
            done[rid] = len(prompts[rid]) + len(out[rid]) + (len(acc) - 1 if end is None else 0)
            if end is not None:
                done[rid] = end
            out[rid] += acc
            accepted.append(acc)
        if draft_depth is not None:
            batch.draft_depth = draft_depth(steps)
        if num_drafts is not None:
            batch.num_drafts = [num_drafts(steps, rid) for rid in batch.request_ids]
        steps += 1
        new = core.ex.propose_drafts(batch, accepted)
        for rid, dr in zip(batch.request_ids, new):
            drafts[rid] = list(dr)
        if on_step is not None:
            on_step(batch, {rid: prompts[rid] + out[rid] for rid in batch.request_ids}, new)
        for rid, n_out in list(preempt_at.items()):
            if len(out[rid]) >= n_out:
                del preempt_at[rid]
                core.ex.release([rid])
                core.free_request(rid)
                done[rid] = 0
                drafts[rid] = []
        for rid in prompts:
            if len(out[rid]) >= max_new:
                core.ex.release([rid])
    return out


def make_predictable(path: Path, layer_scale: float = 0.3) -> None:
    """Rewrite a checkpoint built with MTP layers so that the drafts are often right.

    Random MTP weights accept almost nothing, which leaves multi-token commits (and a stop token or
    ``max_tokens`` landing inside an accepted run) untested end to end. Here every block's output
    projections are scaled by ``layer_scale``, so the greedy next token is mostly a function of the
    current token (still context-dependent), and each MTP depth is made to mirror that function:
    ``e_proj`` = identity, a small ``h_proj``, unit ``enorm`` and the main model's hyper head and
    norm. Drafts then match often but not always, exercising both acceptance and rejection."""
    files = list(path.glob("*.safetensors"))
    assert len(files) == 1
    t = load_file(str(files[0]))
    for k in list(t):
        if k.endswith(("attn.wo_b.weight", ".w2.weight")):
            t[k] = t[k] * layer_scale
    depths = sorted({int(k.split(".")[1]) for k in t if k.startswith("mtp.")})
    for d in depths:
        p = f"mtp.{d}."
        h = t[p + "e_proj.weight"].shape[0]
        t[p + "e_proj.weight"] = torch.eye(h)
        t[p + "h_proj.weight"] = t[p + "h_proj.weight"] * 0.05
        t[p + "enorm.weight"] = torch.ones(h)
        t[p + "norm.weight"] = t["model.norm.weight"].clone()
        for a in ("fn", "base", "scale"):
            t[p + f"hc_head_{a}"] = t[f"model.hc_head.hc_{a}"].clone()
    save_file({k: v.contiguous() for k, v in t.items()}, str(files[0]), metadata={"format": "pt"})


def plugin_manager() -> Any:
    """This executor plus whichever scheduler plugins are installed, registered explicitly: other
    entry points in the environment (e.g. a deliberately broken plugin another test installs) must
    not decide whether these tests run."""
    import importlib

    from pypto_serving.plugins import PluginManager

    mods = [importlib.import_module("pypto_serving_deepseek_mtp.plugin")]
    for name in ("pypto_serving_sync_sched", "pypto_serving_async_sched"):
        with suppress(ImportError):
            mods.append(importlib.import_module(name))
    return PluginManager(load_entry_points=False, extra_plugins=mods)


def alias_checkpoint(src: Path, dst: Path, eos_token_id: int | None = None) -> Path:
    """A second model directory sharing ``src``'s files (symlinks), optionally with an EOS token in
    its generation_config.json."""
    import json

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "generation_config.json":
            (dst / f.name).symlink_to(f.resolve())
    if eos_token_id is not None:
        (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return dst
