"""RouterSettings: the router's configuration, read like ``serve``'s (see docs/router.md).

Precedence, highest first: command-line flags > environment (``PYPTO_ROUTER_*``) > the TOML or YAML
file named by ``--config`` > defaults. Replicas come from the file's ``[[replicas]]`` tables, from
``--replica URL`` flags (added after the file's), or from ``PYPTO_ROUTER_REPLICAS`` (JSON).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from ..config import SettingsError

__all__ = ["ReplicaConfig", "RouterSettings", "add_router_arguments", "router_settings_from_args"]

ENV_PREFIX = "PYPTO_ROUTER_"


class ReplicaConfig(BaseModel):
    """One replica: an OpenAI-compatible server at ``url``, optionally started by the router."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the replica, e.g. http://10.0.0.2:8000 (no /v1).")
    name: str | None = Field(None, description="Name in metrics, logs and admin routes (default: the URL's host:port).")
    command: list[str] | None = Field(
        None,
        description="When set, the router starts this command at start-up and stops it at shutdown "
        "(e.g. ['pypto-serving', 'serve', '--port', '8001']); it must serve at url.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of command.")
    log_file: Path | None = Field(None, description="Where command's output goes (default: log_dir/NAME.log).")
    api_key: str | None = Field(
        None,
        description="Bearer token the router sends to this replica; unset = the client's Authorization header "
        "is passed on.",
    )
    admin_api_key: str | None = Field(
        None,
        description="The replica's admin key, sent as Bearer with the LoRA adapter loads and unloads the router "
        "passes on to every replica; unset = none sent.",
    )
    role: Literal["both", "prefill", "decode"] = Field(
        "both",
        description="'prefill' and 'decode' replicas (served with --kv-role) form disaggregated pairs: a completion "
        "goes to a prefill replica with max_tokens 1, then with its kv_transfer_params to a decode replica.",
    )
    stream_kv: bool = Field(
        False,
        description="For a 'prefill' replica (a connector that streams: torch_p2p or mooncake): it streams "
        "the prompt's KV per prefill chunk; the router takes the kv_transfer_params from the first event of a "
        "streamed prefill request and sends the decode request at once, while the prefill runs.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http:// or https:// URL with a host")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"{v!r}: give the server's base URL, without a path (the router adds /v1/...)")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _default_name(self) -> ReplicaConfig:
        if not self.name:
            self.name = urlsplit(self.url).netloc
        return self


