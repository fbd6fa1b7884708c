"""Structured output's grammar masks (core/pypto_serving/structured.py) against brute force on a tiny
byte-level vocabulary: a token may be allowed only when the text so far plus the token's text is a
prefix of a string of the (finite) language, and EOS exactly when the text so far is in it. Where the
grammar forces the next bytes llguidance allows only their canonical tokens, so the mask may be a
strict subset of the brute-force set there, but never empty while the language goes on."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pypto_serving.request import StructuredSpec
from pypto_serving.sampler import RowParams
from pypto_serving.structured import (
    GrammarCompiler,
    apply_bitmask,
    bitmask_words,
    check_spec,
)
from tests.core.server.server_helpers import write_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("structured_tok")
    write_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def token_text(tok_dir: Path) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return [tok.decode([t]) for t in range(VOCAB)]


EOS = 2  # <|im_end|>: the specials are ids 0..2


def _allowed(grammar: object, drafts: list[int] = ()) -> list[set[int]]:  # type: ignore[assignment]
    out = np.zeros((len(drafts) + 1, bitmask_words(VOCAB)), dtype=np.int32)
    grammar.fill(list(drafts), out)  # type: ignore[attr-defined]
    bits = np.unpackbits(out.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
    return [set(np.nonzero(row)[0].tolist()) for row in bits]


def _brute(language: set[str], text: str, token_text: list[str]) -> set[int]:
    special = set(range(3))
    ok = {t for t in range(VOCAB) if t not in special and any(s.startswith(text + token_text[t]) for s in language)}
    return ok | ({EOS} if text in language else set())


def _walk(spec: StructuredSpec, language: set[str], tok_dir: Path, token_text: list[str], seed: int) -> None:
    """Random walks through the grammar: every step's mask equals the brute-force set."""
    rng = random.Random(seed)
    compiler = GrammarCompiler(tok_dir)
    exact = steps = 0
    for _ in range(6):
        grammar = compiler.matcher(spec, (EOS,))
        text = ""
        while True:
            allowed = _allowed(grammar)[0]
            brute = _brute(language, text, token_text)
            assert allowed <= brute, text
            assert (EOS in allowed) == (EOS in brute), text
            assert (allowed - {EOS}) or not (brute - {EOS}), text
            exact += allowed == brute
            steps += 1
            token = rng.choice(sorted(allowed))
            if token == EOS:
                assert text in language
                break
            grammar.advance([token])
            text += token_text[token]
        assert grammar.error is None
    assert exact >= steps // 2, (exact, steps)  # the brute-force set itself, wherever nothing is forced


def test_choice_mask_matches_brute_force(tok_dir: Path, token_text: list[str]) -> None:
    choices = ["the cat", "the dog", 'a "quoted" one', "one two three", "o"]
    _walk(StructuredSpec("choice", json.dumps(choices)), set(choices), tok_dir, token_text, seed=1)


def test_regex_mask_matches_brute_force(tok_dir: Path, token_text: list[str]) -> None:
    language = {"".join(p) + end for n in (1, 2) for p in itertools.product("ab", repeat=n) for end in ("c", "dd")}
    _walk(StructuredSpec("regex", "[ab]{1,2}(c|dd)"), language, tok_dir, token_text, seed=2)


def test_draft_rows_follow_the_drafts_and_roll_back(tok_dir: Path, token_text: list[str]) -> None:
    """Row j of a drafted fill is the mask after drafts[:j]; the matcher is unchanged afterwards; rows
    past a draft the grammar refuses allow everything (they are always discarded)."""
    compiler = GrammarCompiler(tok_dir)
    spec = StructuredSpec("regex", "abcabc")
    ids = [token_text.index(c) for c in "abc"]
    grammar = compiler.matcher(spec, (EOS,))
    rows = _allowed(grammar, [ids[0], ids[1], 0, ids[2]])  # 0: a special token the grammar refuses
    reference = compiler.matcher(spec, (EOS,))
    for j in range(3):
        assert rows[j] == _allowed(reference)[0]
        if j < 2:
            reference.advance([ids[j]])
    assert rows[3] == rows[4] == set(range(VOCAB))
    assert _allowed(grammar)[0] == _brute({"abcabc"}, "", token_text)  # rolled back


