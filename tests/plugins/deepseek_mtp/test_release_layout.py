"""DeepSeek-V4 as released: FP8 E4M3 weights with UE8M0 (E8M0) block scales in ``X.scale``, MXFP4
routed experts (int8 ``[out, in/2]``, two E2M1 codes a byte, low nibble first, with E8M0 scales per
32 values), DeepSeek's names (``attn.kv_norm``, no ``model.`` prefix), ``quantization_config`` with
``scale_fmt = "ue8m0"`` and ``expert_dtype = "fp4"``.

The quantiser here is written from that published description, not from the loader's code: E8M0
scales are the smallest power of two at or above ``amax / max_code`` (found with ``frexp``), E2M1
codes by nearest-value search over the 16-code table, and the float copy holds exactly the values
the quantized tensors stand for, decoded here. The test checkpoint converted this way (MTP layers
included) loads through the real loader and decodes as its float copy; malformed copies are refused
with errors naming the method, the tensor and what was expected; ``tiny-deepseek-v4-fp8`` is the
embedded model in this layout, written at first use.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pypto_serving.quantization import UnsupportedQuantizationError

from .helpers import Checkpoint, FakeCore, greedy_generate, make_executor

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = (16, 24)  # FP8 blocks that straddle the test model's 32-wide and 16-wide matrices
GROUP = 32
CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": list(BLOCK)}

ROUTED = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|shared_experts\.w[123]|e_proj|h_proj)\.weight$")
FLOAT32 = re.compile(r"(attn_sink|(^|\.)hc_\w+|\.ape|gate\.bias)$")
_LAYER_LEAF = (
    r"attn_norm\.weight|ffn_norm\.weight|hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink"
    r"|attn\.(wq_a|q_norm|wq_b|wkv|kv_norm|wo_a|wo_b)\.(weight|scale)"
    r"|attn\.compressor\.(wkv|wgate|norm)\.weight|attn\.compressor\.ape"
    r"|attn\.indexer\.(wq_b|weights_proj)\.(weight|scale)|attn\.indexer\.compressor\.((wkv|wgate|norm)\.weight|ape)"
    r"|ffn\.gate\.(weight|bias|tid2eid)|ffn\.(experts\.\d+|shared_experts)\.w[123]\.(weight|scale)"
)
RELEASE_NAMES = re.compile(
    rf"^(embed\.weight|head\.weight|norm\.weight|hc_head_(fn|base|scale)|layers\.\d+\.({_LAYER_LEAF})"
    rf"|mtp\.\d+\.({_LAYER_LEAF}|(e_proj|h_proj)\.(weight|scale)|(enorm|hnorm|norm)\.weight|hc_head_(fn|base|scale)))$"
)


# ----------------------------------------------------------------------------- the test's quantiser


def _exponent_at_least(minimum: torch.Tensor) -> torch.Tensor:
    """The smallest ``e`` with ``2**e >= minimum`` (``frexp``: ``x = m * 2**e``, ``0.5 <= m < 1``)."""
    m, e = torch.frexp(minimum.double().clamp_min(2.0**-127))
    return torch.where(m == 0.5, e - 1, e).clamp(-127, 127)


def _e8m0(exponent: torch.Tensor) -> torch.Tensor:
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _e8m0_value(scale: torch.Tensor) -> torch.Tensor:
    return (2.0 ** (scale.view(torch.uint8).double() - 127)).float()


def _fp8_decode(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    full = torch.kron(_e8m0_value(scale), torch.ones(block))
    return q.float() * full[: q.shape[0], : q.shape[1]]


def _fp8_encode(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    (rows, cols), (out, inp) = block, w.shape
    grid = (-(-out // rows), -(-inp // cols))
    exponent = torch.empty(grid, dtype=torch.int32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            exponent[i, j] = _exponent_at_least(
                w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].abs().max() / 448
            )
    scale = _e8m0(exponent)
    return (w / _fp8_decode(torch.ones_like(w), scale, block)).to(torch.float8_e4m3fn), scale


def _fp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1)
    u = packed.view(torch.uint8).long()
    codes = torch.empty(u.shape[0], 2 * u.shape[1], dtype=torch.long)
    codes[:, 0::2], codes[:, 1::2] = u & 15, u >> 4  # low nibble: the even column
    return table[codes] * _e8m0_value(scale).repeat_interleave(GROUP, 1)[:, : codes.shape[1]]


def _fp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    groups = -(-inp // GROUP)
    padded = torch.zeros(out, groups * GROUP)
    padded[:, :inp] = w
    scale = _e8m0(_exponent_at_least(padded.view(out, groups, GROUP).abs().amax(-1) / 6.0).int())
    x = w / _e8m0_value(scale).repeat_interleave(GROUP, 1)[:, :inp]
    codes = (x[..., None] - torch.tensor(E2M1)).abs().argmin(-1)  # the nearest of the 16 values
    return (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).view(torch.int8), scale


def _release_name(key: str) -> str:
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    top.update({f"model.hc_head.hc_{a}": f"hc_head_{a}" for a in ("fn", "base", "scale")})
    name = top.get(key, key.removeprefix("model."))
    return re.sub(r"(^|\.)attn\.norm\.weight$", r"\1attn.kv_norm.weight", name)


def convert(src: Path, release: Path, plain: Path) -> None:
    """``src`` in the release layout (``release``) and the float32 values it stands for under the
    source's names (``plain``)."""
    for d in (release, plain):
        d.mkdir()
        for f in ("config.json", "generation_config.json"):
            shutil.copyfile(src / f, d / f)
    quant: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for key, t in load_file(str(src / "model.safetensors")).items():
        name = _release_name(key)
        stem = name.removesuffix(".weight")
        if ROUTED.search(name):
            quant[name], quant[stem + ".scale"] = _fp4_encode(t)
            exact[key] = _fp4_decode(quant[name], quant[stem + ".scale"])
        elif FP8.search(name):
            quant[name], quant[stem + ".scale"] = _fp8_encode(t, BLOCK)
            exact[key] = _fp8_decode(quant[name], quant[stem + ".scale"], BLOCK)
        elif not t.is_floating_point():
            quant[name] = exact[key] = t.to(torch.int64)
        else:
            quant[name] = t.float() if FLOAT32.search(name) else t.to(torch.bfloat16)
            exact[key] = quant[name].float()
    save_file(quant, str(release / "model.safetensors"), metadata={"format": "pt"})
    save_file(exact, str(plain / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (release / "config.json").write_text(json.dumps({**cfg, "quantization_config": CONFIG, "expert_dtype": "fp4"}))


@pytest.fixture(scope="module")
def copies(checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(release layout, float copy) of the two-MTP-depth test checkpoint."""
    root = tmp_path_factory.mktemp("release")
    convert(checkpoints["mixed_yarn"].path, root / "release", root / "plain")
    return root / "release", root / "plain"


# ----------------------------------------------------------------------------- loading


def _run(path: Path, k: int = 2) -> tuple[dict[str, list[int]], list[torch.Tensor], list[list[list[int]]]]:
    ex, info = make_executor(path, k=k)
    core = FakeCore(ex, info)
    logits: list[torch.Tensor] = []
    drafts: list[list[list[int]]] = []
    execute = ex.execute

    def recording(batch: Any) -> Any:
        out = execute(batch)
        logits.append(out.clone())
        return out

    ex.execute = recording
    prompts = {"a": [5, 17, 3, 60, 41, 8, 22, 90, 1], "b": [33, 2, 71]}
    tokens = greedy_generate(core, prompts, 10, k=k, on_step=lambda _b, _h, new: drafts.append(new))
    return tokens, logits, drafts


def test_the_copy_follows_the_published_layout(copies: tuple[Path, Path]) -> None:
    release, _ = copies
    with safe_open(str(release / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert [k for k in dtypes if not RELEASE_NAMES.match(k)] == []
    assert dtypes["layers.1.attn.kv_norm.weight"] == "BF16" and dtypes["mtp.1.attn.kv_norm.weight"] == "BF16"
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["mtp.0.e_proj.weight"] == "F8_E4M3" and dtypes["mtp.0.e_proj.scale"] == "F8_E8M0"
    assert dtypes["mtp.1.ffn.experts.3.w2.weight"] == "I8" and dtypes["mtp.1.ffn.experts.3.w2.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I64" and dtypes["layers.2.attn.compressor.ape"] == "F32"
    assert dtypes["layers.0.attn.attn_sink"] == "F32" and dtypes["hc_head_fn"] == "F32"


def test_release_layout_decodes_as_its_float_values(
    copies: tuple[Path, Path], checkpoints: dict[str, Checkpoint]
) -> None:
    release, plain = copies
    tokens, logits, drafts = _run(release)
    ref_tokens, ref_logits, ref_drafts = _run(plain)
    assert tokens == ref_tokens
    assert drafts == ref_drafts and any(any(d) for d in drafts)
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The copy is quantized for real: the values differ from the source's.
    src = load_file(str(checkpoints["mixed_yarn"].path / "model.safetensors"))
    exact = load_file(str(plain / "model.safetensors"))
    for key in ("model.layers.1.attn.wq_b.weight", "mtp.0.ffn.experts.2.w1.weight"):
        assert not torch.equal(src[key], exact[key])
        assert (src[key] - exact[key]).abs().max() < 0.5 * src[key].abs().max()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_each_rank_reads_its_part_of_the_quantized_weights(copies: tuple[Path, Path], expert_parallel: bool) -> None:
    """Two ranks' parts (an FP8 block or an MXFP4 group split between them) decode to the float
    copy's parts exactly."""
    from pypto_serving.parallel import ParallelContext
    from pypto_serving_deepseek_mtp.config import load_config
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.sharding import ShardPlan
    from pypto_serving_deepseek_mtp.weights import load_weights

    release, plain = copies
    cfg = load_config(release)
    for rank in (0, 1):
        plan = ShardPlan(cfg, ParallelContext(rank=rank, world_size=2), expert_parallel=expert_parallel)
        got = load_weights(release, torch.device("cpu"), torch.float32, FP32_SUFFIXES, plan=plan)
        want = load_weights(plain, torch.device("cpu"), torch.float32, FP32_SUFFIXES, plan=plan)
        assert got.keys() == want.keys()
        assert [k for k in got if not torch.equal(got[k], want[k])] == []
        w2 = got["layers.1.ffn.experts.1.w2.weight"] if not expert_parallel else None
        assert w2 is None or w2.shape == (32, 8)  # half of an MXFP4 group of 16 columns


# ----------------------------------------------------------------------------- malformed checkpoints


def _broken(copy: Path, dest: Path, config: dict[str, Any] | None = None, **tensors: torch.Tensor | None) -> Path:
    shutil.copytree(copy, dest)
    if config is not None:
        cfg = json.loads((dest / "config.json").read_text())
        cfg.update(config)
        (dest / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(dest / "model.safetensors"))
        for k, v in tensors.items():
            name = k.replace("__", ".")
            if v is None:
                del t[name]
            else:
                t[name] = v
        save_file(t, str(dest / "model.safetensors"))
    return dest


def _cases(release: Path) -> dict[str, tuple[dict[str, Any], dict[str, Any], str]]:
    t = load_file(str(release / "model.safetensors"))
    wq_a, w1 = t["layers.1.attn.wq_a.scale"], t["layers.1.ffn.experts.0.w1.scale"]
    method = r"\(config.json: quant_method='fp8', fmt='e4m3', scale_fmt='ue8m0', weight_block_size=\[16, 24\], "
    return {
        "another method": (
            {"quantization_config": {**CONFIG, "quant_method": "mxfp4"}},
            {},
            "quant_method='mxfp4' is not supported",
        ),
        "unknown fmt": ({"quantization_config": {**CONFIG, "fmt": "e3m4"}}, {}, "fp8 fmt='e3m4' is not supported"),
        "unknown scale_fmt": (
            {"quantization_config": {**CONFIG, "scale_fmt": "ue5m3"}},
            {},
            r"scale_fmt='ue5m3' \(quant_method='fp8'\) is not supported; expected one of \['ue8m0'\]",
        ),
        "unknown expert_dtype": (
            {"expert_dtype": "nvfp4"},
            {},
            "expert_dtype='nvfp4' is not supported; expected 'fp4'",
        ),
        "weights not in fmt": (
            {"quantization_config": {**CONFIG, "fmt": "e5m2"}},
            {},
            r"\.weight is F8_E4M3; fmt='e5m2' expects F8_E5M2 \(config.json: quant_method='fp8', fmt='e5m2'",
        ),
        "missing fp8 scale": (
            {},
            {"layers.1.attn.wq_b.scale": None},
            r"layers\.1\.attn\.wq_b\.weight has no scales: expected layers\.1\.attn\.wq_b\.scale "
            r"\(float8_e8m0fnu, one per 16x24 block\) " + method,
        ),
        "missing expert scale": (
            {},
            {"mtp.0.ffn.experts.1.w2.scale": None},
            r"mtp\.0\.ffn\.experts\.1\.w2\.weight has no scales: expected mtp\.0\.ffn\.experts\.1\.w2\.scale "
            r"\(float8_e8m0fnu \[out, in/32\]\) " + method + "expert_dtype='fp4'",
        ),
        "wrong block": (
            {"quantization_config": {**CONFIG, "weight_block_size": [8, 24]}},
            {},
            r"fp8 weight \S+\.weight of shape \[\d+, \d+\] needs scales of shape \[\d+, \d+\] for 8x24 blocks, got",
        ),
        "wrong expert scale shape": (
            {},
            {"layers.1.ffn.experts.0.w1.scale": torch.cat([w1, w1], 1)},
            r"mxfp4 expert layers\.1\.ffn\.experts\.0\.w1\.weight packed as \[16, 16\] needs float8_e8m0fnu scales "
            r"of shape \[16, 1\] \(one per 32 values\), got \[16, 2\]",
        ),
        "fp8 scale dtype": (
            {},
            {"layers.1.attn.wq_a.scale": _e8m0_value(wq_a)},
            r"layers\.1\.attn\.wq_a\.scale is F32; expected float8_e8m0fnu, one per 16x24 block " + method,
        ),
        "expert scale dtype": (
            {},
            {"layers.1.ffn.experts.0.w1.scale": _e8m0_value(w1)},
            r"layers\.1\.ffn\.experts\.0\.w1\.scale is F32; expected float8_e8m0fnu \[out, in/32\]",
        ),
        "expert not packed": (
            {},
            {"layers.1.ffn.experts.0.w1.weight": torch.zeros(16, 32, dtype=torch.bfloat16)},
            r"layers\.1\.ffn\.experts\.0\.w1\.weight is BF16; expert_dtype='fp4' expects int8 \[out, in/2\]",
        ),
        "packed experts undeclared": (
            {"expert_dtype": None},
            {},
            r"ffn\.experts\.\d+\.w[123]\.weight is I8: a packed expert needs expert_dtype='fp4'",
        ),
        "scale of a float weight": (
            {},
            {"layers.1.ffn.gate.scale": wq_a},
            r"layers\.1\.ffn\.gate\.scale scales layers\.1\.ffn\.gate\.weight, which is BF16, not a quantized weight",
        ),
    }


def test_malformed_release_checkpoints_are_refused_by_name(copies: tuple[Path, Path], tmp_path: Path) -> None:
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.weights import load_weights

    release, _ = copies
    for i, (what, (config, tensors, message)) in enumerate(_cases(release).items()):
        broken = _broken(release, tmp_path / str(i), config, **{k.replace(".", "__"): v for k, v in tensors.items()})
        with pytest.raises(UnsupportedQuantizationError, match=message):
            load_weights(broken, torch.device("cpu"), torch.float32, FP32_SUFFIXES)
        if what == "missing fp8 scale":  # the executor's load says the same
            with pytest.raises(UnsupportedQuantizationError, match=message):
                make_executor(broken)


# ----------------------------------------------------------------------------- the format's functions


def test_ue8m0_and_e2m1_decode_as_published() -> None:
    from pypto_serving.quantization import decode_ue8m0, unpack_e2m1

    bits = torch.arange(256, dtype=torch.uint8)
    got = decode_ue8m0(bits.view(torch.float8_e8m0fnu))
    want = torch.tensor([2.0 ** (e - 127) for e in range(255)] + [float("nan")])
    assert torch.equal(got[:255], want[:255]) and got[255].isnan()
    pairs = unpack_e2m1(bits.view(torch.int8)).view(256, 2)
    assert pairs.tolist() == [[E2M1[b & 15], E2M1[b >> 4]] for b in range(256)]


def test_the_shipped_encoders_agree_with_the_published_rounding() -> None:
    """The encoders the named model is written with give the scales this test's quantiser picks and
    the nearest representable values."""
    from pypto_serving.quantization import dequantize_mxfp4, quantize_fp8_ue8m0, quantize_mxfp4

    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 70)
    packed, scale = quantize_mxfp4(w)
    want_packed, want_scale = _fp4_encode(w)
    assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    assert torch.equal(dequantize_mxfp4(packed, scale), _fp4_decode(want_packed, want_scale))
    q, s = quantize_fp8_ue8m0(w, BLOCK)
    want_q, want_s = _fp8_encode(w, BLOCK)
    assert torch.equal(s.view(torch.uint8), want_s.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


# ----------------------------------------------------------------------------- tiny-deepseek-v4-fp8


@pytest.mark.requires_plugin("sync_sched")
def test_tiny_deepseek_v4_fp8_is_written_at_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model tiny-deepseek-v4-fp8`` alone serves the embedded model in the release layout; its
    greedy tokens are those of the float values it stands for (decoded by this test)."""
    from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4
    from tests.plugins.embedded import engine_greedy, tokenize

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ids = tokenize(TINY_DEEPSEEK_V4, "def main():\n")
    kw = {"dtype": "float32", "scheduler": "sync"}
    tokens = engine_greedy("tiny-deepseek-v4-fp8", ids, 8, **kw)
    written = tmp_path / "cache" / "pypto-serving" / "models" / "tiny-deepseek-v4-fp8"
    cfg = json.loads((written / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["expert_dtype"] == "fp4"
    block = tuple(cfg["quantization_config"]["weight_block_size"])
    assert block == (128, 128)
    t = load_file(str(written / "model.safetensors"))
    assert t["layers.1.attn.kv_norm.weight"].dtype == torch.bfloat16 and "embed.weight" in t
    plain = tmp_path / "plain"
    shutil.copytree(TINY_DEEPSEEK_V4, plain)
    exact = {}
    for name, v in t.items():
        if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in t:
            continue
        scale = t.get(name.removesuffix(".weight") + ".scale")
        if v.dtype == torch.int8:
            exact[name] = _fp4_decode(v, scale)
        elif v.dtype == torch.float8_e4m3fn:
            exact[name] = _fp8_decode(v, scale, block)
        else:
            exact[name] = v.float() if v.is_floating_point() else v
    assert any(v.dtype == torch.int8 for v in t.values()) and any(v.dtype == torch.float8_e4m3fn for v in t.values())
    save_file(exact, str(plain / "model.safetensors"))
    assert engine_greedy(str(plain), ids, 8, **kw) == tokens
    mtime = (written / "model.safetensors").stat().st_mtime_ns
    assert engine_greedy("tiny-deepseek-v4-fp8", ids, 8, **kw) == tokens
    assert (written / "model.safetensors").stat().st_mtime_ns == mtime  # not written again


def test_an_fp8_expert_beside_mxfp4_ones_reads_as_fp8(copies: tuple[Path, Path], tmp_path: Path) -> None:
    """Under ``expert_dtype = "fp4"`` an expert stored as block FP8 with its E8M0 scales (as the
    description's ``quantization_config`` allows) is read as FP8, not refused."""
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.weights import load_weights

    release, plain = copies
    name = "mtp.0.ffn.experts.1.w3.weight"
    exact = load_file(str(plain / "model.safetensors"))[name]
    q, scale = _fp8_encode(exact, BLOCK)
    mixed = _broken(
        release, tmp_path / "mixed", None, **{name.replace(".", "__"): q, "mtp__0__ffn__experts__1__w3__scale": scale}
    )
    got = load_weights(mixed, torch.device("cpu"), torch.float32, FP32_SUFFIXES)[name]
    assert torch.equal(got, _fp8_decode(q, scale, BLOCK))
