"""ServingSettings: the single source of truth for configuration.

Precedence, highest first: explicit arguments / CLI flags > environment (``PYPTO_SERVING_*``, nested
with ``__``) > the TOML or YAML file named by ``config_file`` (``--config``) > defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from .devices import default_block_size, device_kind

__all__ = ["ServingSettings", "SettingsError", "SpeculativeConfig", "add_settings_arguments", "lora_name", "lora_paths"]

ENV_PREFIX = "PYPTO_SERVING_"

# torchrun's environment variables for the multi-node settings, read below the PYPTO_SERVING_* ones.
TORCHRUN_ENV = {
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "nnodes": "NNODES",
    "node_rank": "NODE_RANK",
}


def lora_name(entry: str) -> str:
    """The adapter name of a ``lora_modules`` entry ``name=path``; a malformed entry is a ValueError."""
    name, sep, path = entry.partition("=")
    if not sep or not name.strip() or not path.strip() or name != name.strip():
        raise ValueError(f"lora_modules entry {entry!r} is not 'name=path' (a PEFT adapter directory)")
    return name


def lora_paths(settings: ServingSettings) -> dict[str, str]:
    """``lora_modules`` as adapter name -> directory, in the order given."""
    return {lora_name(e): e.partition("=")[2] for e in settings.lora_modules}


class SettingsError(ValueError):
    """Invalid configuration: the message names the field, the value, its source and what is allowed."""


class SpeculativeConfig(BaseModel):
    """Speculative decoding, as vLLM spells it: ``{"method": "mtp", "num_speculative_tokens": 2}``."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(
        "mtp",
        min_length=1,
        description="Drafting method: 'ngram' (prompt lookup, drafted by the core for any executor that "
        "verifies drafts) or one the executor implements and checks ('mtp': the checkpoint's "
        "multi-token-prediction layers).",
    )
    num_speculative_tokens: int = Field(1, ge=1, le=8, description="Draft tokens k per decode step (1..8).")
    policy: str = Field(
        "adaptive",
        description="Speculative-token policy plugin deciding k per request and step ('greedy', 'fixed', "
        "'adaptive', 'none').",
    )
    prompt_lookup_min: int | None = Field(
        None, ge=1, description="ngram: shortest suffix matched in the request's tokens (default 2)."
    )
    prompt_lookup_max: int | None = Field(
        None, ge=1, description="ngram: longest suffix matched, tried first (default 5)."
    )

    @model_validator(mode="after")
    def _lookup_fields(self) -> SpeculativeConfig:
        """The n-gram fields mean nothing to other methods: refuse them rather than ignore them."""
        given = [f for f in ("prompt_lookup_min", "prompt_lookup_max") if getattr(self, f) is not None]
        if self.method != "ngram":
            if given:
                raise ValueError(f"{', '.join(given)} only apply to method 'ngram', not {self.method!r}")
            return self
        lo = self.prompt_lookup_min or min(2, self.prompt_lookup_max or 2)
        hi = self.prompt_lookup_max or max(5, lo)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        return self


KV_ROLE_ALIASES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


class KVTransferConfig(BaseModel):
    """Disaggregated prefill and decode, shaped like vLLM's ``kv_transfer_config`` (docs/disaggregated.md)."""

    model_config = ConfigDict(extra="forbid")

    kv_connector: str = Field(
        "torch_p2p",
        min_length=1,
        description="KV connector plugin moving blocks between engines ('torch_p2p' built in; 'mooncake' from its "
        "plugin, docs/disaggregated.md).",
    )
    kv_role: Literal["prefill", "decode", "both"] | None = Field(
        None,
        description="'prefill' offers finished prompts' KV, 'decode' pulls it, 'both' does either (vLLM's "
        "kv_producer, kv_consumer and kv_both are accepted); unset: the kv_role setting.",
    )
    kv_ip: str = Field("127.0.0.1", description="Address a prefill engine's connector listens on and advertises.")
    kv_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of a prefill engine's connector (0: a free one); with tensor parallelism rank r's "
        "connector listens on kv_port + r.",
    )
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Options for the connector plugin (torch_p2p: 'timeout' seconds, 'pull_threads', 'backend'; "
        "mooncake: 'protocol', 'device_name', 'metadata_server', 'local_hostname', 'timeout', 'pull_threads').",
    )
    kv_transfer_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds a prefill engine holds a finished request's blocks for a decode engine to pull; "
        "then they are freed and a later pull fails.",
    )

    @field_validator("kv_role", mode="before")
    @classmethod
    def _vllm_role(cls, v: Any) -> Any:
        return KV_ROLE_ALIASES.get(v, v) if isinstance(v, str) else v


