"""The plugin contract, as a third party meets it.

A third-party plugin (an executor that drafts, a scheduling strategy and a speculative-token policy)
is written here only against what ``pypto_serving``'s root exports, type-checked with
``mypy --strict`` against the Protocols, registered with ``PluginManager(extra_plugins=[...])`` and
run through ``LLM.generate``; its tokens must equal an independent reference. Around it: hooks are
called through pluggy (wrappers, ``tryfirst``), the core names no plugin, ``scheduler = "auto"``
picks by what is installed, and the KV planner refuses absurd block counts.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
import pytest

from pypto_serving import (
    LLM,
    CacheGroupSpec,
    ExecutorSpec,
    PluginError,
    PluginManager,
    SamplingParams,
    SchedulerSpec,
    SettingsError,
    hookimpl,
)
from pypto_serving.engine import MAX_KV_BLOCKS_PER_GROUP, plan_kv_blocks
from tests.fakes import FakePlugin, make_fake_executor, reference_tokens

ROOT = Path(__file__).resolve().parents[2]

# The third-party plugin. Its model is the fake executor's (tests/fakes.py ``next_token``), written
# again here from the documented surface and read back through the paged cache it is handed.
PLUGIN_SOURCE = '''
"""A third-party executor, strategy and policy, using only names pypto_serving's root exports."""

from __future__ import annotations

import torch

from pypto_serving import (
    BatchInput,
    CacheGroupSpec,
    Executor,
    ExecutorInfo,
    ExecutorSpec,
    Request,
    SchedulerOutput,
    SchedulerSpec,
    ServingSettings,
    SpecPolicy,
    SpecPolicySpec,
    StepResult,
    StepStrategy,
    StrategyHost,
    hookimpl,
)

VOCAB = 97
MAX_DRAFT = 2
BYTES_PER_BLOCK = 1 << 20  # declared, not allocated: the cache below holds one token id per slot
policy_calls: list[tuple[int, int]] = []  # (max_k, k) of every policy call
drains: list[int] = []  # steps applied by each drain()


def next_token(context: list[int]) -> int:
    acc = len(context)
    for i, t in enumerate(context):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return acc % VOCAB


class PagedCountingExecutor(Executor):
    """Writes each input token at its slot and predicts from the whole sequence read back from there."""

    def __init__(self, settings: ServingSettings) -> None:
        self.block_size = settings.block_size
        self.cache = torch.empty(0, dtype=torch.long)

    def load(self) -> ExecutorInfo:
        self.device = torch.device("cpu")
        return ExecutorInfo(
            cache_groups=[CacheGroupSpec("kv", self.block_size, bytes_per_block=BYTES_PER_BLOCK)],
            vocab_size=VOCAB,
            max_model_len=256,
            max_draft_tokens=MAX_DRAFT,
        )

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        self.cache = torch.full((num_blocks["kv"] * self.block_size,), -1, dtype=torch.long)

    def _context(self, table: torch.Tensor, length: int) -> list[int]:
        pos = torch.arange(length)
        slots = table.long()[pos // self.block_size] * self.block_size + pos % self.block_size
        return [int(t) for t in self.cache[slots].tolist()]

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.cache[batch.slot_mapping["kv"]] = batch.input_ids
        rows = []
        ends = batch.query_start_loc.tolist()[1:]
        positions = batch.positions.tolist()
        for r, end in enumerate(ends):
            for t in range(end - batch.num_logits[r], end):
                row = torch.zeros(VOCAB)
                row[next_token(self._context(batch.block_tables["kv"][r], positions[t] + 1))] = 10.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)

    def propose_drafts(self, batch: BatchInput, accepted: list[list[int]]) -> list[list[int]]:
        drafts: list[list[int]] = []
        ends = batch.query_start_loc.tolist()[1:]
        positions = batch.positions.tolist()
        for r, (end, acc) in enumerate(zip(ends, accepted)):
            if not acc:
                drafts.append([])
                continue
            first = end - batch.num_logits[r]  # the row whose input is the last token sampled before
            context = [*self._context(batch.block_tables["kv"][r], positions[first] + len(acc)), acc[-1]]
            mine: list[int] = []
            for _ in range(MAX_DRAFT):
                mine.append(next_token(context + mine))
            drafts.append(mine)
        return drafts


