"""Multi-LoRA for executors: PEFT adapters read and checked against a model's projections, and the
stacks that apply the adapters of a mixed batch in one pass per projection (public: executors use
it, see docs/plugins.md).

An executor names the projections an adapter may target by their PEFT module paths (the model's
transformers names under ``base_model.model.``, e.g. ``model.layers.0.self_attn.q_proj``) with their
``(out, in)`` shapes; :func:`read_adapter` refuses anything else by name.

Every adapter's low-rank pair of a projection is padded to the largest rank ``R`` and stacked with a
zero slot 0 (the base model): ``A`` ``[S, R, in]`` and ``B`` ``[S, R, out]`` (free slots are zero),
the scale (``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA) folded into ``B``. A step gives each
token its request's slot, and the delta of every token is two matmuls over the flattened stacks:
``x @ A_all`` (``[T, S*R]``, every slot's shrink), the columns of the other slots zeroed by the
token's one-hot slot, then ``@ B_all`` (the expand, kept as ``[S*R, out]``). No Python loop runs
over rows or adapters, and the extra work per token is ``S * R * (in + out)`` multiply-adds, for
``S = max_loras + 1`` slots and ``R`` the largest rank loaded: small beside the base projection for
a handful of slots of modest rank (``max_loras``, ``max_lora_rank`` bound it). Only steps where some
token has an adapter pay it.

A fused projection (q/k/v, gate/up) stacks its parts' ``A`` side by side and their ``B`` block-
diagonally, so it too is two matmuls; a part an adapter does not target stays zero.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["LoraAdapter", "LoraContext", "LoraStack", "batch_onehot", "read_adapter", "slot_onehot"]

_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")

#: An executor's reason why a module (a PEFT module path or target name) takes no adapter, or None.
Explain = Callable[[str], str | None]


@dataclass(slots=True)
class LoraAdapter:
    """One PEFT adapter: its rank, scale and ``(A [r, in], B [out, r])`` (B scaled) per module path."""

    name: str
    rank: int
    scale: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass(slots=True)
class LoraContext:
    """The step's per-token slot one-hot ``[T, S]`` (None: no token has an adapter), shared by every
    :class:`LoraStack` of one model and set by the executor before each forward."""

    onehot: torch.Tensor | None = None
    slots: int = 1  # the stacks' slot count (slot 0: the base model), the one-hot's width


def slot_onehot(
    slots: list[int], rows: list[int], width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Each token's slot as a one-hot ``[T, width]``: request ``r`` has ``rows[r]`` tokens of slot
    ``slots[r]``. The per-token slots come from host lists and are uploaded once; nothing is read back."""
    per_token = torch.tensor([slot for slot, n in zip(slots, rows, strict=True) for _ in range(n)], device=device)
    return torch.eye(width, dtype=dtype, device=device).index_select(0, per_token)


