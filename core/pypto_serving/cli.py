"""The ``pypto-serving`` command: plugins, config, generate, and the optional serve and bench commands."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from .config import ServingSettings, SettingsError, add_settings_arguments, settings_from_args
from .plugins import PluginError, PluginManager, require_model

__all__ = ["main"]

# The same log line format as ``pypto-serving serve``.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _cmd_plugins(args: argparse.Namespace) -> int:
    pm = PluginManager()
    rows = []
    for p in pm.plugins:
        kinds = ", ".join(f"{k} {n}" for k, n in p.provides) or "-"
        rows.append((p.name, kinds, p.distribution, p.version, p.status))
    if args.json:
        print(json.dumps([dict(zip(("name", "provides", "distribution", "version", "status"), r)) for r in rows]))
        return 0
    _print_table(("plugin", "provides", "distribution", "version", "status"), rows)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    pm = PluginManager()
    default = pm.default_model()
    rows = [
        (spec.name, "yes" if spec is default else "", plugin.name, spec.description, spec.path)
        for spec, plugin in sorted(pm.models.specs.values(), key=lambda sp: sp[0].name)
    ]
    if args.json:
        print(json.dumps([dict(zip(("name", "default", "plugin", "description", "path"), r)) for r in rows]))
        return 0
    _print_table(("model", "default", "plugin", "description", "path"), rows)
    return 0


def _print_table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


# Settings whose values are credentials: `config show` prints one "***" per entry instead.
SECRET_SETTINGS = ("api_key", "admin_api_key")


def _cmd_config_show(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    data = settings.model_dump(mode="json")
    for name in SECRET_SETTINGS:
        data[name] = ["***"] * len(data[name])
    if args.json:
        print(json.dumps({k: {"value": v, "source": settings.source_of(k)} for k, v in data.items()}, indent=2))
        return 0
    width = max(len(k) for k in data)
    for name, value in data.items():
        print(f"{name.ljust(width)}  {json.dumps(value)}  ({settings.source_of(name)})")
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    prompts: list[str | list[int]] = list(args.prompt)
    if args.input:
        for n, line in enumerate(Path(args.input).read_text().splitlines(), 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if isinstance(item, dict):
                item = item.get("prompt", item.get("prompt_token_ids"))
            if not isinstance(item, str | list):
                raise SettingsError(f'{args.input}:{n}: expected a string, a token-id list or {{"prompt": ...}}')
            prompts.append(item)
    if not prompts:
        raise SettingsError("give prompts as arguments or with --input FILE.jsonl")
    return prompts


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine import LLM, EngineDeadError
    from .request import SamplingParams
    from .worker import WorkerError

    prompts = _read_prompts(args)
    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    plugins = PluginManager()
    settings = require_model(plugins, settings, "generate")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed_sampling,
    )
    try:
        with LLM(settings=settings, plugins=plugins) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1 and sys.stderr.isatty())
    except (WorkerError, EngineDeadError) as e:
        # The first line names the cause (e.g. "the executor failed to load: ..."); the rest is the
        # worker's traceback, which a user of the command does not need.
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    lines = []
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        lines.append({"prompt": prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason})
    if args.output:
        Path(args.output).write_text("".join(json.dumps(line) + "\n" for line in lines))
    else:
        for line in lines:
            print(line["text"] if not args.json else json.dumps(line))
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    """This node's tensor-parallel ranks of a multi-node engine (node_rank >= 1)."""
    from .engine import read_architecture
    from .worker import serve_node

    settings = settings_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    plugins = PluginManager()
    settings = plugins.resolve_model(settings)
    spec = plugins.select_executor(settings.executor, read_architecture(settings.model))
    return serve_node(spec.factory, settings)


def _settings_table() -> str:
    fields = ServingSettings.model_fields
    width = max(len(n) for n in fields)
    return "settings:\n" + "\n".join(f"  {n.ljust(width)}  {f.description}" for n, f in fields.items())


def versions() -> list[tuple[str, str]]:
    """``(distribution, version)`` of the core, the kernels, every distribution providing a plugin
    (read from the entry points, so a broken plugin still shows) and torch, without loading any."""
    names = ["pypto-serving", "pypto-kernels"]
    for ep in metadata.entry_points(group="pypto_serving"):
        if ep.dist is not None and ep.dist.name not in names:
            names.append(ep.dist.name)
    rows = []
    for name in [*names, "torch"]:
        try:
            rows.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            if name == "pypto-serving":  # running from a source tree that was never installed
                rows.append((name, "not installed"))
    return rows


