"""``pypto-serving bench throughput|serve``: argument parsing, the printed table and ``--json``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import secrets
import sys
from pathlib import Path
from typing import Any

from ..config import add_settings_arguments, settings_from_args
from ..plugins import PluginManager, require_model

__all__ = ["add_bench_command", "format_table"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_bench_command(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks: offline throughput, online serving latency")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    t = bsub.add_parser(
        "throughput",
        help="offline: N random prompts x M new tokens through the engine, requests/s and tokens/s",
        description="All prompts are submitted at once to the offline LLM API; the timer runs from "
        "submission to the last output (model loading and a 2-token warm-up request excluded).",
    )
    t.add_argument("--model", metavar="DIR|NAME", help="model directory or named model")
    t.add_argument("--config", metavar="FILE", help="TOML or YAML settings file")
    _add_workload_arguments(t)
    add_settings_arguments(t, server=False)
    t.add_argument("--no-warmup", action="store_true", help="time the first request too")
    t.set_defaults(func=_cmd_throughput)
    s = bsub.add_parser(
        "serve",
        help="online: streamed completions against a server, TTFT/TPOT/ITL/latency",
        description="Without --base-url, starts `pypto-serving serve` with the given settings (on a free "
        "port unless --port is given) and stops it afterwards.",
    )
    s.add_argument(
        "--model",
        metavar="DIR|NAME",
        help="model directory or named model (the served one; also the tokenizer of the workload)",
    )
    s.add_argument("--config", metavar="FILE", help="TOML or YAML settings file (for the server started here)")
    _add_serve_arguments(s)
    _add_workload_arguments(s)
    add_settings_arguments(s)
    s.set_defaults(func=_cmd_serve)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64, metavar="N", help="requests (default: %(default)s)")
    g.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[32, 256],
        metavar=("MIN", "MAX"),
        help="prompt lengths in tokens, drawn uniformly (default: 32 256)",
    )
    g.add_argument(
        "--max-tokens", type=int, default=128, metavar="M", help="new tokens per request (default: %(default)s)"
    )
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS: every request makes M tokens")
    g.add_argument("--workload-seed", type=int, default=0, metavar="SEED", help="seed of the prompts (default: 0)")
    g.add_argument("--vocab-size", type=int, metavar="V", help="draw prompt ids from [0, V) (default: the tokenizer's)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass; 1 = off (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off (default: %(default)s)")
    g.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("client")
    g.add_argument("--base-url", metavar="URL", help="a running OpenAI-compatible server (default: start one)")
    g.add_argument("--concurrency", type=int, metavar="C", help="most requests in flight (default: unbounded)")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        metavar="R",
        help="Poisson arrivals, requests/s (default: inf = all at once)",
    )
    g.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="send token ids (default) or their decoded text (for servers without id prompts)",
    )
    g.add_argument("--model-name", metavar="NAME", help="the model field of requests (default: the server's first)")
    g.add_argument(
        "--logprobs",
        action="store_true",
        help="request logprobs=0 so every engine step's tokens stream as their own chunk even when their text "
        "is held back (ITL per step: per token with num_scheduler_steps=1 and no speculation; costs the server "
        "a log-softmax per token)",
    )
    g.add_argument("--no-warmup", action="store_true", help="no untimed 2-token request before the run")
    g.add_argument("--bearer", metavar="KEY", help="API key to send (default: none)")
    g.add_argument(
        "--profile",
        action="store_true",
        help="wrap the run in /start_profile and /stop_profile and report the Chrome traces (a started server "
        "gets a one-off admin key; a --base-url server needs --profile-key)",
    )
    g.add_argument("--profile-key", metavar="KEY", help="the admin key of the --base-url server, for --profile")
    g.add_argument(
        "--server-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds to wait for a started server to listen (default: %(default)s)",
    )


def _throughput_config(args: argparse.Namespace) -> Any:
    from .throughput import ThroughputConfig

    return ThroughputConfig(
        num_prompts=args.num_prompts,
        min_len=args.input_len[0],
        max_len=args.input_len[1],
        max_tokens=args.max_tokens,
        seed=args.workload_seed,
        vocab_size=args.vocab_size,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        warmup=not getattr(args, "no_warmup", False),
    )


def _cmd_throughput(args: argparse.Namespace) -> int:
    from ..engine import EngineDeadError
    from ..worker import WorkerError
    from .throughput import run_throughput

    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    plugins = PluginManager()
    settings = require_model(plugins, settings, "bench throughput")
    try:
        result = run_throughput(settings, _throughput_config(args), plugins=plugins)
    except (WorkerError, EngineDeadError) as e:
        print(f"pypto-serving: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    return _report(result, args.json)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .launch import started_server
    from .serve import import_httpx

    # Everything that can fail without a server fails before one is started (minutes on a big model).
    import_httpx()
    prompts = _serve_prompts(args)
    if args.profile and not args.base_url:
        args.profile_key = args.setting_admin_api_key = secrets.token_hex(16)  # the started server's
    if args.profile and not args.profile_key:
        raise SystemExit("bench serve --profile with --base-url needs --profile-key (the server's admin key)")
    if args.base_url:
        return _report(_serve_against(args, args.base_url, prompts), args.json)
    with started_server(args) as url:
        result = _serve_against(args, url, prompts)
    return _report(result, args.json)


def _workload_model(args: argparse.Namespace) -> str | None:
    """The directory whose tokenizer the prompts are drawn for: the tokenizer setting, else the model
    (a named one resolved to its directory; none given and no --base-url: the default model, which
    the started server serves)."""
    settings = settings_from_args(args)
    if settings.tokenizer is not None:
        return settings.tokenizer
    if args.base_url and settings.model is None:
        return None  # a remote server's model is unknown here: --model or --vocab-size says it
    return PluginManager().resolve_model(settings).model


def _serve_prompts(args: argparse.Namespace) -> list[list[int] | str]:
    from .workload import make_prompts, prompt_vocab_size

    model = _workload_model(args) if not args.vocab_size or args.prompt_format == "text" else None
    vocab = args.vocab_size or prompt_vocab_size(model)
    ids = make_prompts(args.num_prompts, args.input_len[0], args.input_len[1], vocab, args.workload_seed)
    return list(ids) if args.prompt_format == "ids" else list(_decode_all(model, ids))


def _serve_against(args: argparse.Namespace, url: str, prompts: list[list[int] | str]) -> dict[str, Any]:
    from .serve import ServeConfig, run_serve

    config = ServeConfig(
        base_url=url,
        prompts=prompts,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        seed=args.workload_seed,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        model_name=args.model_name,
        api_key=args.bearer,
        logprobs=args.logprobs,
        warmup=not args.no_warmup,
    )
    if not args.profile:
        result = run_serve(config)
    else:
        _profile_call(url, "/start_profile", args.profile_key)
        result = run_serve(config)
        result["profile_traces"] = _profile_call(url, "/stop_profile", args.profile_key)["traces"]
    result["prompt_format"] = args.prompt_format
    return result


def _profile_call(url: str, route: str, key: str) -> dict[str, Any]:
    """POST an admin profile route; a refusal ends the benchmark with the server's message."""
    from .serve import import_httpx

    r = import_httpx().post(url.rstrip("/") + route, headers={"authorization": f"Bearer {key}"}, timeout=300.0)
    if r.status_code != 200:
        raise SystemExit(f"bench serve --profile: {route} answered {r.status_code}: {r.text}")
    body: dict[str, Any] = r.json()
    return body