@pytest.mark.parametrize("min_tokens", [0, 3, 5])
def test_min_tokens_holds_eos_back_only_while_the_grammar_goes_on(tok_dir: Path, min_tokens: int) -> None:
    """Before ``min_tokens`` outputs a row allows what the grammar allows minus EOS, unless EOS is all
    it allows (the grammar is complete: it ends there); from then on it is the grammar's mask. Drafted
    rows count their drafts: row j draws output ``accepted + j``."""
    compiler = GrammarCompiler(tok_dir)
    spec = StructuredSpec("regex", "ab(ab)?(ab)?")
    held, plain = compiler.matcher(spec, (EOS,), min_tokens), compiler.matcher(spec, (EOS,))
    path: list[int] = []
    wants: list[set[int]] = []
    changed = 0  # rows the hold changes: the grammar allows EOS and more before min_tokens
    for _ in range(20):
        want = _allowed(plain)[0]
        if len(path) < min_tokens and want != {EOS}:
            changed += EOS in want
            want = want - {EOS}
        assert _allowed(held)[0] == want, path
        wants.append(want)
        if want == {EOS}:
            break
        token = min(want - {EOS})  # the lowest id: single bytes, the longest walk (past min_tokens)
        path.append(token)
        held.advance([token])
        plain.advance([token])
    assert wants[-1] == {EOS} and len(path) >= 6
    assert changed == (min_tokens > 2) + (min_tokens > 4)  # after "ab" and "abab"
    drafted = compiler.matcher(spec, (EOS,), min_tokens)
    assert _allowed(drafted, path) == wants
    drafted.advance(path[:2])
    assert _allowed(drafted, path[2:]) == wants[2:]


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "m"
    model.mkdir()
    write_tokenizer(model, VOCAB)
    (model / "config.json").write_text('{"architectures": ["FakeForCausalLM"]}')
    return model


CLOSED = {"type": "object", "required": ["n"], "additionalProperties": False}
GRAMMARS = [
    (StructuredSpec("choice", json.dumps(["yes", "yes and", "yes and no"])), "yes and no"),
    (StructuredSpec("regex", "[a-c]{2}( [a-c]{2}){0,3}"), None),
    (StructuredSpec("json", json.dumps({"properties": {"n": {"enum": [1, 22]}}, **CLOSED})), None),
]


def _check_ends_at_the_grammar(outs: list[Any], spec: StructuredSpec, longest: str | None) -> None:
    """Each output ends at its grammar's end, once: one EOS, last, and text the grammar accepts."""
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.token_ids)
            assert c.token_ids[-1] == EOS and c.token_ids.count(EOS) == 1, c.token_ids  # no EOS padding
            if spec.kind == "json":
                assert json.loads(c.text)["n"] in (1, 22), c.text
            elif spec.kind == "regex":
                assert re.fullmatch(spec.source, c.text), c.text
            else:
                assert c.text in json.loads(spec.source)
            if longest is not None:  # EOS was held back wherever the choice could go on
                assert c.text == longest


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize("scheduler", ["sync", "async"])
@pytest.mark.parametrize(("spec", "longest"), GRAMMARS)
def test_min_tokens_under_a_grammar_ends_where_the_grammar_does(
    make_llm: Any, tmp_path: Path, spec: StructuredSpec, longest: str | None, scheduler: str
) -> None:
    """``min_tokens`` past the grammar's length: the output goes on while the grammar allows anything
    but EOS, then ends (finish_reason "stop") at the grammar's end, short of min_tokens, never padded
    with EOS; greedy and sampled, and with a step in flight when the grammar ends (async)."""
    from pypto_serving import SamplingParams

    if scheduler == "async":
        pytest.importorskip("pypto_serving_async_sched")
    options = {"vocab": VOCAB, "eos": EOS}
    llm = make_llm(model=str(_model_dir(tmp_path)), executor_options=options, scheduler=scheduler)
    params = [
        SamplingParams(temperature=0, min_tokens=40, max_tokens=48, structured=spec),
        SamplingParams(temperature=1.0, seed=5, n=4, min_tokens=40, max_tokens=48, structured=spec),
    ]
    outs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    _check_ends_at_the_grammar(outs, spec, longest)
    # Without min_tokens the same grammar's outputs end as they please (the choice may stop short).
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=48, structured=spec), use_tqdm=False)
    _check_ends_at_the_grammar(free, spec, None)


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize(("spec", "longest"), GRAMMARS)
def test_ignore_eos_under_a_grammar_ends_where_the_grammar_does(
    make_llm: Any, tmp_path: Path, spec: StructuredSpec, longest: str | None
) -> None:
    """``ignore_eos`` does not run a constrained request on past its grammar's end: the grammar's EOS
    ends it (finish_reason "stop") instead of EOS tokens up to max_tokens."""
    from pypto_serving import SamplingParams

    llm = make_llm(model=str(_model_dir(tmp_path)), executor_options={"vocab": VOCAB, "eos": EOS})
    params = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=48, structured=spec),
        SamplingParams(temperature=1.0, seed=5, n=4, ignore_eos=True, max_tokens=48, structured=spec),
        SamplingParams(temperature=0, ignore_eos=True, min_tokens=40, max_tokens=48, structured=spec),
    ]
    outs = llm.generate([[5, 6, 7], [8, 9], [5, 6, 7]], params, use_tqdm=False)
    _check_ends_at_the_grammar(outs[:2], spec, None)
    _check_ends_at_the_grammar(outs[2:], spec, longest)