def make_executor(settings: ServingSettings) -> Executor:
    return PagedCountingExecutor(settings)


class DeferredApplyStrategy:
    """Applies each step at the start of the next call: one step stays in flight between calls, and
    the next is scheduled only after it is applied, so the strategy does not pipeline."""

    def __init__(self, host: StrategyHost) -> None:
        self.host = host
        self.pending: SchedulerOutput | None = None

    def step(self) -> None:
        self._apply_pending()
        out = self.host.schedule()
        if out is not None:
            self.host.submit(out)
            self.pending = out

    def drain(self) -> None:
        drains.append(self._apply_pending())

    def _apply_pending(self) -> int:
        if self.pending is None:
            return 0
        out, self.pending = self.pending, None
        result: StepResult = self.host.wait_result()
        self.host.apply(out, result)
        return 1


def make_strategy(host: StrategyHost) -> StepStrategy:
    return DeferredApplyStrategy(host)


def all_drafts(settings: ServingSettings) -> SpecPolicy:
    def policy(request: Request, max_k: int) -> int:
        k = max_k if request.sampling_params.greedy else 0
        policy_calls.append((max_k, k))
        return k

    return policy


@hookimpl
def pypto_serving_register_executors() -> list[ExecutorSpec]:
    return [ExecutorSpec(name="paged_counting", factory=make_executor, architectures=("PagedCountingForCausalLM",))]


@hookimpl
def pypto_serving_register_schedulers() -> list[SchedulerSpec]:
    return [SchedulerSpec(name="deferred_apply", factory=make_strategy, pipelined=False)]


@hookimpl
def pypto_serving_register_spec_policies() -> list[SpecPolicySpec]:
    return [SpecPolicySpec(name="all_drafts", factory=all_drafts)]