class _VersionAction(argparse.Action):
    """``--version``: the versions are looked up when asked for, not each time the parser is built."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print("\n".join(f"{name} {version}" for name, version in versions()))
        parser.exit()


def _root_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pypto-serving", description="LLM serving engine with pluggable executors.")
    parser.add_argument(
        "--version", action=_VersionAction, help="print the versions of pypto-serving, its plugins and torch"
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _root_parser()
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list installed plugins: name, what they provide, distribution, version, status")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_plugins)

    m = sub.add_parser("models", help="list the named models installed plugins ship (usable as --model NAME)")
    m.add_argument("--json", action="store_true", help="print JSON")
    m.set_defaults(func=_cmd_models)

    _add_config_command(sub)

    g = sub.add_parser("generate", help="offline generation for prompts given as arguments or a JSONL file")
    g.add_argument("prompt", nargs="*", help="prompt texts")
    g.add_argument("--model", metavar="DIR|NAME", help="model directory or named model (default: the default one)")
    g.add_argument("--config", metavar="FILE", help="TOML or YAML settings file")
    g.add_argument("--input", metavar="FILE", help='JSONL: one prompt per line (string, token ids, or {"prompt": ...})')
    g.add_argument("--output", metavar="FILE", help="write JSONL results here instead of printing")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_sampling_arguments(g)
    add_settings_arguments(g, server=False)  # no server runs, so host, port, api_key, ... would do nothing
    g.set_defaults(func=_cmd_generate)

    w = sub.add_parser(
        "worker",
        help="run this node's tensor-parallel ranks for the engine on node 0 (multi-node: node_rank >= 1)",
        description="Start tensor_parallel_size / nnodes ranks that join node 0's group at master_addr:master_port "
        "and run its steps until its engine shuts down; settings must match node 0's.",
    )
    w.add_argument("--model", metavar="DIR|NAME", help="model directory or named model, as on node 0")
    w.add_argument("--config", metavar="FILE", help="TOML or YAML settings file")
    add_settings_arguments(w, server=False)
    w.set_defaults(func=_cmd_worker)
    _add_optional_commands(sub)
    for leaf in _leaf_parsers(parser):
        leaf.set_defaults(leaf_parser=leaf)
    return parser


def _leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parsers of runnable commands (``generate``, ``config show``, ``bench serve``...)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
            yield from _leaf_parsers(child)


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's message for arguments a command does not take, with the closest flag of that
    command for each mistyped one (argparse suggests only from Python 3.14 on)."""
    flags = [s for s in parser._option_string_actions if s.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
            hints += [f"did you mean {close[0]}?"] if close else []
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


def _add_config_command(sub: Any) -> None:
    c = sub.add_parser(
        "config",
        help="inspect settings",
        description="Settings, highest precedence first: flags > PYPTO_SERVING_<NAME> > --config file > defaults.",
        epilog=_settings_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="effective settings with the source of each value")
    show.add_argument("--config", metavar="FILE", help="TOML or YAML settings file")
    show.add_argument("--model", metavar="DIR|NAME", help="model directory or named model")
    show.add_argument("--json", action="store_true", help="print JSON")
    add_settings_arguments(show)
    show.set_defaults(func=_cmd_config_show)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling parameters every prompt of one ``generate`` run shares."""
    group = parser.add_argument_group("sampling (the same for every prompt)")
    group.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        metavar="N",
        help="most tokens generated per prompt (default: %(default)s)",
    )
    group.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy decoding (default: %(default)s)"
    )
    group.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass; 1 = off (default: %(default)s)"
    )
    group.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest; 0 = off (default: %(default)s)"
    )
    group.add_argument(
        "--seed-sampling",
        type=int,
        default=None,
        metavar="SEED",
        help="per-request sampling seed, for reproducible sampling (default: unset, drawn from the engine's --seed)",
    )


def _add_optional_commands(sub: Any) -> None:
    """Commands whose modules live elsewhere in the core (the server, the benchmarks) register here."""
    try:
        from .server.cli import add_serve_command
    except ImportError:
        pass
    else:
        add_serve_command(sub)
    from .bench.cli import add_bench_command
    from .convert import add_convert_command
    from .router.cli import add_router_command

    add_bench_command(sub)
    add_convert_command(sub)
    add_router_command(sub)


def _fail(message: str) -> int:
    print(f"pypto-serving: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Arguments a command does not take come back from its parser, not the top-level one, so the
    # error shows that command's usage.
    args, extra = parser.parse_known_args(argv)
    if extra:
        leaf = getattr(args, "leaf_parser", parser)
        leaf.error(_unrecognized(leaf, extra))
    try:
        return int(args.func(args))
    except (SettingsError, PluginError, ValueError, OSError) as e:  # SettingsError is a ValueError
        return _fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