class _FileSettingsSource(PydanticBaseSettingsSource):
    """Reads the TOML/YAML file whose path came in through the higher-priority sources."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        return read_config_file(self.path)


class _TorchrunEnvSource(PydanticBaseSettingsSource):
    """torchrun's plain variable names (``MASTER_ADDR``...) for the multi-node settings."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return {name: os.environ[var] for name, var in TORCHRUN_ENV.items() if os.environ.get(var)}


def read_config_file(path: Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise SettingsError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise SettingsError(f"config file {str(path)!r}: use a .toml, .yaml or .yml file")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise SettingsError(f"config file {str(path)!r} is not valid: {e}") from e
    if not isinstance(data, dict):
        raise SettingsError(f"config file {str(path)!r} must hold a table of settings")
    unknown = sorted(set(data) - set(ServingSettings.model_fields))
    if unknown:
        raise SettingsError(
            f"config file {str(path)!r}: unknown setting(s) {', '.join(unknown)}; "
            f"run 'pypto-serving config show' for the list"
        )
    return data


class ServingSettings(BaseSettings):
    """Every knob of the engine, server and plugins. See docs/configuration.md."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        protected_namespaces=(),
    )

    config_file: Path | None = Field(None, description="TOML or YAML file with settings (lowest precedence).")

    # -- model & plugins
    model: str | None = Field(
        None,
        description="A named model ('pypto-serving models' lists them) or a local Hugging Face model directory "
        "(config.json, safetensors, tokenizer.json); unset = the default named model.",
    )
    served_model_name: str | None = Field(
        None, description="Model name reported by the API (default: the model directory's name)."
    )
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: the model directory).")
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="LoRA adapters loaded at start, each 'name=path' of a PEFT adapter directory; a request selects "
        "one by its model name (comma-separated or a JSON list; the flag takes several).",
    )
    max_loras: int = Field(
        4, ge=1, description="Most LoRA adapters loaded at once (lora_modules beyond it are refused)."
    )
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank an adapter may have.")
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters loaded at run time (POST /v1/load_lora_adapter) even when lora_modules is "
        "empty; lora_modules alone enables LoRA.",
    )
    executor: str = Field("auto", description="Executor plugin name; 'auto' picks by config.json architectures.")
    scheduler: str = Field(
        "auto",
        description="Scheduling strategy plugin by name, or 'auto': a pipelined one where the executor supports it.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="true = a pipelined scheduling strategy, false = a non-pipelined one, unset = either.",
    )
    num_scheduler_steps: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Forwards a decode may run within one command to the worker while no request waits to be "
        "admitted, each on the token the one before sampled (vLLM's multi-step scheduling): the engine's and the "
        "pipe's work once per that many tokens, tokens streamed that many at a time; 1 = one forward a command; "
        "unset = auto (docs/configuration.md). Not with speculative decoding.",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='Speculative decoding, e.g. {"method": "mtp", "num_speculative_tokens": 2}; unset = off. '
        "Written as JSON on the command line and in PYPTO_SERVING_SPECULATIVE_CONFIG, as an inline table in a TOML "
        "file ({method = 'mtp', num_speculative_tokens = 2}), as a mapping in a YAML file.",
    )
    executor_options: dict[str, Any] = Field(default_factory=dict, description="Options for the executor plugin.")
    kv_role: Literal["prefill", "decode", "both"] | None = Field(
        None,
        description="Disaggregated serving: 'prefill' computes prompts and offers their KV, 'decode' pulls it and "
        "continues (docs/disaggregated.md); unset: co-located. Fills kv_transfer_config.kv_role.",
    )
    kv_transfer_config: KVTransferConfig | None = Field(
        None,
        description='The KV connector of disaggregated serving, e.g. {"kv_connector": "torch_p2p", "kv_role": '
        '"prefill", "kv_port": 14579} (as JSON on the command line); unset with kv_role set: the defaults.',
    )

    tool_call_parser: str = Field(
        "auto",
        description="Tool-call parser plugin for chat requests with tools: 'auto' picks by the executor's "
        "architecture (Qwen: 'hermes', DeepSeek V3: 'deepseek_v3', V3.2/V4: 'deepseek_v4'), 'none' returns "
        "tool calls as text.",
    )
    reasoning_parser: str = Field(
        "none",
        description="Reasoning parser plugin that moves the model's thinking into reasoning_content "
        "('qwen3', 'deepseek_r1', 'deepseek_v4'); 'auto' picks by the executor's architecture, 'none' leaves "
        "it in content.",
    )

    # -- capacity & batching
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Longest prompt + output in tokens (default: the checkpoint's limit); one longer than the "
        "checkpoint's max_position_embeddings is refused unless allow_long_max_model_len is set.",
    )
    allow_long_max_model_len: bool = Field(
        False,
        description="Accept a max_model_len longer than the checkpoint's max_position_embeddings (config.json, "
        "stretched by a YaRN, linear or dynamic rope_scaling factor); positions past what the model was trained "
        "on can give wrong outputs.",
    )
    max_num_seqs: int = Field(64, gt=0, description="Most requests running in one step.")
    max_num_batched_tokens: int = Field(2048, gt=0, description="Most tokens computed in one step.")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="Cap on one request's prefill chunk per step (0 = no cap beyond the budget)."
    )
    enable_chunked_prefill: bool = Field(True, description="Split long prompts over several steps.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="Order of admission and preemption: 'fcfs' by arrival; 'priority' by each request's priority "
        "(lower first, then arrival), and an arrival may preempt running requests of lower priority for KV blocks.",
    )
    priority_max_wait_s: float = Field(
        60.0,
        gt=0,
        description="Under scheduling_policy 'priority': a request this many seconds past its arrival is served, and "
        "kept from preemption, as if it had the top priority (oldest first), so no priority starves.",
    )
    # None only until validated: ``_device_block_size`` fills in the device's default, so readers see an int.
    block_size: int = Field(  # type: ignore[assignment]
        None,
        gt=0,
        validate_default=False,
        description="Tokens per KV cache block; unset: what the device's fused attention takes (CUDA 256, NPU 128, "
        "CPU 16).",
    )
    num_kv_blocks: int | None = Field(
        None, gt=0, description="KV cache blocks per cache group (overrides kv_cache_memory)."
    )
    kv_cache_memory: int = Field(
        512 * 1024**2,
        gt=0,
        description="Bytes of device memory for the KV cache when num_kv_blocks is unset. Unset: 512 MiB on "
        "accelerators; on the CPU what max_num_seqs requests of max_model_len tokens take, from 512 MiB up to "
        "4 GiB and a quarter of the host's available memory (untouched pages cost nothing).",
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8"] = Field(
        "auto",
        description="KV cache element type (vLLM's name): 'auto' stores K/V in the model dtype (a bfloat16 "
        "model's in float32 on the CPU when no C compiler built the native kernels, since the torch decode "
        "attention reads only float32 in place; Qwen); 'bfloat16' stores bfloat16 (Qwen); 'fp8' stores "
        "float8_e4m3fn over the checkpoint's k_scale/v_scale (per tensor or per KV head; Qwen) or else a scale of 1.0 "
        "(half or a quarter of the bytes per block), written quantised "
        "and read dequantised. Executors that do not support it refuse to start.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Size the KV cache from device memory (vLLM's name; NPU and CPU too): this share of "
        "the device's total, minus what is in use after loading and the peak of a profile forward of "
        "max_num_batched_tokens. An explicit num_kv_blocks or kv_cache_memory wins; unset: kv_cache_memory sizes it.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    prefix_cache_hash: Literal["sha256", "blake2b"] = Field(
        "sha256",
        description="Digest keying prefix-cache blocks (over the parent block's key and the block's token ids).",
    )
    kv_offload_host_bytes: int = Field(
        0,
        ge=0,
        description="Host-memory tier under the device prefix cache (vLLM's name): bytes of CPU memory holding "
        "prefix-cache blocks copied down when published, found again by a prompt that misses the device "
        "(docs/kv_tiers.md); 0: off. Its least recently used blocks spill to the disk tier, if any.",
    )
    kv_offload_disk_path: str | None = Field(
        None,
        description="Directory of the disk tier under the device prefix cache and the host tier: one verified "
        "file per block, kept across restarts for the same checkpoint and cache layout (docs/kv_tiers.md); "
        "unset: no disk tier.",
    )
    kv_offload_disk_bytes: int = Field(
        0,
        ge=0,
        description="Bytes the disk tier (kv_offload_disk_path) may hold; its least recently used files go first.",
    )

    # -- device & worker
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "Weight/activation dtype; 'auto' follows torch_dtype in config.json, except on a CPU: a 16-bit "
            "checkpoint runs in float32 where the CPU has no instructions for its dtype, a float32 one in "
            "bfloat16 where it has AVX512-BF16 or AMX (both logged)."
        ),
    )
    device: str = Field("auto", description="'auto' (npu > cuda > cpu), 'cpu', 'cuda', 'cuda:N' or 'npu'.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks: one worker process per rank, collectives over torch.distributed.",
    )
    enable_expert_parallel: bool = Field(
        False,
        description="Shard the MoE experts over the tensor-parallel ranks (all-to-all dispatch and combine) "
        "instead of sharding every expert's matrices.",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Engine replicas behind one server (`serve`), each with its own worker and KV cache.",
    )
    data_parallel_routing: Literal["least_tokens", "prefix_affinity"] = Field(
        "least_tokens",
        description="How `serve` picks a replica for a new request: fewest outstanding tokens, or the same replica for "
        "prompts sharing their first block (prefix-cache hits), skipping unhealthy ones.",
    )
    worker_mode: Literal["process", "inproc"] = Field(
        "process", description="Run the executor in its own spawned process, or in-process for debugging."
    )
    engine_mode: Literal["process", "thread"] = Field(
        "process",
        description="Run the engine core (scheduling, detokenization) of `serve` in its own process, "
        "or in a thread of the server process (it then shares the GIL with the HTTP event loop).",
    )
    step_timeout: float = Field(
        600.0, gt=0, description="Seconds one step may take before the worker is declared hung."
    )
    worker_threads: int | None = Field(
        None,
        gt=0,
        description="CPU threads of the worker process's torch ops (unset: torch's default); with "
        "worker_mode 'inproc', this process's torch thread count (torch.set_num_threads).",
    )
    worker_omp_wait_policy: Literal["passive", "active", "inherit"] = Field(
        "inherit",
        description="OpenMP wait policy of a spawned worker's CPU threads: 'inherit' keeps the environment's "
        "(OpenMP's default spins briefly, then sleeps: fastest on dedicated cores), 'passive' sleeps at once "
        "(for cores shared with other jobs; 2x slower at 64 streams on dedicated cores), 'active' spins. An "
        "OMP_WAIT_POLICY already set in the environment always wins.",
    )
    worker_cpu_bind: str = Field(
        "auto",
        pattern=r"^(auto|off|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="Cores a spawned single-rank worker's compute threads are pinned to, one thread per core "
        "(OMP_PLACES / OMP_PROC_BIND, and the worker's CPU affinity): 'auto' takes the last worker_threads of the "
        "cores this process may use (unset: torch's thread count, OMP_NUM_THREADS or every core), leaving the "
        "first ones to the engine core and server (engine_cpu_bind), and pins nothing when there are fewer cores "
        "than threads (with "
        "data_parallel_size replicas, replica i takes its own slice of the last replicas x worker_threads cores, "
        "and none is pinned where they do not fit); 'off' pins nothing; or a list such as '0-3' or '2,3'. "
        "OMP_PLACES or OMP_PROC_BIND already set in the environment wins.",
    )
    engine_cpu_bind: str = Field(
        "auto",
        pattern=r"^(auto|off|\d+(-\d+)?(,\d+(-\d+)?)*)$",
        description="Cores the serve command's own processes (the server, its engine-core processes and their "
        "threads) run on, so that they never preempt a pinned worker's compute threads: 'auto' takes the cores "
        "this process may use that the pinned workers (worker_cpu_bind) leave, and pins nothing where a worker is "
        "not pinned or fewer than two cores are left (worker_threads unset takes every core; on one core the "
        "server and engine core wait on each other); 'off' pins nothing; or a list such as '0,1'. A worker is "
        "spawned on its own cores either way. An LLM in your own script leaves your process where it is.",
    )
    worker_shed_busy_cores: Literal["auto", "on", "off"] = Field(
        "auto",
        description="A spawned CPU worker pinned by worker_cpu_bind stops computing on a core that other processes "
        "keep more than 40% busy while another of its cores is not (read from /proc/stat every half second) and "
        "takes it back once they use under 15% of it: one thread sharing its core with a busy process slows every "
        "parallel region of a step (1.9-2.3x a concurrency-1 decode step on two cores, 1.06x on the free core "
        "alone; docs/benchmarks.md). "
        "'auto' does so for executors whose logits do not depend on the thread count "
        "(Qwen on the CPU with packed projections and experts), "
        "so no token changes; 'on' for every executor (a product's last bits may then change with the "
        "neighbours); 'off' never.",
    )
    worker_huge_pages: bool = Field(
        True,
        description="A spawned worker's torch allocates tensors of 2 MiB and more on transparent huge pages "
        "(THP_MEM_ALLOC_ENABLE=1): a fresh step buffer such as 64 rows of logits then costs a few page faults "
        "instead of thousands (1.1x a 64-stream CPU decode step, docs/benchmarks.md). A THP_MEM_ALLOC_ENABLE "
        "already set in the environment wins.",
    )
    worker_heap_reuse: bool = Field(
        True,
        description="A spawned worker's glibc malloc keeps freed memory for reuse instead of returning blocks of "
        "32 MiB and more to the system (GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1 TiB): "
        "a step's fresh buffers, such as 64 rows of logits over a 151,936-word vocabulary, then fault no pages in "
        "(a 64-stream CPU decode step about 1.2x faster, docs/benchmarks.md); the worker's memory then stays at its "
        "peak. A GLIBC_TUNABLES already set in the environment wins.",
    )
    seed: int = Field(0, description="Seed for model initialisation and unseeded sampling.")
    max_worker_restarts: int = Field(
        3,
        ge=0,
        description="Worker restarts allowed within worker_restart_window before the server exits non-zero "
        "(0 = never restart).",
    )
    worker_restart_window: float = Field(600.0, gt=0, description="Seconds over which max_worker_restarts is counted.")

    # -- multi-node tensor parallelism (torchrun's names; MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK are read too)
    master_addr: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address of node 0, where the tensor-parallel ranks meet (torchrun's MASTER_ADDR).",
    )
    master_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port on node 0 where the tensor-parallel ranks meet (torchrun's MASTER_PORT); 0 = a free "
        "port, one node only.",
    )
    nnodes: int = Field(
        1,
        ge=1,
        le=64,
        description="Hosts the tensor-parallel ranks span, tensor_parallel_size / nnodes ranks on each "
        "(torchrun's NNODES).",
    )
    node_rank: int = Field(
        0,
        ge=0,
        le=63,
        description="This host's index among the nnodes: 0 runs the engine (serve, LLM), the others run "
        "`pypto-serving worker` (torchrun's NODE_RANK).",
    )

    # -- server
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port).")
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Accepted Bearer keys; empty = no auth."
    )
    protect_metrics: bool = Field(False, description="Require the API key for /metrics too.")
    admin_api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Bearer keys of the admin routes (/start_profile, /stop_profile); empty = those routes answer 403.",
    )
    profile_dir: Path | None = Field(
        None,
        description="Directory of the Chrome traces /stop_profile writes (unset: pypto-serving-profiles in the "
        "system's temporary directory).",
    )
    max_request_body_bytes: int = Field(1024**2, gt=0, description="Largest accepted HTTP body.")
    max_waiting_requests: int = Field(1024, gt=0, description="Waiting-queue length beyond which requests get 503.")
    shutdown_timeout: float = Field(30.0, ge=0, description="Seconds SIGTERM waits for in-flight requests.")
    http_header_timeout: float = Field(
        10.0, gt=0, description="Seconds a connection may take to send complete request headers before it is closed."
    )
    http_body_timeout: float = Field(
        30.0, gt=0, description="Seconds a request may take to send its whole body before it is closed."
    )
    http_keep_alive_timeout: float = Field(5.0, gt=0, description="Seconds an idle keep-alive connection stays open.")
    http_max_connections: int | None = Field(
        None, gt=0, description="Most open connections; beyond it new requests get 503 (unset: no limit)."
    )
    health_step_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a step may run before /health answers 503 (a liveness bound, shorter than "
        "step_timeout, after which the worker is declared hung and restarted).",
    )
    grammar_compile_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds one request's grammar (guided_json/regex/choice, response_format, a forced tool "
        "call) may take to compile; past it the request is a 400 naming this setting.",
    )
    grammar_max_bytes: int = Field(
        256 * 1024,
        gt=0,
        description="Largest compiled grammar text (bytes) one request may bring; past it the request is a 400.",
    )
    max_json_depth: int = Field(
        64,
        gt=0,
        le=1000,
        description="Deepest nesting of client JSON (the body, tool-call arguments, schemas) before a 400.",
    )
    max_response_bytes: int = Field(
        64 * 1024**2,
        gt=0,
        description="Largest response a request may ask for, estimated from n, prompts, max_tokens and logprobs "
        "before it runs; past it the request is a 400 naming this setting.",
    )
    response_store_max_entries: int = Field(
        1000,
        ge=0,
        description="Most responses /v1/responses keeps for previous_response_id and GET (store: true); past it "
        "the least recently used go first. 0 keeps none.",
    )
    response_store_max_age: float = Field(
        3600.0, gt=0, description="Seconds a stored /v1/responses response is kept at most."
    )
    response_store_max_bytes: int = Field(
        64 * 1024**2,
        gt=0,
        description="Most bytes (as JSON, input items included) of all stored /v1/responses responses; past it "
        "the least recently used go first, and a larger response alone is not kept.",
    )
    request_timeline_capacity: int = Field(
        1000,
        ge=0,
        le=1_000_000,
        description="Finished requests whose timelines /v1/requests/{id}/timeline keeps, the oldest forgotten "
        "first (0 = none).",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        min_length=1,
        description="OTLP/HTTP traces endpoint (e.g. http://localhost:4318/v1/traces) that receives one "
        "OpenTelemetry trace per finished request (needs the 'otel' extra); unset: off, nothing of OpenTelemetry "
        "imported.",
    )
    dashboard_history_path: Path | None = Field(
        None,
        description="SQLite file keeping the /dashboard history across restarts (created if missing); unset: an "
        "in-memory database, lost when the server exits.",
    )
    dashboard_history_retention: float = Field(
        6 * 3600.0, gt=0, description="Seconds of history /dashboard keeps; older samples are deleted."
    )
    dashboard_history_max_bytes: int = Field(
        32 * 1024**2,
        ge=64 * 1024,
        description="Largest size of the dashboard's SQLite history; past it the oldest samples are deleted.",
    )
    dashboard_sample_interval: float = Field(
        5.0, gt=0, description="Seconds between two samples of the metrics stored in the dashboard's history."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Logging level.")

    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("api_key", "admin_api_key", "lora_modules", mode="before")
    @classmethod
    def _split_keys(cls, v: Any) -> Any:
        if isinstance(v, str):  # "a,b" or a JSON list, from the environment or a flag
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [k for k in v.split(",") if k]
        return v

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _usable_keys(cls, v: list[str], info: ValidationInfo) -> list[str]:
        """An empty or whitespace-padded key is refused: HTTP strips a header's surrounding blanks,
        so such a key either matches a blank token (anyone gets in) or can never match."""
        for i, key in enumerate(v):
            if not key or key != key.strip() or not key.isprintable():
                raise ValueError(f"{info.field_name} entry {i} is empty, whitespace-padded or not printable")
        return v

    @field_validator("lora_modules")
    @classmethod
    def _lora_pairs(cls, v: list[str]) -> list[str]:
        """Each entry is ``name=path`` with a name used once: the name is what requests select by."""
        names = [lora_name(entry) for entry in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"lora_modules names each adapter once; repeated: {dup}")
        return v

    @model_validator(mode="after")
    def _lora_limit(self) -> ServingSettings:
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(
                f"lora_modules has {len(self.lora_modules)} adapters but max_loras={self.max_loras}; raise max_loras"
            )
        return self

    @model_validator(mode="after")
    def _kv_roles_agree(self) -> ServingSettings:
        cfg = self.kv_transfer_config
        if cfg is not None and cfg.kv_role is not None and self.kv_role is not None and cfg.kv_role != self.kv_role:
            raise ValueError(f"kv_role={self.kv_role!r} contradicts kv_transfer_config.kv_role={cfg.kv_role!r}")
        if cfg is not None and cfg.kv_port and self.data_parallel_size > 1:
            raise ValueError(
                f"kv_transfer_config.kv_port={cfg.kv_port} with data_parallel_size={self.data_parallel_size}: each "
                "replica's connector needs its own port; use kv_port 0 (a free one each)"
            )
        if cfg is not None and cfg.kv_port + self.tensor_parallel_size - 1 > 65535:
            raise ValueError(
                f"kv_transfer_config.kv_port={cfg.kv_port} with tensor_parallel_size={self.tensor_parallel_size}: "
                "rank r's connector listens on kv_port + r, past 65535; lower kv_port"
            )
        return self

    @model_validator(mode="after")
    def _kv_offload_tiers(self) -> ServingSettings:
        """The tiers' settings go together: each needs the prefix cache, the disk a path and a bound."""
        disk, host = self.kv_offload_disk_path, self.kv_offload_host_bytes
        if disk is not None and self.kv_offload_disk_bytes == 0:
            raise ValueError("kv_offload_disk_path needs kv_offload_disk_bytes > 0 (the disk tier's bound)")
        if disk is None and self.kv_offload_disk_bytes:
            raise ValueError("kv_offload_disk_bytes needs kv_offload_disk_path (the disk tier's directory)")
        if (host or disk is not None) and not self.enable_prefix_caching:
            raise ValueError("kv_offload_host_bytes / kv_offload_disk_path need enable_prefix_caching")
        return self

    def kv_offload(self) -> bool:
        """Whether a host or disk tier sits under the device prefix cache."""
        return self.kv_offload_host_bytes > 0 or self.kv_offload_disk_path is not None

    def kv_transfer(self) -> KVTransferConfig | None:
        """The KV-transfer configuration in effect (its ``kv_role`` filled in), or None when co-located."""
        cfg = self.kv_transfer_config
        role = self.kv_role or (cfg.kv_role if cfg is not None else None)
        if role is None:
            return None
        return (cfg or KVTransferConfig.model_validate({})).model_copy(update={"kv_role": role})

    @model_validator(mode="after")
    def _device_block_size(self) -> ServingSettings:
        """An unset ``block_size`` follows the device (again after ``device`` changes): the size its
        fused attention takes, so default settings run it (:mod:`.devices`)."""
        if "block_size" not in self.model_fields_set:
            # Not an assignment: that would mark the value as set and run validation again.
            object.__setattr__(self, "block_size", default_block_size(device_kind(self.device)))
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            _TorchrunEnvSource(settings_cls),
            _FileSettingsSource(settings_cls, _config_path(init_settings, env_settings)),
        )

    @classmethod
    def load(
        cls, config_file: str | Path | None = None, *, origin: str = "explicit argument", **overrides: Any
    ) -> ServingSettings:
        """Build settings from every source, raising :class:`SettingsError` with the culprit's origin."""
        if config_file is not None:
            overrides["config_file"] = Path(config_file)
        init = InitSettingsSource(cls, init_kwargs=overrides)
        env = EnvSettingsSource(cls)
        layers = [
            (origin, init()),
            ("environment", env()),
            *((f"environment variable {TORCHRUN_ENV[k]}", {k: v}) for k, v in _TorchrunEnvSource(cls)().items()),
            (f"config file {_config_path(init, env)}", _FileSettingsSource(cls, _config_path(init, env))()),
        ]
        try:
            settings = cls(**overrides)
        except ValidationError as e:
            raise SettingsError(_explain(e, layers)) from None
        settings._sources = {
            name: next((src for src, data in layers if name in data), "default") for name in cls.model_fields
        }
        return settings

    def with_overrides(self, *, origin: str = "explicit argument", **overrides: Any) -> ServingSettings:
        """A validated copy with ``overrides`` applied, raising :class:`SettingsError` like :meth:`load`.

        Each value is assigned (``validate_assignment``) instead of rebuilding the settings, which
        would read the environment and the config file again over the caller's values."""
        copy = self.model_copy()
        try:
            for name, value in overrides.items():
                setattr(copy, name, value)
        except ValidationError as e:
            raise SettingsError(_explain(e, [(origin, overrides)])) from None
        copy._sources = {**self._sources, **dict.fromkeys(overrides, origin)}
        return copy

    def source_of(self, name: str) -> str:
        """Where the effective value of a setting came from (filled by :meth:`load`)."""
        return self._sources.get(name, "explicit argument" if name in self.model_fields_set else "default")


