"""DeepSeek-V4 MTP: decode throughput and acceptance for k = 0..3, and the cost of verification.

Builds a small random DeepSeek-V4 checkpoint with one MTP layer (hidden 256, 4 layers: sliding, CSA,
HCA, sliding) in a temp dir with the test helpers, then

1. runs ``LLM.generate`` at temperature 0 with MTP k = 0, 1, 2, 3 at concurrency 1 and 16 and reports
   decode throughput (output tokens after the first, over the time from the first token to the last
   finish) and the mean accepted length (accepted drafts / request-steps that carried drafts);
2. times ``DeepseekMTPExecutor.execute()`` directly on prepared batches at concurrency 1: a 2-token
   verification step (last token + 1 draft) against a plain 1-token decode step, at the same
   position, plus the full k=1 step (verification + ``propose_drafts``).

Random weights: the drafts are essentially never right, so acceptance (and hence the throughput of
k > 0) says nothing about a real checkpoint; it only shows the machinery and its overhead. With
``--model DIR|NAME`` (e.g. the embedded ``tiny-deepseek-v4``, trained by tools/train_tiny.py) the
engine runs that checkpoint instead, on prompts cut from the files it held out from training (the
split recorded next to the model, ``training_split.json``), and also reports how often the first
draft token is accepted.

With ``--steps-only`` it only times decode steps (``time_steps``), at concurrency 1 and 16 in the same
run: the full MTP k=1 step (2-token verification + ``propose_drafts``) over a plain 1-token step, in
process CPU time.

    python benchmarks/mtp.py [--threads 1] [--max-tokens 32] [--reps 40]
    python benchmarks/mtp.py --model tiny-deepseek-v4 --max-tokens 64
    python benchmarks/mtp.py --model tiny-deepseek-v4 --steps-only --reps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.plugins.deepseek_mtp.helpers

from benchmarks.held_out import held_out_texts
from tests.plugins.deepseek_mtp.helpers import FakeCore, build_checkpoint, make_executor, plugin_manager

VOCAB = 1024
PROMPT_LEN = 48


def build(tmp: Path) -> Path:
    return build_checkpoint(
        tmp,
        n_mtp=1,
        vocab_size=VOCAB,
        hidden_size=256,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        head_dim=64,
        q_lora_rank=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "sliding_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        sliding_window=64,
        o_groups=4,
        o_lora_rank=64,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=8,
        max_position_embeddings=1024,
        initializer_range=0.05,
    ).path


def held_out_prompts(model: str, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the files ``model`` held out from training (the split
    recorded next to it, ``benchmarks/held_out.py``), tokenized by ``model``'s tokenizer."""
    from pypto_serving import LLM

    with LLM(model=model, plugins=plugin_manager(), worker_mode="inproc", device="cpu") as llm:
        tok = llm.tokenizer
        assert tok is not None, f"{model} has no tokenizer"
        prompts: list[list[int]] = []
        for text in held_out_texts(model):
            ids = tok.encode(text)
            prompts += [ids[i : i + length] for i in range(0, len(ids) - length, 4 * length)]
    step = max(1, len(prompts) // count)
    return prompts[::step][:count]


def run_engine(
    path: Path | str, k: int, concurrency: int, max_tokens: int, prompts: list[list[int]] | None = None
) -> dict[str, Any]:
    from pypto_serving import LLM, SamplingParams

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(
        model=str(path),
        plugins=plugin_manager(),
        dtype="float32",
        device="cpu",
        worker_mode="inproc",
        block_size=16,
        max_num_batched_tokens=1024,
        max_num_seqs=concurrency,
        speculative_config=spec,
    )
    try:
        core = llm.engine
        entries: list[Any] = []
        submit = core.submit

        def spy(out: Any) -> None:
            entries.extend(out.command.entries)
            submit(out)

        core.submit = spy  # type: ignore[method-assign]
        if prompts is None:
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(concurrency)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        entries.clear()
        base = core.stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = core.stats()
    finally:
        llm.shutdown()
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    with_drafts = sum(1 for e in entries if e.num_draft)
    accepted = stats["spec_accepted"] - base["spec_accepted"]
    drafted = stats["spec_drafted"] - base["spec_drafted"]
    per_pos = [a - b for a, b in zip(stats["spec_accepted_per_pos"], base["spec_accepted_per_pos"] + [0] * 8)]
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "first_acc": per_pos[0] / with_drafts if with_drafts and per_pos else 0.0,
        "tok_s": decoded / (last - first),
        "mean_acc": accepted / with_drafts if with_drafts else 0.0,
        "acc_rate": accepted / drafted if drafted else 0.0,
        "steps": stats["num_steps"] - base["num_steps"],
    }


