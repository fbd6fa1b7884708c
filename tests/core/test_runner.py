"""The worker-side runner against the contract: where and as what it hands the executor its batch, and
the typed sampling parameters it receives."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from pypto_serving import BatchInput, CacheGroupSpec, Executor, ExecutorInfo, SamplingParams, ServingSettings
from pypto_serving.messages import NewRequestData, ScheduledEntry, StepCommand, wire_sampling
from pypto_serving.request import StructuredSpec
from pypto_serving.runner import ModelRunner

VOCAB = 11
GROUPS = [CacheGroupSpec("kv", 4, bytes_per_block=64), CacheGroupSpec("compressed", 2, 64, tokens_per_entry=4)]


class RecordingExecutor(Executor):
    """Keeps each batch and returns flat logits on the CPU; its device is ``meta``, which holds no data,
    so only the runner's own placement can put the batch there."""

    def __init__(self, set_device: bool = True, device: str = "meta") -> None:
        self.set_device, self.device_name = set_device, device
        self.batches: list[BatchInput] = []

    def load(self) -> ExecutorInfo:
        if self.set_device:
            self.device = torch.device(self.device_name)
        return ExecutorInfo(cache_groups=GROUPS, vocab_size=VOCAB, max_model_len=64)

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        pass

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.batches.append(batch)
        return torch.zeros(len(batch.logits_indices), VOCAB)


def _settings() -> Any:
    return ServingSettings.load(executor="fake", block_size=4, executor_options={})


def _new(rid: str, prompt: list[int]) -> NewRequestData:
    return NewRequestData(
        request_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=[],
        sampling=wire_sampling(SamplingParams(temperature=0.0), ()),
        seed=0,
    )


def _entry(rid: str, tokens: list[int], blocks: dict[str, list[int]]) -> ScheduledEntry:
    return ScheduledEntry(
        request_id=rid,
        token_ids=tokens,
        use_last_sampled=False,
        num_draft=0,
        start_pos=0,
        rejected_seen=0,
        new_block_ids=blocks,
        sample=True,
    )


def test_the_batch_lies_on_the_executors_device_as_documented() -> None:
    ex = RecordingExecutor()
    runner = ModelRunner(ex, _settings())
    runner.load()
    cmd = StepCommand(
        step_id=0,
        new_requests=[_new("a", [1, 2, 3, 4, 5]), _new("b", [6])],
        entries=[_entry("a", [1, 2, 3, 4, 5], {"kv": [3, 1], "compressed": [0]}), _entry("b", [6], {"kv": [2]})],
        finished_ids=[],
    )
    result = runner.step(cmd)
    assert result.error is None, result.error
    (batch,) = ex.batches
    int64, int32 = torch.int64, torch.int32
    expected = {
        "input_ids": (batch.input_ids, int64, (6,)),
        "positions": (batch.positions, int64, (6,)),
        "query_start_loc": (batch.query_start_loc, int32, (3,)),
        "seq_lens": (batch.seq_lens, int32, (2,)),
        "logits_indices": (batch.logits_indices, int64, (2,)),
        "block_tables[kv]": (batch.block_tables["kv"], int32, (2, 2)),
        "block_tables[compressed]": (batch.block_tables["compressed"], int32, (2, 1)),
        "slot_mapping[kv]": (batch.slot_mapping["kv"], int64, (6,)),
    }
    for name, (tensor, dtype, shape) in expected.items():
        assert (tensor.device.type, tensor.dtype, tuple(tensor.shape)) == ("meta", dtype, shape), name
    # Only groups whose entries are single tokens get a slot per token.
    assert set(batch.slot_mapping) == {"kv"}
    assert batch.request_ids == ["a", "b"] and batch.num_logits == [1, 1]
    # The host copies agree with what the tensors hold (the tensors are on "meta", so from the step).
    assert batch.query_start_loc_host == [0, 5, 6] and batch.seq_lens_host == [5, 1]
    assert batch.input_ids_host == [1, 2, 3, 4, 5, 6]
    assert batch.loras is None  # no request names a LoRA adapter
    assert batch.greedy_maxima  # greedy requests: the executor may take the logits rows' maxima
    assert batch.maxima_only  # and nothing else of their logits is read
    assert batch.prompt_rows == [5, 1]  # two prompts
    host = {
        "request_ids",
        "num_logits",
        "query_start_loc_host",
        "seq_lens_host",
        "input_ids_host",
        "draft_depth",
        "num_drafts",
        "loras",
        "greedy_maxima",
        "maxima_only",
        "interrupt",  # a count in host memory, set on greedy loops' batches only
        "prompt_rows",
    }
    assert batch.interrupt is None
    assert set(BatchInput.__dataclass_fields__) == {*(f.split("[")[0] for f in expected), *host}