def batch_onehot(
    loras: Sequence[str | None],
    query_start_loc: Sequence[int],
    lora_slots: dict[str, int],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """:func:`slot_onehot` of a step: each request's adapter (``None``: the base, slot 0) by its name's
    slot, over its query tokens (``query_start_loc``, the host copy of the step's offsets)."""
    slots = [0 if name is None else lora_slots[name] for name in loras]
    rows = [end - start for start, end in pairwise(query_start_loc)]
    return slot_onehot(slots, rows, width, dtype, device)


def _refuse(name: str, path: Path, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r} ({path}): {why}")


def _leaf_names(shapes: dict[str, tuple[int, int]]) -> list[str]:
    """The module names an adapter may target (the last part of each path), for error messages."""
    return sorted({m.rpartition(".")[2] for m in shapes})


def _check_targets(
    name: str, path: Path, cfg: dict[str, object], shapes: dict[str, tuple[int, int]], explain: Explain | None
) -> None:
    """Refuse ``target_modules`` that name no adaptable projection (PEFT's rule: a module path equal
    to a target or ending in ``.target``) and ``target_parameters`` (parameter adapters, as of
    routed experts). A string is PEFT's regex or "all-linear": its weights are checked one by one."""
    targets = cfg.get("target_modules") or []
    if not isinstance(targets, str) and isinstance(targets, list | tuple):
        unknown = sorted(t for t in targets if not any(m == t or m.endswith(f".{t}") for m in shapes))
        if unknown:
            whys = [f"{t}: {why}" for t in unknown if explain is not None and (why := explain(t))]
            said = f" ({'; '.join(whys)})" if whys else ""
            known = _leaf_names(shapes)
            raise _refuse(name, path, f"target modules {unknown} are not supported{said}; LoRA applies to {known}")
    if cfg.get("target_parameters"):
        why = f"target_parameters {cfg['target_parameters']} (parameter adapters, e.g. of routed experts)"
        raise _refuse(name, path, f"{why} are not supported; LoRA applies to {_leaf_names(shapes)}")


def _read_config(
    name: str, path: Path, max_rank: int, shapes: dict[str, tuple[int, int]], explain: Explain | None
) -> tuple[int, float]:
    """The adapter's rank and scale; refuses what an executor cannot apply exactly."""
    if not path.is_dir():
        raise _refuse(name, path, "no such directory")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file() or not (path / "adapter_model.safetensors").is_file():
        raise _refuse(name, path, "not a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, path, f"peft_type {cfg.get('peft_type')!r} is not supported, only LORA")
    if cfg.get("modules_to_save"):
        raise _refuse(name, path, f"modules_to_save {cfg['modules_to_save']} (fully trained modules) is not supported")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "trainable_token_indices"):
        if cfg.get(key):
            raise _refuse(name, path, f"{key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, path, f"bias={cfg['bias']!r} is not supported, only 'none'")
    _check_targets(name, path, cfg, shapes, explain)
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if rank > max_rank:
        raise _refuse(name, path, f"rank {rank} exceeds max_lora_rank={max_rank}")
    return rank, alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _halves(
    name: str,
    root: Path,
    shapes: dict[str, tuple[int, int]],
    explain: Explain | None,
) -> dict[tuple[str, str], torch.Tensor]:
    """The adapter file's ``A`` and ``B`` halves by (module path, half); a weight of a module that
    takes no adapter is refused, naming it (``explain(module)``: the executor's reason, if any)."""
    from safetensors.torch import load_file  # the executors that read adapters depend on it

    halves: dict[tuple[str, str], torch.Tensor] = {}
    for key, tensor in load_file(str(root / "adapter_model.safetensors")).items():
        m = _KEY.match(key)
        if m is None or m[1] not in shapes:
            module = key if m is None else m[1]
            why = explain(module) if explain is not None and m is not None else None
            if why is None and ("embed" in key or "lm_head" in key):
                why = "embedding or LM-head adapters are not supported"
            why = why or f"module {module!r} takes no adapter"
            raise _refuse(name, root, f"{key}: {why} (LoRA applies to {_leaf_names(shapes)})")
        halves[(m[1], m[2])] = tensor.float()
    return halves


def read_adapter(
    name: str,
    path: str | Path,
    max_rank: int,
    shapes: dict[str, tuple[int, int]],
    explain: Explain | None = None,
) -> LoraAdapter:
    """Read a PEFT adapter directory. ``shapes``: ``(out, in)`` of every projection LoRA may target,
    by PEFT module path; a weight for anything else (``explain`` may say why that module takes none),
    or of another shape, is refused."""
    root = Path(path)
    rank, scale = _read_config(name, root, max_rank, shapes, explain)
    halves = _halves(name, root, shapes, explain)
    adapter = LoraAdapter(name, rank, scale)
    for (module, half), a in halves.items():
        if half != "A":
            continue
        b = halves.get((module, "B"))
        out, inp = shapes[module]
        if b is None or a.shape != (rank, inp) or b.shape != (out, rank):
            got = (tuple(a.shape), None if b is None else tuple(b.shape))
            raise _refuse(
                name,
                root,
                f"{module}: A/B shapes {got} do not fit the base model's ({rank}, {inp}) / ({out}, {rank})",
            )
        # B is kept column-major (its transpose contiguous): a slot of the stacks holds B transposed.
        adapter.pairs[module] = (a, (b * scale).t().contiguous().t())
    return adapter


class LoraStack(torch.nn.Module):
    """The stacked LoRA weights of one (possibly fused) projection: ``parts`` its PEFT module paths,
    ``outs`` their output widths in the fused order, ``inp`` the input width, ``slots`` the slots
    made at once (executors make ``max_loras + 1``). Slots are written one adapter at a time
    (:meth:`write`), at start or at run time; the stacks grow to the largest rank written (and to a
    slot beyond ``slots``), copying what they hold, so their cost follows the ranks loaded, not
    ``max_lora_rank``."""

    def __init__(
        self,
        parts: tuple[str, ...],
        outs: tuple[int, ...],
        inp: int,
        ctx: LoraContext,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 1,
    ) -> None:
        super().__init__()
        self.ctx, self.targets, self.outs, self.inp = ctx, parts, outs, inp
        self.parts, self.slots, self.rank = len(parts), slots, 1
        # Both stacks keep a slot's rows contiguous (B transposed), so writing one slot copies whole
        # rows: a strided copy into B's columns costs seconds for a large adapter on the CPU.
        self.a_all = torch.zeros(self.parts * slots, inp, dtype=dtype, device=device)  # [P*S*R, in]
        self.b_all = torch.zeros(self.parts * slots, sum(outs), dtype=dtype, device=device)  # [P*S*R, out]

    def _resize(self, slots: int, rank: int) -> None:
        """Grow the stacks to ``slots`` slots of rank ``rank``, keeping what the old ones hold."""
        p, s, r, out = self.parts, self.slots, self.rank, sum(self.outs)
        a = self.a_all.new_zeros(p, slots, rank, self.inp)
        b = self.b_all.new_zeros(p, slots, rank, out)
        a[:, :s, :r] = self.a_all.view(p, s, r, self.inp)
        b[:, :s, :r] = self.b_all.view(p, s, r, out)
        self.a_all, self.b_all = a.view(-1, self.inp), b.view(-1, out)
        self.slots, self.rank = slots, rank

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter``'s pairs of this projection into ``slot`` (whatever it held is replaced;
        a part the adapter does not target stays zero)."""
        if slot >= self.slots or adapter.rank > self.rank:
            self._resize(max(self.slots, slot + 1), max(self.rank, adapter.rank))
        a = self.a_all.view(self.parts, self.slots, self.rank, self.inp)
        b = self.b_all.view(self.parts, self.slots, self.rank, sum(self.outs))
        a[:, slot].zero_()
        b[:, slot].zero_()
        row = 0
        for p, (target, width) in enumerate(zip(self.targets, self.outs, strict=True)):
            pair = adapter.pairs.get(target)
            if pair is not None:
                a[p, slot, : adapter.rank] = pair[0]
                b[p, slot, : adapter.rank, row : row + width] = pair[1].t()
            row += width

    def add_delta(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``base`` plus every token's own adapter's delta (nothing when no token has one)."""
        onehot = self.ctx.onehot
        if onehot is None:
            return base
        shrunk = F.linear(x, self.a_all).view(x.shape[0], self.parts, self.slots, self.rank)
        masked = shrunk * onehot.to(shrunk.dtype)[:, None, :, None]
        return base + masked.view(x.shape[0], -1) @ self.b_all