def time_verification(path: Path, reps: int) -> dict[str, float]:
    """Median seconds per decode step at concurrency 1, over the same ``reps`` positions: plain
    1-token execute(), 2-token execute() (last token + 1 draft, the draft rejected), and the latter
    plus propose_drafts() (a full k=1 step)."""
    ex, info = make_executor(path, k=1, block_size=16, max_num_seqs=1)
    core = FakeCore(ex, info, num_blocks=128)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN + 64,), generator=g).tolist()
    stream = torch.randint(0, VOCAB, (reps + 1,), generator=g).tolist()

    def measure(rid: str, n_tokens: int, draft: bool) -> float:
        pre = core.batch([(rid, prompt, 0, 1)])
        ex.execute(pre)
        ex.propose_drafts(pre, [[stream[0]]])
        ts = []
        for i in range(reps):
            toks = [stream[i], 7][:n_tokens]
            batch = core.batch([(rid, toks, len(prompt) + i, n_tokens)])
            t0 = time.perf_counter()
            ex.execute(batch)
            if draft:
                ex.propose_drafts(batch, [[stream[i + 1]]])  # the draft rejected: one token committed
            ts.append(time.perf_counter() - t0)
            if not draft:
                ex.propose_drafts(batch, [[stream[i + 1]]])  # keep the MTP state in step, untimed
        ex.release([rid])
        core.free_request(rid)
        return statistics.median(ts[3:])

    out: dict[str, float] = {}
    for rnd in range(2):  # interleaved, best of two, to even out load drift on a shared box
        for name, n, draft in (("one", 1, False), ("two", 2, False), ("full", 2, True)):
            out[name] = min(out.get(name, 1e9), measure(f"{name}{rnd}", n, draft))
    return out


def time_steps(path: Path | str, concurrency: int, reps: int) -> dict[str, float]:
    """Median seconds per decode step of ``concurrency`` requests at the same positions: a plain
    1-token step (``execute()``) and a full MTP k=1 step (2-token ``execute()``, the draft rejected,
    plus ``propose_drafts()``). Process CPU time, not wall time: the steps run on one torch thread, and
    CPU time does not count the time other jobs on a shared box hold the core."""
    ex, info = make_executor(Path(path), k=1, block_size=16, max_num_seqs=concurrency)
    core = FakeCore(ex, info, num_blocks=32 * concurrency + 64)
    g = torch.Generator().manual_seed(2)
    vocab = info.vocab_size
    prompts = [torch.randint(0, vocab, (PROMPT_LEN + 13,), generator=g).tolist() for _ in range(concurrency)]
    streams = [torch.randint(0, vocab, (reps + 1,), generator=g).tolist() for _ in range(concurrency)]
    n0 = len(prompts[0])

    def measure(tag: str, full: bool) -> float:
        rids = [f"{tag}{c}" for c in range(concurrency)]
        pre = core.batch([(rid, p, 0, 1) for rid, p in zip(rids, prompts)])
        ex.execute(pre)
        ex.propose_drafts(pre, [[s[0]] for s in streams])
        ts = []
        for i in range(reps):
            n = 2 if full else 1
            batch = core.batch([(rid, [s[i], 7][:n], n0 + i, n) for rid, s in zip(rids, streams)])
            accepted = [[s[i + 1]] for s in streams]  # the draft rejected: one token committed
            t0 = time.process_time()
            ex.execute(batch)
            if full:
                ex.propose_drafts(batch, accepted)
            ts.append(time.process_time() - t0)
            if not full:
                ex.propose_drafts(batch, accepted)  # keep the MTP state in step, untimed
        ex.release(rids)
        for rid in rids:
            core.free_request(rid)
        return statistics.median(ts[3:])

    out: dict[str, float] = {}
    for rnd in range(2):  # interleaved, best of two, to even out load drift on a shared box
        for name, full in (("plain", False), ("full", True)):
            out[name] = min(out.get(name, 1e9), measure(f"{name}{rnd}-", full))
    return out


def _model_dir(model: str) -> Path:
    """A checkpoint directory, or the directory of a model this plugin registers by name."""
    from pypto_serving_deepseek_mtp.plugin import pypto_serving_register_models

    named = {m.name: m.path for m in pypto_serving_register_models()}
    return Path(named.get(model, model))