def test_an_executor_that_sets_no_device_is_refused_at_load() -> None:
    runner = ModelRunner(RecordingExecutor(set_device=False), _settings())
    with pytest.raises(TypeError, match=r"RecordingExecutor\.load\(\) must set self\.device"):
        runner.load()


def test_sampling_crosses_the_pipe_as_a_typed_struct() -> None:
    sp = SamplingParams(temperature=0.5, repetition_penalty=1.1, min_tokens=3, stop_token_ids=[5], logprobs=2)
    wire = wire_sampling(sp, (2, 9))
    assert wire.has_penalties is sp.has_penalties is True
    assert wire.min_tokens_banned == (5, 2, 9) and wire.min_tokens == 3 and wire.logprobs == 2
    assert wire_sampling(SamplingParams(stop_token_ids=[5], ignore_eos=True), (2,)).min_tokens_banned == (5,)
    assert not wire_sampling(SamplingParams(), ()).has_penalties
    new = NewRequestData(request_id="r", prompt_token_ids=[1], output_token_ids=[], sampling=wire, seed=7)
    data = msgspec.msgpack.encode(new)
    assert msgspec.msgpack.decode(data, type=NewRequestData) == new
    # The decoder checks every field's type: a malformed message fails at the boundary, not in the sampler.
    raw = msgspec.msgpack.decode(data)
    raw["sampling"]["temperature"] = "hot"
    with pytest.raises(msgspec.ValidationError, match=r"sampling\.temperature"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=NewRequestData)