def _config_path(init: PydanticBaseSettingsSource, env: PydanticBaseSettingsSource) -> Path | None:
    for source in (init, env):
        value = source().get("config_file")
        if value:
            return Path(value)
    return None


_SECRET_SETTINGS = frozenset({"api_key", "admin_api_key"})


def _explain(error: ValidationError, layers: list[tuple[str, dict[str, Any]]]) -> str:
    lines = []
    for err in error.errors():
        loc = [str(p) for p in err["loc"]]
        field = loc[0] if loc else "?"
        source = next((src for src, data in layers if field in data), "default")
        if source == "environment":
            names = [p for p in loc if not p.isdigit()]
            source = f"environment variable {ENV_PREFIX}{'__'.join(names).upper()}"
        # Secrets are never echoed: an error in one key would otherwise print the valid ones beside it.
        shown = "<redacted>" if field in _SECRET_SETTINGS else repr(err.get("input"))
        allowed = err["msg"]
        info = ServingSettings.model_fields.get(field)
        hint = f" ({info.description})" if info is not None and info.description else ""
        if err["type"] == "extra_forbidden":
            allowed = "unknown setting; run 'pypto-serving config show' for the list"
            hint = ""
        lines.append(f"invalid setting {'.'.join(loc)}={shown} from {source}: {allowed}{hint}")
    return "\n".join(lines)