def _decode_all(model: str | None, prompts: list[list[int]]) -> list[str]:
    from tokenizers import Tokenizer

    if model is None or not (Path(model) / "tokenizer.json").is_file():
        raise ValueError("--prompt-format text needs --model DIR|NAME with a tokenizer.json")
    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return [tok.decode(p, skip_special_tokens=False) for p in prompts]


def _report(result: dict[str, Any], json_path: str | None) -> int:
    print(format_table(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not result.get("failed") else 1


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:,.2f}"
    return str(value)


def format_table(result: dict[str, Any]) -> str:
    """A two-column table; latency summaries become one row per statistic (``ttft_ms mean`` ...)."""
    rows: list[tuple[str, str]] = []
    for key, value in result.items():
        if key in ("outputs", "errors") and not value:
            continue
        if isinstance(value, dict):
            rows.extend((f"{key} {stat}", _fmt(v)) for stat, v in value.items() if stat in ("mean", "p50", "p99"))
        else:
            rows.append((key, _fmt(value) if not isinstance(value, list) else json.dumps(value)[:80]))
    width = max(len(k) for k, _ in rows)
    vwidth = max(len(v) for _, v in rows)
    line = "-" * (width + vwidth + 3)
    body = "\n".join(f"{k.ljust(width)} | {v.rjust(vwidth)}" for k, v in rows)
    return f"{'metric'.ljust(width)} | {'value'.rjust(vwidth)}\n{line}\n{body}"