def test_json_schema_walk_validates(tok_dir: Path, token_text: list[str]) -> None:
    """Random walks under a JSON schema end (EOS) on a document that validates."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "c": {"enum": ["cat", "dog"]}},
        "required": ["n", "c"],
        "additionalProperties": False,
    }
    compiler = GrammarCompiler(tok_dir)
    rng = random.Random(3)
    for _ in range(10):
        grammar = compiler.matcher(StructuredSpec("json", json.dumps(schema)), (EOS,))
        text = ""
        for _ in range(200):
            token = rng.choice(sorted(_allowed(grammar)[0]))
            if token == EOS:
                break
            grammar.advance([token])
            text += token_text[token]
        jsonschema.validate(json.loads(text), schema)


def test_apply_bitmask_matches_a_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=gen)
    bits = torch.rand(2, 96, generator=gen) < 0.3  # 3 words: past vocab 70 is ignored
    words = (bits.view(2, 3, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    rows = torch.tensor([3, 1])
    out = apply_bitmask(logits, rows, bitmask)
    expected = logits.clone()
    for i, r in enumerate(rows.tolist()):
        expected[r][~bits[i, :70]] = float("-inf")
    assert torch.equal(out, expected)
    # A bitmask narrower than the logits disallows the tokens past it.
    narrow = apply_bitmask(logits, rows, bitmask[:, :1])
    assert torch.isinf(narrow[3, 32:]).all() and torch.isinf(narrow[1, 32:]).all()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredSpec("regex", "[a-"), "the regex is invalid"),
        (StructuredSpec("json", '{"type": "nope"}'), "the JSON schema is invalid"),
        (StructuredSpec("json", "{not json"), "the JSON schema is invalid"),
        (StructuredSpec("choice", "[]"), "the choice list is invalid"),
        (StructuredSpec("choice", '["a", ""]'), "the choice list is invalid"),
    ],
)
def test_bad_specs_are_value_errors(spec: StructuredSpec, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_spec(spec)


def test_missing_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        GrammarCompiler(tmp_path).matcher(StructuredSpec("json_object"), (EOS,))


def test_sampler_draws_only_allowed_tokens() -> None:
    """Constrained rows (greedy and sampled, with top-p) draw only allowed tokens, the greedy one the
    best allowed; unconstrained rows draw what they draw without a grammar."""
    from pypto_serving.sampler import RowParams, sample
    from pypto_serving.structured import GrammarMask

    gen = torch.Generator().manual_seed(1)
    vocab = 300
    for trial in range(20):
        logits = torch.randn(4, vocab, generator=gen) * 3
        allowed = torch.rand(2, vocab, generator=gen) < 0.05
        allowed[:, trial] = True  # never empty
        words = (torch.nn.functional.pad(allowed, (0, 20)).view(2, -1, 32).long() << torch.arange(32)).sum(-1)
        bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        mask = GrammarMask(rows=torch.tensor([0, 2]), bitmask=bitmask)
        params = [
            RowParams(temperature=0.0, seed=trial, draw_index=0),
            RowParams(temperature=1.0, seed=trial, draw_index=0),
            RowParams(temperature=1.0, seed=trial, draw_index=0, top_p=0.9),
            RowParams(temperature=0.7, seed=trial, draw_index=0, top_k=5),
        ]
        got = sample(logits, params, mask).tokens
        free = sample(logits, params).tokens
        best = torch.where(allowed[0], logits[0], float("-inf")).argmax().item()
        assert got[0] == best
        assert allowed[1, got[2]]
        assert (got[1], got[3]) == (free[1], free[3])


@pytest.mark.requires_plugin("sync_sched")
def test_the_offline_api_refuses_a_bad_grammar_at_add(fake_pm: object, tmp_path: Path) -> None:
    from pypto_serving import LLM, SamplingParams

    model = tmp_path / "m"
    model.mkdir()
    write_tokenizer(model)
    (model / "config.json").write_text('{"architectures": ["FakeForCausalLM"]}')
    llm = LLM(model=str(model), plugins=fake_pm, executor="fake", worker_mode="inproc", scheduler="sync")
    try:
        assert llm.engine is not None
        with pytest.raises(ValueError, match="the regex is invalid"):
            llm.engine.add_request("r", [1, 2], SamplingParams(structured=StructuredSpec("regex", "[a-")))
        assert not llm.engine.has_unfinished()
    finally:
        llm.shutdown()


def _pack(allowed: np.ndarray) -> np.ndarray:
    """``[R, V]`` bool -> the ``[R, W]`` int32 bitmask llguidance writes (bit ``t % 32`` of word ``t // 32``)."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, 32 * bitmask_words(vocab)), dtype=bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def test_sparse_rows_list_the_ids_of_rows_allowing_few_or_nearly_all_tokens() -> None:
    """Rows allowing 1 to 12 W tokens (W: bitmask words) are listed with their allowed ids, rows
    disallowing 1 to 12 W tokens of the tokenizer's with their disallowed ids; the others (none
    allowed, every token allowed, in between) stay with their bitmask."""
    from pypto_serving.structured import sparse_rows

    vocab = 310  # W = 10 (320 bits): up to 120 allowed, or up to 120 disallowed, are listed
    rng = np.random.default_rng(0)
    counts = [1, 0, 120, 121, 310, 37, 189, 190, 309]
    allowed = np.zeros((len(counts), vocab), dtype=bool)
    for r, c in enumerate(counts):
        allowed[r, rng.choice(vocab, c, replace=False)] = True
    logits_rows = [3, 4, 6, 7, 8, 9, 10, 11, 12]
    sparse = sparse_rows(_pack(allowed), logits_rows, torch.device("cpu"), vocab)
    assert sparse is not None
    assert sparse.rows == (3, 6, 9) and sparse.banned_rows == (11, 12)
    assert sparse.dense.tolist() == [1, 3, 4, 6] and sparse.num_dense == 4
    assert sparse.ids.shape == (3, 120) and sparse.banned.shape == (2, 120) and sparse.vocab == vocab
    for j, r in enumerate([0, 2, 5]):
        want = np.flatnonzero(allowed[r]).tolist()
        assert sparse.ids[j, : len(want)].tolist() == want
        assert sparse.pad[j].tolist() == [False] * len(want) + [True] * (120 - len(want))
        assert set(sparse.ids[j].tolist()) == set(want)  # the padding repeats an allowed id
    for j, r in enumerate([7, 8]):
        want = np.flatnonzero(~allowed[r]).tolist()
        assert sparse.banned[j, : len(want)].tolist() == want and set(sparse.banned[j].tolist()) == set(want)
    assert sparse.max_id == max(np.flatnonzero(allowed[[0, 2, 5]].any(0)).max(), np.flatnonzero(~allowed[7]).max())
    assert sparse_rows(_pack(allowed[[1, 4]]), [0, 1], torch.device("cpu"), vocab) is None
    only_few = sparse_rows(_pack(allowed[[0, 1]]), [0, 1], torch.device("cpu"), vocab)
    only_most = sparse_rows(_pack(allowed[[8, 1]]), [0, 1], torch.device("cpu"), vocab)
    assert only_few is not None and only_few.rows == (0,) and only_few.banned_rows == ()
    assert only_most is not None and only_most.rows == () and only_most.banned_rows == (0,)


SETTINGS: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.8, "num_logprobs": 3},
    {"temperature": 0.0, "num_logprobs": 0},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 1.2, "min_p": 0.05},
    {"temperature": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2},
    {"temperature": 0.9, "banned": (5, 17)},
    {"temperature": 1.0, "bias": ((3, 4.0), (1500, -2.0)), "allowed": tuple(range(0, 2000, 3))},
]