def step_ratios(path: Path | str, reps: int) -> None:
    """The full k=1 step over the plain decode step, at concurrency 1 and 16 in the same run."""
    print()
    print("| concurrency | plain decode step, CPU ms | k=1 step (verify + draft), CPU ms | ratio |")
    print("|---:|---:|---:|---:|")
    for conc in (1, 16):
        v = time_steps(path, conc, reps)
        ratio = v["full"] / v["plain"]
        print(f"| {conc} | {v['plain'] * 1e3:.2f} | {v['full'] * 1e3:.2f} | {ratio:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--model", help="a trained DeepSeek-V4 checkpoint (directory or named model), held-out prompts")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--steps-only", action="store_true", help="only the k=1 step / plain step ratios")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps_only:
        with tempfile.TemporaryDirectory() as tmp:
            step_ratios(_model_dir(args.model) if args.model else build(Path(tmp)), args.reps)
        return
    if args.model:
        trained(args)
        return
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp))
        print(
            f"DeepSeek-V4 random checkpoint: hidden 256, 4 layers (sliding/CSA/HCA/sliding), 1 MTP layer, "
            f"vocab {VOCAB}, fp32 CPU, {args.threads} thread(s); prompts {PROMPT_LEN} tokens, "
            f"max_tokens {args.max_tokens}, temperature 0"
        )
        print()
        print("| k | concurrency | decode tok/s | vs k=0 | mean accepted length | acceptance rate | steps |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        base: dict[int, float] = {}
        for conc in (1, 16):
            for k in (0, 1, 2, 3):
                r = run_engine(path, k, conc, args.max_tokens)
                base.setdefault(conc, r["tok_s"])
                print(
                    f"| {k} | {conc} | {r['tok_s']:.1f} | {r['tok_s'] / base[conc]:.2f}x | "
                    f"{r['mean_acc']:.2f} | {r['acc_rate']:.1%} | {r['steps']} |"
                )
        print()
        print(
            "NOTE: random weights, so acceptance is meaningless (drafts are ~never right); k > 0 "
            "throughput here shows pure drafting overhead, not the speed-up of a trained MTP head."
        )
        v = time_verification(path, args.reps)
        print()
        print("| concurrency 1, same positions | median ms | vs 1-token step |")
        print("|---|---:|---:|")
        print(f"| execute(), 1 token (plain decode) | {v['one'] * 1e3:.2f} | 1.00x |")
        print(f"| execute(), 2 tokens (verify 1 draft) | {v['two'] * 1e3:.2f} | {v['two'] / v['one']:.2f}x |")
        print(
            f"| execute() 2 tokens + propose_drafts (full k=1 step) | {v['full'] * 1e3:.2f} | "
            f"{v['full'] / v['one']:.2f}x |"
        )
        ratio = v["two"] / v["one"]
        print()
        verdict = "met" if ratio < 1.3 else "NOT met"
        print(f"2-token verification / 1-token step = {ratio:.2f}x (goal < 1.3x: {verdict})")
    print(f"total {time.perf_counter() - t_start:.0f} s")


def trained(args: argparse.Namespace) -> None:
    """k = 0..3 at concurrency 1 and 16 on a trained checkpoint, prompts from the held-out slice."""
    prompts = held_out_prompts(args.model, 16, args.prompt_len)
    print(
        f"{args.model}: {len(prompts)} held-out prompts of {args.prompt_len} tokens, max_tokens {args.max_tokens}, "
        f"temperature 0, fp32 CPU, {args.threads} thread(s)"
    )
    print()
    print("| k | concurrency | decode tok/s | vs k=0 | first-draft acceptance | mean accepted length | steps |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for conc in (1, 16):
        base: dict[str, Any] = {}
        for k in (0, 1, 2, 3):
            per_prompt = [prompts[i : i + conc] for i in range(0, len(prompts), conc)][: max(1, 4 // conc)]
            runs = [run_engine(args.model, k, conc, args.max_tokens, p) for p in per_prompt]
            r = {key: sum(x[key] for x in runs) / len(runs) for key in ("tok_s", "first_acc", "mean_acc")}
            r["steps"] = sum(x["steps"] for x in runs)
            tokens = [t for x in runs for t in x["tokens"]]
            base = base or {"tok_s": r["tok_s"], "tokens": tokens}
            same = "" if tokens == base["tokens"] else " (outputs differ from k=0!)"
            print(
                f"| {k} | {conc} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | {r['first_acc']:.1%} | "
                f"{r['mean_acc']:.2f} | {r['steps']} |{same}"
            )


if __name__ == "__main__":
    main()