class RouterSettings(BaseSettings):
    """Every knob of ``pypto-serving router``. See docs/router.md."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", protected_namespaces=())

    host: str = Field("127.0.0.1", description="Address the router binds.")
    port: int = Field(8100, ge=0, le=65535, description="The router's HTTP port (0 = any free port).")
    replicas: list[ReplicaConfig] = Field(
        default_factory=list, description="The replicas: [[replicas]] tables in the file, --replica URL flags."
    )
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Bearer keys clients must send on the API routes (comma-separated in the environment); "
        "empty = open. /health and /metrics stay open.",
    )
    admin_token: str | None = Field(
        None, description="Bearer token of the admin routes (/router/...); unset = the admin routes are off (403)."
    )
    session_header: str = Field(
        "x-session-id", description="Request header whose value pins a conversation to one replica; '' = off."
    )
    prefix_routing: bool = Field(
        True, description="Send a request whose prompt shares leading blocks with an earlier one to that replica."
    )
    prefix_block_chars: int = Field(64, ge=1, description="Characters per hashed block of a text prompt.")
    prefix_block_tokens: int = Field(16, ge=1, description="Token ids per hashed block of a token-id prompt.")
    prefix_max_blocks: int = Field(
        64, ge=1, description="Leading blocks of a prompt that are hashed (a chat's messages are one block each)."
    )
    prefix_table_size: int = Field(
        100_000, ge=1, description="Block hashes remembered (least recently routed dropped first)."
    )
    prefix_overload_factor: float = Field(
        2.0,
        ge=1.0,
        description="A prefix owner whose outstanding tokens exceed factor x the least loaded replica's plus "
        "prefix_overload_tokens is passed over.",
    )
    prefix_overload_tokens: int = Field(4096, ge=0, description="The additive slack of prefix_overload_factor.")
    chars_per_token: float = Field(
        4.0, gt=0, description="Characters per token when a text prompt's cost is estimated."
    )
    default_max_tokens: int = Field(
        512, ge=0, description="Output tokens assumed for a request that sets no max_tokens."
    )
    health_interval: float = Field(2.0, gt=0, description="Seconds between /health polls of each replica.")
    health_timeout: float = Field(2.0, gt=0, description="Seconds a /health poll may take.")
    unhealthy_after: int = Field(
        2,
        ge=1,
        description="Consecutive failed polls that mark a replica unhealthy (a refused request marks it at once).",
    )
    max_retries: int = Field(
        1, ge=0, le=3, description="Other replicas tried when one fails before sending any byte of its answer."
    )
    max_connections_per_replica: int = Field(256, ge=1, description="Connection pool size towards each replica.")
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to connect to a replica.")
    read_timeout: float = Field(
        600.0, gt=0, description="Seconds a replica may stay silent (before its headers, or between chunks)."
    )
    max_request_body_bytes: int = Field(16 * 1024**2, gt=0, description="Largest accepted request body.")
    log_dir: Path = Field(Path("router-logs"), description="Directory of launched replicas' logs.")
    stop_timeout: float = Field(
        30.0, gt=0, description="Seconds a launched replica gets after SIGTERM before it is killed."
    )
    restart_replicas: bool = Field(
        True, description="Start a launched replica again when its process exits (a crash, a kill)."
    )
    restart_delay: float = Field(
        2.0,
        gt=0,
        description="Seconds before a launched replica that exited is started again; doubled (up to 60) while it "
        "keeps exiting within a minute of its start.",
    )
    shutdown_timeout: float = Field(30.0, ge=0, description="Seconds in-flight requests get at shutdown.")
    log_level: str = Field("info", description="Log level: debug, info, warning, error.")

    @field_validator("api_key", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        keys = v.split(",") if isinstance(v, str) else v
        return [k for k in keys if k] if isinstance(keys, list) else keys  # an empty key would match nothing

    @field_validator("session_header")
    @classmethod
    def _lower_header(cls, v: str) -> str:
        return v.strip().lower()

    @model_validator(mode="after")
    def _unique_names(self) -> RouterSettings:
        names = [r.name for r in self.replicas]
        twice = sorted({n for n in names if names.count(n) > 1 if n})
        if twice:
            raise ValueError(f"replica names must be unique: {', '.join(twice)} appear(s) twice")
        return self


def read_router_file(path: Path) -> dict[str, Any]:
    """The settings table of a TOML or YAML router file."""
    if not path.is_file():
        raise SettingsError(f"config file {str(path)!r} does not exist")
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(path.read_text())
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text()) or {}
        else:
            raise SettingsError(f"config file {str(path)!r}: use a .toml, .yaml or .yml file")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise SettingsError(f"config file {str(path)!r} is not valid: {e}") from e
    if not isinstance(data, dict):
        raise SettingsError(f"config file {str(path)!r} must hold a table of settings")
    unknown = sorted(set(data) - set(RouterSettings.model_fields))
    if unknown:
        raise SettingsError(f"config file {str(path)!r}: unknown setting(s) {', '.join(unknown)}")
    return data


def load_router_settings(config_file: Path | None = None, **flags: Any) -> RouterSettings:
    """Settings from flags over the environment over the file, with the file's replicas and then
    the flags' ``replica_urls`` (a list of URLs)."""
    urls: list[str] = flags.pop("replica_urls", None) or []
    data = read_router_file(config_file) if config_file is not None else {}
    try:
        # The environment is layered over the file here: init values would otherwise win over it.
        values = {**data, **EnvSettingsSource(RouterSettings)(), **flags}
        settings = RouterSettings(**values)
        if urls:
            extra = [ReplicaConfig.model_validate({"url": u}) for u in urls]
            settings = RouterSettings(**{**values, "replicas": [*settings.replicas, *extra]})
    except ValidationError as e:
        raise SettingsError(_explain(e)) from None
    return settings


def _explain(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        secret = any(part in ("api_key", "admin_token", "admin_api_key") for part in err["loc"])
        shown = "<redacted>" if secret else repr(err.get("input"))
        lines.append(f"invalid router setting {loc}={shown}: {err['msg']}")
    return "\n".join(lines)


_FLAGS = [n for n in RouterSettings.model_fields if n != "replicas"]


def _default_text(name: str) -> str:
    default = RouterSettings.model_fields[name].get_default(call_default_factory=True)
    if default is None or default == []:
        return ""
    return f" (default: {str(default).lower() if isinstance(default, bool) else default})"


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--replica URL`` (repeatable) and one ``--kebab-case`` flag per setting."""
    parser.add_argument("--config", metavar="FILE", help="TOML or YAML router file (see docs/router.md)")
    parser.add_argument(
        "--replica", metavar="URL", action="append", default=None, help="a replica's base URL (repeatable)"
    )
    group = parser.add_argument_group("settings (each also PYPTO_ROUTER_<NAME> or a config-file key)")
    for name in _FLAGS:
        info = RouterSettings.model_fields[name]
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=f"router_{name}",
            default=None,
            metavar=name.split("_")[-1].upper(),
            help=((info.description or "") + _default_text(name)).replace("%", "%%"),
        )


def router_settings_from_args(args: argparse.Namespace) -> RouterSettings:
    flags = {n: v for n in _FLAGS if (v := getattr(args, f"router_{n}", None)) is not None}
    if args.replica:
        flags["replica_urls"] = list(args.replica)
    config = Path(args.config) if args.config else None
    return load_router_settings(config, **flags)