def _row_params(setting: dict[str, Any], seed: int, index: int) -> RowParams:
    from pypto_serving.sampler import LogitEdits, TokenCounts

    kw = dict(setting)
    bias, allowed = kw.pop("bias", None), kw.pop("allowed", None)
    if bias is not None or allowed is not None:
        kw["edits"] = LogitEdits(bias=bias or (), allowed=allowed)
    if "frequency_penalty" in kw:
        kw["counts"] = TokenCounts(prompt=[1, 2, 3, 40], outputs=[40, 41, 41, 7])
    return RowParams(seed=seed, draw_index=index, **kw)


def _brute_force_token(logits: torch.Tensor, allowed: np.ndarray, p: RowParams) -> int:
    """A row without filters drawn in float64: the disallowed tokens at -inf, the softmax at the
    row's temperature, and the token where the row's uniform falls in the cumulative weights."""
    from pypto_serving.sampler import uniforms

    x = logits.double().masked_fill(torch.from_numpy(~allowed), float("-inf")) / p.temperature
    cdf = torch.softmax(x, -1).cumsum(-1)
    u = float(uniforms(torch.tensor([p.seed]), torch.tensor([p.draw_index]))[0])
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True)[0])


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_listed_grammar_rows_sample_what_their_bitmasks_sample(setting: int) -> None:
    """Grammar rows listed by allowed id (1 token, a few, up to the listing bound) or by disallowed
    id (nearly every token) beside rows with their bitmask only (in between, every token) and an
    unconstrained row: tokens, logprobs and
    flags equal the bitmask path's, seed by seed, under every sampling setting; rows without filters
    also equal a float64 brute force."""
    from pypto_serving.sampler import sample
    from pypto_serving.structured import GrammarMask, sparse_rows

    vocab, gen = 2000, torch.Generator().manual_seed(setting)
    tokenizer_vocab = 1990  # the logits' last 10 tokens are past the tokenizer's: never allowed
    rng = np.random.default_rng(setting)
    counts = [1, 6, 300, 756, 1000, 1900, tokenizer_vocab, 40]  # W = 63: up to 756 allowed or disallowed are listed
    allowed = np.zeros((len(counts), vocab), dtype=bool)
    for r, c in enumerate(counts):
        allowed[r, rng.choice(tokenizer_vocab, c, replace=False)] = True
    host = _pack(allowed)
    logits_rows = [0, 1, 2, 3, 5, 6, 7, 8]  # row 4 is unconstrained
    sparse = sparse_rows(host, logits_rows, torch.device("cpu"), tokenizer_vocab)
    listed = GrammarMask(torch.tensor(logits_rows), torch.from_numpy(host), sparse)
    assert listed.sparse is not None and listed.sparse.rows == (0, 1, 2, 3, 8) and listed.sparse.banned_rows == (6,)
    unlisted = GrammarMask(listed.rows, listed.bitmask)
    for seed in range(30):
        logits = (torch.randn(9, vocab, generator=gen) * 3).bfloat16().float()  # bf16: tied logits
        params = [_row_params(SETTINGS[setting], seed * 9 + r, seed + r) for r in range(9)]
        got, want = sample(logits, params, listed), sample(logits, params, unlisted)
        assert (got.empty, got.errors) == (want.empty, want.errors)
        kept = [r for r in range(9) if r not in want.empty]  # a row left nothing draws no token
        assert [(got.tokens[r], got.logprobs[r]) for r in kept] == [(want.tokens[r], want.logprobs[r]) for r in kept]
        if set(SETTINGS[setting]) == {"temperature"}:
            for r, at in enumerate(logits_rows):
                assert got.tokens[at] == _brute_force_token(logits[at], allowed[r], params[at])