'''

# Type errors a plugin must get from mypy when it breaks the Protocols (checked beside the plugin).
BROKEN_SOURCE = """
from __future__ import annotations

from pypto_serving import SchedulerSpec, SpecPolicySpec, StrategyHost


class NoDrain:
    def __init__(self, host: StrategyHost) -> None:
        self.host = host

    def step(self) -> None:
        self.host.submit(self.host.schedule())


SPEC = SchedulerSpec(name="no_drain", factory=NoDrain)
POLICY = SpecPolicySpec(name="old", factory=lambda settings: lambda request, is_decode, max_k: 0)
"""


PLUGIN_FILES = ("contract_plugin.py", "broken_plugin.py")


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The plugin as a module ``contract_plugin`` on ``sys.path`` (a spawned worker imports it too)."""
    d = tmp_path_factory.mktemp("contract_plugin")
    (d / "contract_plugin.py").write_text(textwrap.dedent(PLUGIN_SOURCE), encoding="utf-8")
    (d / "broken_plugin.py").write_text(textwrap.dedent(BROKEN_SOURCE), encoding="utf-8")
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))
    sys.modules.pop("contract_plugin", None)


@pytest.fixture
def plugin(plugin_dir: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("contract_plugin", plugin_dir / "contract_plugin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["contract_plugin"] = module
    spec.loader.exec_module(module)
    return module


def _generate(plugin: ModuleType, prompts: list[list[int]], **settings: Any) -> list[list[int]]:
    pm = PluginManager(load_entry_points=False, extra_plugins=[plugin])
    with LLM(plugins=pm, executor="paged_counting", block_size=4, kv_cache_memory=256 << 20, **settings) as llm:
        assert llm.engine is not None
        assert type(llm.engine.strategy).__name__ == "DeferredApplyStrategy"
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        stats = llm.engine.stats()
    assert stats["spec_drafted"] > 0 and stats["spec_accepted"] == stats["spec_drafted"]
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("worker_mode", ["inproc", "process"])
def test_third_party_executor_strategy_and_policy_generate(plugin: ModuleType, worker_mode: str) -> None:
    """``scheduler = "auto"`` with only the plugin's non-pipelined strategy installed picks it; the
    executor's exact drafts are all accepted; the tokens equal the fake model's reference."""
    prompts = [[1, 2, 3], [5] * 9, [7, 8], list(range(20, 40))]
    spec = {"method": "paged", "num_speculative_tokens": 2, "policy": "all_drafts"}
    got = _generate(plugin, prompts, worker_mode=worker_mode, speculative_config=spec)
    assert got == [reference_tokens(p, 12, vocab=97)[0] for p in prompts]
    if worker_mode == "inproc":
        assert plugin.policy_calls and all(0 <= k <= max_k for max_k, k in plugin.policy_calls)
        assert any(k > 0 for _, k in plugin.policy_calls)
    assert plugin.drains, "the engine drains the strategy before it shuts down"


def test_the_plugin_imports_only_the_package_root() -> None:
    tree = ast.parse(textwrap.dedent(PLUGIN_SOURCE))
    imported = [
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    ]
    assert "pypto_serving" in imported
    assert all(m in ("__future__", "torch", "pypto_serving") for m in imported), imported


def test_the_plugin_type_checks_against_the_protocols(plugin_dir: Path) -> None:
    """``mypy --strict`` accepts the plugin, and rejects a strategy without ``drain`` and an old
    three-argument policy: the Protocols and descriptor types carry the contract."""
    pytest.importorskip("mypy", reason="mypy is not installed")
    # The project's settings and cache (gitignored): a cold cache spends a minute on torch's stubs.
    config = ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache")]
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", *config, *PLUGIN_FILES],
        cwd=plugin_dir,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if e.startswith("contract_plugin.py")], proc.stdout
    assert any("broken_plugin.py" in e and "NoDrain" in e and "StepStrategy" in e for e in errors), proc.stdout
    assert any("broken_plugin.py" in e and "submit" in e and "None" in e for e in errors), proc.stdout
    assert any("broken_plugin.py" in e and "SpecPolicySpec" in e and "[[Request, int], int]" in e for e in errors), (
        proc.stdout
    )


# -- hooks are called through pluggy


def _spec(name: str, arch: str = "FakeForCausalLM") -> ExecutorSpec:
    return ExecutorSpec(name=name, factory=make_fake_executor, architectures=(arch,))


class Early:
    @staticmethod
    @hookimpl(tryfirst=True)
    def pypto_serving_register_executors() -> list[ExecutorSpec]:
        return [_spec("early")]


class Late:
    @staticmethod
    @hookimpl
    def pypto_serving_register_executors() -> list[ExecutorSpec]:
        return [_spec("late"), _spec("hidden", "HiddenForCausalLM")]


class OldStyleFilter:
    """A ``hookwrapper``: sees each plugin's list and drops the descriptors named ``hidden``."""

    @staticmethod
    @hookimpl(hookwrapper=True)
    def pypto_serving_register_executors() -> Generator[None, pluggy.Result[list[list[ExecutorSpec]]], None]:
        outcome = yield
        outcome.force_result([[s for s in specs if s.name != "hidden"] for specs in outcome.get_result()])


class NewStyleFilter:
    """The same as a new-style ``wrapper``."""

    @staticmethod
    @hookimpl(wrapper=True)
    def pypto_serving_register_executors() -> Generator[None, list[list[ExecutorSpec]], list[list[ExecutorSpec]]]:
        results = yield
        return [[s for s in specs if s.name != "hidden"] for specs in results]


@pytest.mark.parametrize("wrapper", [OldStyleFilter, NewStyleFilter])
def test_register_hooks_honour_wrappers_and_tryfirst(wrapper: type) -> None:
    pm = PluginManager(load_entry_points=False, extra_plugins=[Early, Late, wrapper])
    assert list(pm.executors.specs) == ["early", "late"]  # tryfirst first; "hidden" filtered out
    assert pm.select_executor("auto", "FakeForCausalLM").name == "early"
    provides = {p.name: p.provides for p in pm.plugins}
    assert provides["Early"] == [("executor", "early")] and provides["Late"] == [("executor", "late")]
    assert provides[wrapper.__name__] == []


def test_register_hooks_run_last_registered_first() -> None:
    class First:
        @staticmethod
        @hookimpl
        def pypto_serving_register_executors() -> list[ExecutorSpec]:
            return [_spec("first")]

    class Second:
        @staticmethod
        @hookimpl
        def pypto_serving_register_executors() -> list[ExecutorSpec]:
            return [_spec("second")]

    pm = PluginManager(load_entry_points=False, extra_plugins=[First, Second])
    assert pm.select_executor("auto", "FakeForCausalLM").name == "second"


def test_a_descriptor_of_the_wrong_kind_names_its_plugin() -> None:
    class Confused:
        @staticmethod
        @hookimpl
        def pypto_serving_register_schedulers() -> list[ExecutorSpec]:
            return [_spec("oops")]

    with pytest.raises(PluginError, match=r"plugin 'Confused' .* expected a SchedulerSpec"):
        PluginManager(load_entry_points=False, extra_plugins=[Confused])


# -- the core knows no plugin by name


def _builtin_plugin_names() -> set[str]:
    """Every name a built-in plugin declares: distribution, entry point, package and descriptor names."""
    names = {"sync", "async", "qwen", "deepseek_mtp"}
    for pyproject in ROOT.glob("plugins/*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        names.add(project["name"])
        for entry, target in project.get("entry-points", {}).get("pypto_serving", {}).items():
            names |= {entry, target.split(".")[0]}
    return names


def _code_strings(path: Path) -> Iterator[tuple[int, str]]:
    """String constants and identifiers of a module, leaving out docstrings (comments are not in the AST)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.alias):
            yield node.lineno, node.name


def test_core_code_names_no_builtin_plugin() -> None:
    """Short names that are also English words (``sync``, ``async``) count as a whole string or
    identifier; the distinctive ones (``qwen``, distribution and module names) anywhere as a word."""
    names = _builtin_plugin_names()
    words = sorted(n for n in names if n not in ("sync", "async"))
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")(?![\w-])")
    hits = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in sorted((ROOT / "core" / "pypto_serving").rglob("*.py"))
        for line, text in _code_strings(path)
        if text in names or pattern.search(text)
    ]
    assert not hits, "\n".join(hits)


# -- scheduler = "auto" picks by what is installed


def _strategies(*kinds: bool) -> type:
    """A plugin registering ``pipelined_a`` / ``plain_a`` (and a second of each, ``_b``) as asked."""

    class Strategies:
        @staticmethod
        @hookimpl
        def pypto_serving_register_schedulers() -> list[SchedulerSpec]:
            specs = []
            for pipelined in kinds:
                prefix = "pipelined" if pipelined else "plain"
                taken = sum(s.name.startswith(prefix) for s in specs)
                specs.append(SchedulerSpec(name=f"{prefix}_{'ab'[taken]}", factory=_never, pipelined=pipelined))
            return specs

    return Strategies


def _never(host: Any) -> Any:
    raise AssertionError("selection tests never build a strategy")


@pytest.mark.parametrize(
    ("installed", "async_scheduling", "executor_pipelines", "expected"),
    [
        # only a non-pipelined strategy
        ((False,), None, True, "plain_a"),
        ((False,), None, False, "plain_a"),
        ((False,), False, True, "plain_a"),
        ((False,), True, True, "async_scheduling=True asks for a pipelined strategy and none is installed"),
        # only a pipelined strategy
        ((True,), None, True, "pipelined_a"),
        ((True,), True, True, "pipelined_a"),
        ((True,), None, False, "the executor cannot pipeline: it needs a non-pipelined strategy"),
        ((True,), False, True, "async_scheduling=False asks for a non-pipelined strategy"),
        # both kinds, two of each: the first by name
        ((True, False, True, False), None, True, "pipelined_a"),
        ((False, True, False, True), None, False, "plain_a"),
        ((True, False), False, True, "plain_a"),
        ((True, False), True, False, "pipelined_a"),  # then refused by the engine: the executor cannot
    ],
)
def test_auto_picks_by_what_is_installed(
    installed: tuple[bool, ...], async_scheduling: bool | None, executor_pipelines: bool, expected: str
) -> None:
    pm = PluginManager(load_entry_points=False, extra_plugins=[_strategies(*installed)])
    select = lambda: pm.select_scheduler(  # noqa: E731
        "auto", pipelined=async_scheduling, executor_pipelines=executor_pipelines
    )
    if " " not in expected:
        assert select().name == expected
        return
    with pytest.raises(PluginError) as e:
        select()
    assert expected in str(e.value)
    assert "installed schedulers: " in str(e.value)


def test_auto_without_any_strategy() -> None:
    pm = PluginManager(load_entry_points=False, extra_plugins=[FakePlugin])
    with pytest.raises(PluginError, match="no scheduling strategy is installed"):
        pm.select_scheduler("auto")


def test_a_named_strategy_must_agree_with_async_scheduling() -> None:
    pm = PluginManager(load_entry_points=False, extra_plugins=[_strategies(True, False)])
    assert pm.select_scheduler("plain_a", pipelined=False).name == "plain_a"
    with pytest.raises(SettingsError, match=r"scheduler='plain_a' does not pipeline steps, which contradicts"):
        pm.select_scheduler("plain_a", pipelined=True)
    with pytest.raises(SettingsError, match=r"scheduler='pipelined_a' pipelines steps, which contradicts"):
        pm.select_scheduler("pipelined_a", pipelined=False)


# -- the KV planner refuses absurd block counts


def test_kv_planner_refuses_absurd_block_counts() -> None:
    tiny = [CacheGroupSpec("kv", 16, bytes_per_block=1)]
    with pytest.raises(SettingsError) as e:
        plan_kv_blocks(tiny, None, 512 * 1024**2)
    msg = str(e.value)
    assert "KV cache group 'kv' would get 536,870,912 blocks" in msg
    assert "bytes_per_block=1" in msg and "kv_cache_memory" in msg and "num_kv_blocks" in msg
    assert f"{MAX_KV_BLOCKS_PER_GROUP:,}" in msg
    with pytest.raises(SettingsError, match=r"num_kv_blocks=1048577 asks for that.*lower num_kv_blocks"):
        plan_kv_blocks(tiny, MAX_KV_BLOCKS_PER_GROUP + 1, 1)
    assert plan_kv_blocks(tiny, MAX_KV_BLOCKS_PER_GROUP, 1) == {"kv": MAX_KV_BLOCKS_PER_GROUP}
    assert plan_kv_blocks(tiny, None, MAX_KV_BLOCKS_PER_GROUP) == {"kv": MAX_KV_BLOCKS_PER_GROUP}


def test_kv_planner_refusal_stops_the_engine_start(plugin: ModuleType) -> None:
    pm = PluginManager(load_entry_points=False, extra_plugins=[plugin])
    with pytest.raises(SettingsError, match="KV cache group 'kv' would get"):
        LLM(plugins=pm, executor="paged_counting", worker_mode="inproc", kv_cache_memory=1 << 42)


# -- ExecutorInfo stays what the executor reported


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize(
    ("options", "spec", "depth"),
    [
        ({"verify_drafts": True}, {"method": "ngram", "num_speculative_tokens": 3}, 3),  # the core drafts
        ({"max_draft": 2}, None, 0),  # the executor could draft; speculation is off
    ],
)
def test_the_engine_keeps_executor_info_as_reported(
    fake_pm: PluginManager, options: dict[str, Any], spec: dict[str, Any] | None, depth: int
) -> None:
    """``ExecutorInfo.max_draft_tokens`` is what the executor says it drafts; the depth in effect is
    the engine's own. In-process, ``engine.info`` is the executor's own object, which the worker's
    runner reads too."""
    llm = LLM(
        plugins=fake_pm,
        executor="fake",
        worker_mode="inproc",
        scheduler="sync",
        executor_options=options,
        speculative_config=spec,
    )
    try:
        assert llm.engine is not None
        assert llm.engine.info.max_draft_tokens == options.get("max_draft", 0)
        assert llm.engine.max_draft_tokens == depth
    finally:
        llm.shutdown()