def test_the_wire_struct_is_sampling_params_copied_by_name() -> None:
    """One struct from the API to the sampler: every wire field but the derived ones is the
    SamplingParams field of the same name, copied with its value (a field set to a non-default value
    arrives set); the sampler's row and the drafter's row take every field they share with it by
    name, so a knob added to SamplingParams and the sampler reaches the sampler by adding it to the
    wire struct alone."""
    from dataclasses import fields

    from pypto_serving.messages import COPIED, DERIVED, WireSampling
    from pypto_serving.runner import _DRAFT_KNOBS, _ROW_KNOBS
    from pypto_serving.sampler import RowParams
    from pypto_serving.spec_decode import DraftRow

    api = {f.name for f in fields(SamplingParams)}
    assert set(COPIED) <= api and set(COPIED) | set(DERIVED) == set(WireSampling.__struct_fields__)
    assert not set(DERIVED) & api
    values: dict[str, Any] = {
        "temperature": 0.5,
        "top_k": 3,
        "top_p": 0.9,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "logprobs": 4,
        "structured": StructuredSpec(kind="regex", source="a+"),
        "logit_bias": {7: 1.5},
        "allowed_token_ids": [1, 7],
        "bad_words_token_ids": [[1, 2], [3]],
        "prompt_logprobs": 1,
        "max_tokens": 9,
        "lora": "adapter",
    }
    assert set(values) == set(COPIED)  # a new copied field needs a value here
    wire = wire_sampling(SamplingParams(**values), (2,))
    frozen = {"logit_bias": ((7, 1.5),), "allowed_token_ids": (1, 7), "bad_words_token_ids": ((1, 2), (3,))}
    assert {n: getattr(wire, n) for n in COPIED} == values | frozen
    assert set(_ROW_KNOBS) == {f.name for f in fields(RowParams)} & set(WireSampling.__struct_fields__)
    assert {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"} <= set(_ROW_KNOBS)
    assert (
        set(_DRAFT_KNOBS)
        == {"temperature", "top_k", "top_p", "min_p"}
        == {f.name for f in fields(DraftRow)}
        - {
            "seed",
            "first_index",
        }
    )


class CpuExecutor(RecordingExecutor):
    """A recording executor on the CPU, so the test reads the values the runner built."""

    def load(self) -> ExecutorInfo:
        info = super().load()
        self.device = torch.device("cpu")
        return info


def _decode(rid: str, start: int, blocks: dict[str, list[int]], sample: bool = True) -> ScheduledEntry:
    return ScheduledEntry(
        request_id=rid,
        token_ids=[],
        use_last_sampled=True,
        num_draft=0,
        start_pos=start,
        rejected_seen=0,
        new_block_ids=blocks,
        sample=sample,
    )


def test_the_batch_values_follow_the_rows_across_removals() -> None:
    """Hand-computed tensors of steps whose requests leave (a row moves into the hole), enter and
    take blocks between steps; a non-sampling prefill chunk takes no logits row."""
    ex = CpuExecutor()
    runner = ModelRunner(ex, _settings())
    runner.load()
    new = [_new("a", [1, 2, 3]), _new("b", [4, 5]), _new("c", [6, 7, 8, 9, 10])]
    first = [
        _entry("a", [1, 2, 3], {"kv": [5]}),
        _entry("b", [4, 5], {"kv": [6]}),
        _entry("c", [6, 7, 8, 9, 10], {"kv": [7, 8], "compressed": [2]}),
    ]
    assert runner.step(StepCommand(0, new, first, [])).error is None
    assert ex.batches[-1].prompt_rows == [3, 2, 5]  # every row a prompt token
    # "a" leaves: "c" moves into its row. "d" enters and prefills 3 of its tokens without sampling.
    d_chunk = ScheduledEntry(
        request_id="d",
        token_ids=[1, 1, 1],
        use_last_sampled=False,
        num_draft=0,
        start_pos=0,
        rejected_seen=0,
        new_block_ids={"kv": [9]},
        sample=False,
    )
    entries = [_decode("c", 5, {"kv": [11]}), d_chunk, _decode("b", 2, {})]
    assert runner.step(StepCommand(1, [_new("d", [1, 1, 1, 1])], entries, ["a"])).error is None
    batch = ex.batches[-1]
    assert runner.input_batch.request_ids == ["c", "b", "d"]
    assert batch.request_ids == ["c", "d", "b"] and batch.num_logits == [1, 0, 1]
    assert batch.prompt_rows == [0, 3, 0]  # decode rows are no prompt tokens
    assert batch.input_ids_host == batch.input_ids.tolist() == [0, 1, 1, 1, 0]  # zero logits sample token 0
    assert batch.positions.tolist() == [5, 0, 1, 2, 2]
    assert batch.query_start_loc.tolist() == batch.query_start_loc_host == [0, 1, 4, 5]
    assert batch.seq_lens.tolist() == batch.seq_lens_host == [6, 3, 3]
    assert batch.logits_indices.tolist() == [0, 4]
    assert batch.block_tables["kv"].tolist() == [[7, 8, 11], [9, 0, 0], [6, 0, 0]]
    assert batch.block_tables["compressed"].tolist() == [[2], [0], [0]]
    # slot = block * 4 + position % 4 in the kv group (block size 4).
    assert batch.slot_mapping["kv"].tolist() == [8 * 4 + 1, 9 * 4, 9 * 4 + 1, 9 * 4 + 2, 6 * 4 + 2]


def test_prompt_rows_count_the_prompt_tokens_of_a_recomputation_and_none_of_the_drafts() -> None:
    """``BatchInput.prompt_rows``: a preempted request computed again (its prompt and its outputs in
    one run) counts its prompt's rows only; a run that starts past the prompt, none."""
    ex = CpuExecutor()
    runner = ModelRunner(ex, _settings())
    runner.load()
    resumed = NewRequestData(
        request_id="e",
        prompt_token_ids=[2, 2, 2],
        output_token_ids=[3, 3],
        sampling=wire_sampling(SamplingParams(temperature=0.0), ()),
        seed=0,
    )
    again = _entry("e", [2, 2, 2, 3], {"kv": [5]})  # its last output is the next step's input
    assert (
        runner.step(StepCommand(0, [resumed, _new("f", [4, 5])], [again, _entry("f", [4], {"kv": [6]})], [])).error
        is None
    )
    assert ex.batches[-1].prompt_rows == [3, 1]
    rest = ScheduledEntry(
        request_id="f",
        token_ids=[5],
        use_last_sampled=False,
        num_draft=0,
        start_pos=1,
        rejected_seen=0,
        new_block_ids={},
        sample=True,
    )
    assert runner.step(StepCommand(1, [], [_decode("e", 4, {"kv": [7]}), rest], [])).error is None
    assert ex.batches[-1].prompt_rows == [0, 1]


def test_a_decode_step_lays_out_one_token_a_row() -> None:
    """A step whose every entry is one sampled token takes the layout without per-entry expansion
    (``StepArrays.one_token_each``); its hand-computed tensors are those of the general layout."""
    ex = CpuExecutor()
    runner = ModelRunner(ex, _settings())
    runner.load()
    taken: list[bool] = []
    prepare = runner.input_batch.prepare
    runner.input_batch.prepare = lambda step: (taken.append(step.one_token_each), prepare(step))[1]  # type: ignore[method-assign]
    new = [_new("a", [1, 2, 3]), _new("b", [4, 5])]
    first = [_entry("a", [1, 2, 3], {"kv": [5]}), _entry("b", [4, 5], {"kv": [6]})]
    assert runner.step(StepCommand(0, new, first, [])).error is None
    entries = [_decode("b", 2, {}), _decode("a", 3, {"kv": [7]})]
    assert runner.step(StepCommand(1, [], entries, [])).error is None
    assert taken == [False, True]
    batch = ex.batches[-1]
    assert batch.positions.tolist() == [2, 3]
    assert batch.query_start_loc.tolist() == batch.query_start_loc_host == [0, 1, 2]
    assert batch.seq_lens.tolist() == batch.seq_lens_host == [3, 4]
    assert batch.logits_indices.tolist() == [0, 1]
    assert batch.block_tables["kv"].tolist() == [[6, 0], [5, 7]]
    assert batch.slot_mapping["kv"].tolist() == [6 * 4 + 2, 5 * 4 + 3]


@pytest.mark.parametrize(
    ("history", "drafts", "expected"),
    [
        ([9, 9, 1, 2], [], (5, 7, 8)),  # outputs [1, 2]: (2, 7) and (1, 2, 8) complete; 9 is prompt, not output
        ([9, 9, 1, 2], [3], (5, 6)),  # a draft extends the outputs: (2, 3, 6) completes
        ([9, 9], [], (5,)),  # no outputs yet: only the one-token word
        ([9, 9, 1], [2, 3], (5, 6)),  # the word's prefix spans the outputs and the drafts
    ],
)
def test_bad_word_bans_follow_outputs_and_drafts(
    history: list[int], drafts: list[int], expected: tuple[int, ...]
) -> None:
    from pypto_serving.runner import _bad_word_bans

    words = ((5,), (2, 7), (1, 2, 8), (9, 1, 4), (2, 3, 6))
    assert _bad_word_bans(words, history, 2, drafts) == expected


def test_logit_rows_put_prompt_rows_before_sampled_rows() -> None:
    import numpy as np

    from pypto_serving.input_batch import _logit_rows

    qsl = np.array([0, 5, 6, 10])  # entries of 5, 1 and 4 rows
    assert _logit_rows(qsl, np.array([1, 1, 2]), None).tolist() == [4, 5, 8, 9]
    # Entry 0 scores its first 4 rows and samples its last; entry 2 scores 2 rows and samples nothing.
    rows = _logit_rows(qsl, np.array([1, 1, 0]), np.array([4, 0, 2]))
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    ("device", "cores", "threads", "overlap"),
    [("meta", 2, 2, True), ("cpu", 2, 2, False), ("cpu", 16, 8, True), ("cpu", 4, 4, False)],
)
def test_grammar_masks_fill_beside_the_forward_when_it_leaves_a_core_free(
    monkeypatch: pytest.MonkeyPatch, device: str, cores: int, threads: int, overlap: bool
) -> None:
    """By default the mask fill gets its own thread when the forward runs off the CPU or on fewer
    intra-op threads than there are cores; a forward on every core would share them with it."""
    runner = ModelRunner(RecordingExecutor(), _settings())
    runner.load()
    runner.device = torch.device(device)
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert runner._overlap_masks() is overlap
    runner.overlap_grammar_masks = not overlap  # the setting wins over the default
    assert runner._overlap_masks() is not overlap