# Settings that only the HTTP server reads; commands without a server (generate) leave their flags out.
# Every setting named ``http_*`` counts as server-only too (see :func:`is_server_only`).
SERVER_ONLY = frozenset(
    {
        "served_model_name",
        "host",
        "port",
        "api_key",
        "protect_metrics",
        "max_request_body_bytes",
        "max_waiting_requests",
        "shutdown_timeout",
        "max_worker_restarts",
        "worker_restart_window",
        "engine_mode",
        "engine_cpu_bind",
        "data_parallel_size",
        "data_parallel_routing",
        "tool_call_parser",
        "reasoning_parser",
        "response_store_max_entries",
        "response_store_max_age",
        "response_store_max_bytes",
        "dashboard_history_path",
        "request_timeline_capacity",
        "admin_api_key",
        "profile_dir",
        "otlp_traces_endpoint",
        "dashboard_history_retention",
        "dashboard_history_max_bytes",
        "dashboard_sample_interval",
    }
)


def is_server_only(name: str) -> bool:
    """Whether only ``pypto-serving serve`` reads the setting ``name``."""
    return name in SERVER_ONLY or name.startswith("http_")


def _flag_type(annotation: Any) -> str:
    """How a flag's string value is read ("json") and shown in --help (the metavar)."""
    text = str(annotation)
    if "dict" in text or "SpeculativeConfig" in text:
        return "json"
    for kind in ("Literal", "bool", "int", "float", "list"):
        if kind in text:
            return {"Literal": "choice", "list": "str[,str]"}.get(kind, kind)
    return "str"