@pytest.mark.parametrize("setting", [0, 7])
def test_steps_whose_rows_all_allow_nearly_every_token_sample_what_their_bitmasks_sample(setting: int) -> None:
    """A step whose every row is listed by disallowed id (all requests inside JSON strings: the
    sampler then draws from the step's own logits, uncopied) samples the bitmask path's tokens and
    logprobs seed by seed, a float64 brute force's without filters, and leaves the logits as they were."""
    from pypto_serving.sampler import sample
    from pypto_serving.structured import GrammarMask, sparse_rows

    vocab, tokenizer_vocab, rows = 2000, 1990, 6
    gen, rng = torch.Generator().manual_seed(setting), np.random.default_rng(setting)
    allowed = np.zeros((rows, vocab), dtype=bool)
    for r in range(rows):
        allowed[r, rng.choice(tokenizer_vocab, tokenizer_vocab - 1 - 90 * r, replace=False)] = True
    host = _pack(allowed)
    sparse = sparse_rows(host, list(range(rows)), torch.device("cpu"), tokenizer_vocab)
    listed = GrammarMask(torch.arange(rows), torch.from_numpy(host), sparse)
    assert listed.sparse is not None and listed.sparse.banned_rows == tuple(range(rows)) and not listed.sparse.rows
    for seed in range(30):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        before = logits.clone()
        params = [_row_params(SETTINGS[setting], seed * rows + r, seed + r) for r in range(rows)]
        got, want = sample(logits, params, listed), sample(logits, params, GrammarMask(listed.rows, listed.bitmask))
        assert (got.tokens, got.logprobs, got.errors) == (want.tokens, want.logprobs, want.errors)
        assert torch.equal(logits, before)
        if setting == 0:
            assert got.tokens == [_brute_force_token(logits[r], allowed[r], params[r]) for r in range(rows)]