@pytest.mark.parametrize("with_maxima", [False, True])
def test_a_launched_step_reads_nothing_back_until_it_finishes(
    with_maxima: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every tensor on a fake CUDA device (no values: any host read raises), a step's first
    part runs the forward and the sampler's device work (with the executor's logits maxima, where it
    gives them, in place of the sampler's pass); the read is its second part's."""
    import pypto_serving.sampler as sampler
    from pypto_serving.runner import LaunchedStep
    from tests.plugins.qwen.fake_cuda import fake_cuda

    passes: list[int] = []
    argmax_rows = sampler.argmax_rows
    monkeypatch.setattr(sampler, "argmax_rows", lambda x: passes.append(x.shape[0]) or argmax_rows(x))

    class FakeCuda(RecordingExecutor):
        maxima: tuple[torch.Tensor, torch.Tensor] | None = None

        def execute(self, batch: BatchInput) -> torch.Tensor:
            self.batches.append(batch)
            n = len(batch.logits_indices)
            if with_maxima and batch.greedy_maxima:
                self.maxima = (torch.randn(n, device="cuda"), torch.zeros(n, dtype=torch.long, device="cuda"))
            return torch.randn(n, VOCAB, device="cuda")

        def logits_maxima(self) -> tuple[torch.Tensor, torch.Tensor] | None:
            return self.maxima

    cmd = StepCommand(
        step_id=0,
        new_requests=[_new("a", [1, 2, 3]), _new("b", [4])],
        entries=[_entry("a", [1, 2, 3], {"kv": [3]}), _entry("b", [4], {"kv": [2]})],
        finished_ids=[],
    )
    with fake_cuda():
        runner = ModelRunner(FakeCuda(device="cuda"), _settings())
        runner.load()
        run = runner.launch(cmd)
        assert isinstance(run, LaunchedStep) and run.result is None, run.result
        result = runner.finish(run)
    # The fake device holds no values: the read of the sampled tokens is what fails, in the second part.
    assert result.error is not None and result.error.startswith("DataDependentOutputException"), result.error
    assert passes == ([] if with_maxima else [2])  # the executor's maxima took the place of the pass


class MaximaExecutor(RecordingExecutor):
    """CPU logits whose argmax is token 3, and (where the batch asks) maxima naming token 7 at every
    row, or ``rows`` rows of them: a stand-in for an output projection that takes the maxima as it
    writes the logits, made to disagree with the logits so the test sees whose tokens come out."""

    def __init__(self, rows: int | None = None, unwritten: bool = False) -> None:
        super().__init__(device="cpu")
        self.rows = rows
        self.unwritten = unwritten  # return [N, 0] logits where the step reads only the maxima
        self.maxima: tuple[torch.Tensor, torch.Tensor] | None = None

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.batches.append(batch)
        n = len(batch.logits_indices)
        logits = torch.zeros(n, VOCAB)
        logits[:, 3] = 1.0
        rows = n if self.rows is None else self.rows
        self.maxima = (torch.ones(rows), torch.full((rows,), 7)) if batch.greedy_maxima else None
        return logits[:, :0] if self.unwritten and n else logits

    def logits_maxima(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.maxima


def _request(rid: str, prompt: list[int], **sampling: Any) -> NewRequestData:
    return NewRequestData(
        request_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=[],
        sampling=wire_sampling(SamplingParams(**sampling), ()),
        seed=0,
    )


def test_greedy_rows_take_the_executors_maxima() -> None:
    """A step with a greedy request asks for the logits rows' maxima (``BatchInput.greedy_maxima``)
    and its greedy rows take the executor's index instead of a pass over the logits; a step of
    sampled requests only, or with prompt logprobs, does not ask; maxima of the wrong size fail the
    step with the executor named."""
    ex = MaximaExecutor()
    runner = ModelRunner(ex, _settings())
    runner.load()
    requests = [
        _request("a", [1, 2], temperature=0.0),
        _request("b", [3], temperature=1.0),
        _request("c", [4], temperature=1.0),
        _request("d", [5, 6], temperature=0.0, prompt_logprobs=1),
    ]
    entries = [_entry("a", [1, 2], {"kv": [1]}), _entry("b", [3], {"kv": [2]})]
    result = runner.step(StepCommand(step_id=0, new_requests=requests[:2], entries=entries, finished_ids=[]))
    assert result.error is None and ex.batches[-1].greedy_maxima
    assert result.sampled["a"] == [7]  # the executor's index, not the logits' argmax (3)
    result = runner.step(
        StepCommand(step_id=1, new_requests=requests[2:3], entries=[_entry("c", [4], {"kv": [3]})], finished_ids=[])
    )
    assert result.error is None and not ex.batches[-1].greedy_maxima  # nothing greedy: not asked
    result = runner.step(
        StepCommand(step_id=2, new_requests=requests[3:], entries=[_entry("d", [5, 6], {"kv": [4]})], finished_ids=[])
    )
    assert result.error is None and not ex.batches[-1].greedy_maxima  # prompt logprobs: rows beside the sampled
    assert result.sampled["d"] == [3]
    assert not any(b.maxima_only for b in ex.batches[1:])  # sampled rows, prompt logprobs: logits read
    bad = MaximaExecutor(rows=5)
    runner = ModelRunner(bad, _settings())
    runner.load()
    result = runner.step(StepCommand(step_id=0, new_requests=requests[:1], entries=entries[:1], finished_ids=[]))
    assert result.error is not None and "MaximaExecutor.logits_maxima gave [(5,), (5,)] for 1 rows" in result.error


class PlantedMaxima(MaximaExecutor):
    """Maxima of 1, NaN and +inf naming tokens 7, 8 and 9 (three greedy rows)."""

    def execute(self, batch: BatchInput) -> torch.Tensor:
        logits = super().execute(batch)
        self.maxima = (torch.tensor([1.0, float("nan"), float("inf")]), torch.tensor([7, 8, 9]))
        return logits


def test_a_cpu_greedy_step_reads_the_maxima_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """All-greedy rows on the CPU take the executor's maxima from host memory with no device sample
    (``host_greedy_reads``); the tokens and the non-finite rows' errors are those of the device
    sample's path, and a step with a sampled row beside still takes that path."""
    import pypto_serving.runner as runner_mod

    calls: list[int] = []
    device_sample = runner_mod.sample_on_device
    monkeypatch.setattr(runner_mod, "sample_on_device", lambda *a, **k: calls.append(1) or device_sample(*a, **k))
    requests = [_request(rid, [i + 1], temperature=0.0) for i, rid in enumerate("abc")]
    entries = [_entry(rid, [i + 1], {"kv": [i + 1]}) for i, rid in enumerate("abc")]
    results = []
    for host in (True, False):
        runner = ModelRunner(PlantedMaxima(), _settings())
        runner.load()
        runner.host_greedy_reads = host
        calls.clear()
        results.append(runner.step(StepCommand(step_id=0, new_requests=requests, entries=entries, finished_ids=[])))
        assert calls == ([] if host else [1])
    host_result, device_result = results
    assert host_result.sampled == device_result.sampled == {"a": [7]}
    assert host_result.request_errors == device_result.request_errors
    assert set(host_result.request_errors) == {"b", "c"}
    runner = ModelRunner(MaximaExecutor(), _settings())
    runner.load()
    mixed = [_request("a", [1], temperature=0.0), _request("b", [2], temperature=1.0)]
    calls.clear()
    result = runner.step(StepCommand(step_id=0, new_requests=mixed, entries=entries[:2], finished_ids=[]))
    assert result.error is None and result.sampled["a"] == [7] and calls == [1]


def test_a_step_that_reads_only_the_maxima_takes_logits_of_no_columns() -> None:
    """Greedy rows with nothing else to read (``BatchInput.maxima_only``) sample from the executor's
    maxima though it returns ``[N, 0]`` logits; a step that reads its logits (a sampled row beside)
    fails with the executor named where it gets none."""
    ex = MaximaExecutor(unwritten=True)
    runner = ModelRunner(ex, _settings())
    runner.load()
    requests = [_request("a", [1, 2], temperature=0.0), _request("b", [3], temperature=1.0)]
    entries = [_entry("a", [1, 2], {"kv": [1]}), _entry("b", [3], {"kv": [2]})]
    result = runner.step(StepCommand(step_id=0, new_requests=requests[:1], entries=entries[:1], finished_ids=[]))
    assert result.error is None and ex.batches[-1].maxima_only and result.sampled["a"] == [7]
    result = runner.step(StepCommand(step_id=1, new_requests=requests[1:], entries=entries[1:], finished_ids=[]))
    assert not ex.batches[-1].maxima_only
    assert result.error is not None and "MaximaExecutor.execute returned logits of no columns" in result.error