def _metavar(info: FieldInfo) -> str:
    """The value placeholder of --help: the allowed values of a choice, else the kind of value."""
    if get_origin(info.annotation) is Literal:
        return "{" + ",".join(str(c) for c in get_args(info.annotation)) + "}"
    kind = _flag_type(info.annotation)
    return "{true,false}" if kind == "bool" else kind.upper()


def _default_text(info: FieldInfo) -> str:
    """`` (default: X)`` for --help; empty when the default is unset and the description explains it."""
    default = info.get_default(call_default_factory=True)
    description = (info.description or "").lower()
    if default is None:
        return "" if "default" in description or "unset" in description else " (default: unset)"
    shown = default if isinstance(default, str) else json.dumps(default)
    return f" (default: {shown})"


def add_settings_arguments(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """Add every setting as a ``--kebab-case`` flag; values stay strings for pydantic to validate.

    ``server=False`` leaves out the settings only the HTTP server reads (:func:`is_server_only`).
    The argparse default stays None so :func:`settings_from_args` sees which flags were given; the
    help text shows the setting's own default instead."""
    group = parser.add_argument_group("settings (each also PYPTO_SERVING_<NAME> or a config-file key)")
    for name, info in ServingSettings.model_fields.items():
        if name in ("config_file", "model"):
            continue  # --config and --model are added by the subcommands that take them
        if not server and is_server_only(name):
            continue
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(info.annotation)
        help_text = (info.description or "") + (" (JSON)" if kind == "json" else "") + _default_text(info)
        # --lora-modules takes several name=path words, as vLLM's flag does.
        many: dict[str, Any] = {"nargs": "+", "metavar": "NAME=PATH"} if name == "lora_modules" else {}
        group.add_argument(
            flag,
            dest=f"setting_{name}",
            default=None,
            help=help_text.replace("%", "%%"),
            **{"metavar": _metavar(info), **many},
        )


def settings_from_args(args: argparse.Namespace) -> ServingSettings:
    """Collect ``--flag`` values (only those given) and load settings with them as the top layer."""
    overrides: dict[str, Any] = {}
    for name, info in ServingSettings.model_fields.items():
        value = getattr(args, f"setting_{name}", None)
        if value is None:
            continue
        if isinstance(value, list):  # a flag taking several words (--lora-modules), each may hold a comma list
            value = ",".join(value)
        if _flag_type(info.annotation) == "json":
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SettingsError(
                    f"invalid setting {name}={value!r} from command-line flag: not JSON ({e})"
                ) from None
        overrides[name] = value
    model = getattr(args, "model", None)
    if model is not None:
        overrides["model"] = model
    return ServingSettings.load(config_file=getattr(args, "config", None), origin="command-line flag", **overrides)