@pytest.mark.parametrize("listing", ["listed", "checked", "bitmask"])
def test_greedy_grammar_rows_take_the_argmax_of_their_allowed_tokens(listing: str) -> None:
    """An all-greedy step under grammars (rows listed by allowed id, by disallowed id or checked
    against their bitmask, or with their bitmask only, beside an unconstrained row) returns each
    row's argmax among its allowed tokens, the lowest id on ties, as a brute force over the allowed
    set finds it, also where a row's unmasked argmax is disallowed; logprobs stay the raw logits'."""
    from pypto_serving.sampler import sample
    from pypto_serving.structured import GrammarMask, list_rows

    vocab, tokenizer_vocab, gen = 2000, 1990, torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)
    counts = [1, 6, 300, 756, 1000, 1900, tokenizer_vocab, 40]
    allowed = np.zeros((len(counts), vocab), dtype=bool)
    for r, c in enumerate(counts):
        allowed[r, rng.choice(tokenizer_vocab, c, replace=False)] = True
    host = _pack(allowed)
    logits_rows = [0, 1, 2, 3, 5, 6, 7, 8]  # row 4 is unconstrained; row 6 disallows 100 tokens
    listed = None if listing == "bitmask" else list_rows(host, tokenizer_vocab, greedy=listing == "checked")
    sparse = None if listed is None else listed.to(logits_rows, torch.device("cpu"))
    assert listing == "bitmask" or (sparse is not None and bool(sparse.banned_rows) == (listing == "listed"))
    grammar = GrammarMask(torch.tensor(logits_rows), torch.from_numpy(host), sparse)
    disallowed = np.flatnonzero(~allowed[logits_rows.index(6)])
    for seed in range(20):
        logits = (torch.randn(9, vocab, generator=gen) * 2).round()  # small integers: many ties
        if seed % 2:  # row 6's unmasked argmax is a token its grammar disallows
            logits[6, int(disallowed[seed % len(disallowed)])] = 100.0
        params = [
            RowParams(seed=seed, draw_index=0, temperature=0.0, num_logprobs=1 if r == 2 else None) for r in range(9)
        ]
        out = sample(logits, params, grammar)
        want: list[int] = []
        for r in range(9):
            ok = np.ones(vocab, dtype=bool) if r == 4 else allowed[logits_rows.index(r)]
            ids = np.flatnonzero(ok)
            vals = logits[r].numpy()[ids]
            want.append(int(ids[np.flatnonzero(vals == vals.max())[0]]))
        assert out.tokens == want
        raw = torch.log_softmax(logits[2], -1)
        assert out.logprobs[2] is not None and out.logprobs[2][want[2]] == pytest.approx(float(raw[want[2]]))
