"""ServerConfig and ServingConfig: every setting of `pagedserve serve`, parsed once.

Precedence is flag > ``PAGEDSERVE_*`` environment variable > default. Each setting is declared
once in ``_OPTIONS`` (flag, env var, type, default, help, destination), so the flag list, the env
var list and ``--help`` cannot drift apart. The result is a frozen ``ServingConfig`` composing the
per-package configs (STYLE 12): each component is handed only its own sub-config.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from kvpool.config import DEFAULT_BLOCK_SIZE, KVPoolConfig
from scheduler.config import ADMISSION_MODES, BATCHING_MODES, SchedulerConfig

ENV_PREFIX = "PAGEDSERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UNKNOWN_FIELD_POLICIES = ("reject", "ignore")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Parse a byte size such as ``1GiB``, ``512MB``, ``1.5g`` or ``1073741824``.

    Decimal units (KB, MB, GB) are powers of 1000 and binary units (KiB, MiB, GiB) powers of
    1024, as in ``ls --si`` vs ``ls -h``; a bare K/M/G is decimal.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 1GiB, 512MB, 1073741824)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value < 1 or not math.isfinite(value):
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return int(value)


def parse_list(text: str) -> tuple[str, ...]:
    """Split a comma-separated value (``a,b, c``) into its non-empty, stripped items."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Accept ``none``/``auto`` as ``None`` (so an env var can restore a None default)."""

    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() in ("none", "auto", "") else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Settings of the HTTP layer (everything that is not the engine's, pool's or scheduler's).

    Args:
        host: address uvicorn binds; 127.0.0.1 by default: set ``api_keys`` before binding a
            public address.
        port: TCP port.
        served_model_name: the name clients must send as ``model`` and that ``/v1/models``
            lists; ``None`` uses the engine's display name (e.g. ``SmolLM2-135M-Instruct``).
        log_level: one of ``LOG_LEVELS``, for pagedserve and uvicorn alike.
        max_body_bytes: request bodies above this get a 413 before they are parsed.
        max_n: largest ``n`` a request may ask for (every choice is an engine request).
        max_logprobs: largest top-N for ``logprobs`` / ``top_logprobs`` (OpenAI allows 5/20).
        unknown_fields: ``"reject"`` answers 400 naming unrecognised request fields, as
            OpenAI does; ``"ignore"`` drops them with a warning, as vLLM does.
        engine_stall_timeout_s: ``/health`` turns 503 when the engine loop has not finished
            an iteration for this long (a step that hangs), not only when its thread died.
        stats_log_interval_s: period of the throughput / KV-usage log line; 0 disables it.
        check_integrity: run the engine's ``check_integrity()`` after every step (slow;
            for tests and debugging). A violation fails the engine loop loudly.
        peak_bandwidth_gbps: peak memory bandwidth (GB/s) that MBU divides by; None = the
            device table on CUDA, a cached measurement on CPU (server/peaks.py).
        peak_tflops: peak TFLOP/s in the serving dtype that MFU divides by; None as above.
        max_waiting_requests: engine requests (prompts x n) that may wait behind the
            ``max_num_seqs`` running ones; past it new requests get 503 + Retry-After before
            they are tokenized (server/admission.py).
        max_prompt_tokens: longest prompt accepted (400 above); None = the context length.
        max_output_tokens: largest ``max_tokens`` accepted (400 above); a request without
            ``max_tokens`` gets at most this many. None = up to the context length.
        request_timeout_s: deadline of every generation request from its arrival; an expired
            request is aborted and answered 504. A request's ``X-Request-Timeout`` header
            may shorten it, never lengthen it. None = no server-side deadline.
        drain_timeout_s: on SIGTERM, how long in-flight requests may run before they are
            cut off; new requests get 503 meanwhile (server/shutdown.py).
        api_keys: accepted bearer tokens; empty = no authentication. Never printed.
        public_paths: paths served without a key when ``api_keys`` is set.
        cors_origins: origins allowed by CORS; empty = no CORS headers at all.
        log_prompts: log each request's prompt (off: logs carry ids and sizes only).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    log_level: str = "info"
    max_body_bytes: int = 4 * 1024**2
    max_n: int = 16
    max_logprobs: int = 20
    unknown_fields: str = "reject"
    engine_stall_timeout_s: float = 60.0
    stats_log_interval_s: float = 10.0
    check_integrity: bool = False
    peak_bandwidth_gbps: float | None = None
    peak_tflops: float | None = None
    max_waiting_requests: int = 256
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    request_timeout_s: float | None = None
    drain_timeout_s: float = 30.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    public_paths: tuple[str, ...] = ("/health", "/metrics")
    cors_origins: tuple[str, ...] = ()
    log_prompts: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.unknown_fields not in UNKNOWN_FIELD_POLICIES:
            raise ValueError(
                f"unknown_fields must be one of {UNKNOWN_FIELD_POLICIES}, "
                f"got {self.unknown_fields!r}"
            )
        for name in ("max_body_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.engine_stall_timeout_s <= 0:
            raise ValueError("engine_stall_timeout_s must be positive")
        for name in ("peak_bandwidth_gbps", "peak_tflops"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("request_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        for i, key in enumerate(self.api_keys):
            # Keys travel in an HTTP header: printable ASCII without spaces. The message names
            # the position, never the key.
            if not key or not all("!" <= ch <= "~" for ch in key):
                raise ValueError(
                    f"API key #{i + 1} must be non-empty printable ASCII without spaces"
                )
        for path in self.public_paths:
            if not path.startswith("/"):
                raise ValueError(f"public paths must start with '/', got {path!r}")


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """The four configs `pagedserve serve` needs, composed rather than inherited."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    kvpool: KVPoolConfig = field(default_factory=KVPoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @classmethod
    def from_cli(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> ServingConfig:
        """Parse ``pagedserve serve`` arguments (without the subcommand) and the environment.

        Raises:
            SystemExit: on a bad flag or env value (argparse prints the usage line).
        """
        parser = build_arg_parser(environ if environ is not None else os.environ)
        args = parser.parse_args(list(argv) if argv is not None else None)
        try:
            return cls.from_namespace(args)
        except ValueError as exc:  # a config's own __post_init__ check
            parser.error(str(exc))
            raise  # unreachable: parser.error exits

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServingConfig:
        values = vars(args)

        def pick(group: str) -> dict[str, Any]:
            return {
                o.dest: (not values[o.dest]) if o.negate else values[o.dest]
                for o in _OPTIONS
                if o.group == group
            }

        return cls(
            engine=EngineConfig(**pick("engine")),
            kvpool=KVPoolConfig(**pick("kvpool")),
            scheduler=SchedulerConfig(**pick("scheduler")),
            server=ServerConfig(**pick("server")),
        )


@dataclass(frozen=True, slots=True)
class _Option:
    flag: str
    group: str  # which config the value goes to: engine / kvpool / scheduler / server
    dest: str  # the field name in that config
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    # A "--no-x" switch: given alone it means true, and the config field gets the negation.
    negate: bool = False
    # A list: comma-separated, and a repeated flag adds to it (it replaces the env value).
    multiple: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").replace("-", "_").upper()


_S, _E, _K, _P = ServerConfig(), EngineConfig(), KVPoolConfig(), SchedulerConfig()
# fmt: off
_OPTIONS: tuple[_Option, ...] = (
    # engine
    _Option("--model", "engine", "model", str, _E.model,
            "'default' (embedded SmolLM2-135M-Instruct), an HF directory or a .gguf file"),
    _Option("--dtype", "engine", "dtype", _optional(str), _E.dtype,
            "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16"),
    _Option("--device", "engine", "device", _optional(str), _E.device,
            "cpu, cuda, cuda:1, ...; auto picks CUDA when present"),
    _Option("--attention-backend", "engine", "attention_backend", str, _E.attention_backend,
            "auto (Triton on CUDA; C++ kernels for float32 on CPU, else torch), triton, cpu "
            "or torch",
            ("auto", "triton", "cpu", "torch")),
    _Option("--matmul-weights", "engine", "matmul_weights", str, _E.matmul_weights,
            "gguf (a .gguf model on the C++ CPU kernels: batches of up to 24 rows, 12 with "
            "AVX2, multiply by the file's own Q4_0/Q4_1/Q8_0 blocks where they de-quantize to "
            "exactly the float32 weights; same output, fewer bytes) or float32 (always the "
            "float32 copy)",
            ("gguf", "float32")),
    _Option("--max-model-len", "engine", "max_model_len", _optional(int), _E.max_model_len,
            "longest prompt + output in tokens; auto = the model's max positions"),
    _Option("--seed", "engine", "seed", int, _E.seed,
            "seed of the sampler for requests that give none"),
    _Option("--test-fault-token-id", "engine", "fault_token_id", _optional(int),
            _E.fault_token_id,
            "TEST ONLY, never in production: the engine fails every request whose prompt "
            "holds this token id (fault injection for chaos tests)"),
    # kvpool
    _Option("--block-size", "kvpool", "block_size", int, DEFAULT_BLOCK_SIZE,
            "tokens per KV block (a power of two)"),
    _Option("--kv-cache-memory", "kvpool", "memory_bytes", _optional(parse_size), _K.memory_bytes,
            "KV cache budget, e.g. 1GiB or 512MB; auto = 1 GiB on CPU, 90%% of free GPU memory"),
    _Option("--num-kv-blocks", "kvpool", "num_blocks", _optional(int), _K.num_blocks,
            "exact number of KV blocks; overrides --kv-cache-memory"),
    _Option("--no-prefix-caching", "kvpool", "enable_prefix_caching", _parse_bool,
            not _K.enable_prefix_caching,
            "turn off sharing of cached full blocks between requests with a common prefix",
            negate=True),
    # scheduler
    _Option("--max-num-seqs", "scheduler", "max_num_seqs", int, _P.max_num_seqs,
            "most requests running at once (the batch size of static/dynamic batching)"),
    _Option("--max-num-batched-tokens", "scheduler", "max_num_batched_tokens", int,
            _P.max_num_batched_tokens,
            "most tokens computed in one step; prefill work that fits goes in one step"),
    _Option("--prefill-chunk-tokens", "scheduler", "prefill_chunk_tokens", int,
            _P.prefill_chunk_tokens,
            "most prompt tokens per step when the prefill waiting does not fit in one"),
    _Option("--batching", "scheduler", "batching", str, _P.batching,
            "continuous (iteration-level), static or dynamic",
            BATCHING_MODES),
    _Option("--admission", "scheduler", "admission", str, _P.admission,
            "optimistic (preempt by recompute later) or reserve (prompt + max_tokens up front)",
            ADMISSION_MODES),
    _Option("--batch-wait-ms", "scheduler", "batch_wait_ms", float, _P.batch_wait_ms,
            "dynamic batching: longest wait for a full batch"),
    _Option("--static-finished", "scheduler", "static_finished", str, _P.static_finished,
            "static/dynamic: keep computing finished sequences as padding (compute) or not (skip)",
            ("compute", "skip")),
    # server
    _Option("--host", "server", "host", str, _S.host,
            "address to bind"),
    _Option("--port", "server", "port", int, _S.port,
            "TCP port"),
    _Option("--served-model-name", "server", "served_model_name", _optional(str),
            _S.served_model_name,
            "model name clients send and /v1/models lists"),
    _Option("--log-level", "server", "log_level", str.lower, _S.log_level,
            "log level",
            LOG_LEVELS),
    _Option("--max-body-size", "server", "max_body_bytes", parse_size, _S.max_body_bytes,
            "largest request body (413 above), e.g. 4MiB"),
    _Option("--max-n", "server", "max_n", int, _S.max_n,
            "largest n per request"),
    _Option("--max-logprobs", "server", "max_logprobs", int, _S.max_logprobs,
            "largest logprobs / top_logprobs"),
    _Option("--unknown-fields", "server", "unknown_fields", str, _S.unknown_fields,
            "unrecognised request fields: reject (400, like OpenAI) or ignore (warn, like vLLM)",
            UNKNOWN_FIELD_POLICIES),
    _Option("--engine-stall-timeout", "server", "engine_stall_timeout_s", float,
            _S.engine_stall_timeout_s,
            "seconds without a finished engine-loop iteration before /health reports 503"),
    _Option("--stats-log-interval", "server", "stats_log_interval_s", float,
            _S.stats_log_interval_s,
            "seconds between throughput log lines; 0 disables"),
    _Option("--check-integrity", "server", "check_integrity", _parse_bool, _S.check_integrity,
            "debug: check kvpool/scheduler invariants after every step (true/false)"),
    _Option("--peak-bandwidth-gbps", "server", "peak_bandwidth_gbps", _optional(float),
            _S.peak_bandwidth_gbps,
            "peak memory bandwidth for MBU, GB/s; auto = device table (GPU) or measured (CPU)"),
    _Option("--peak-tflops", "server", "peak_tflops", _optional(float), _S.peak_tflops,
            "peak TFLOP/s in the serving dtype for MFU; auto = device table or measured"),
    _Option("--max-waiting-requests", "server", "max_waiting_requests", int,
            _S.max_waiting_requests,
            "requests (prompts x n) allowed to wait behind max_num_seqs; more get 503"),
    _Option("--max-prompt-tokens", "server", "max_prompt_tokens", _optional(int),
            _S.max_prompt_tokens,
            "longest prompt in tokens (400 above); auto = the context length"),
    _Option("--max-output-tokens", "server", "max_output_tokens", _optional(int),
            _S.max_output_tokens,
            "largest max_tokens (400 above; also the cap when a request gives none)"),
    _Option("--request-timeout", "server", "request_timeout_s", _optional(float),
            _S.request_timeout_s,
            "seconds a generation request may take from arrival (504 after); "
            "X-Request-Timeout may shorten it per request"),
    _Option("--drain-timeout", "server", "drain_timeout_s", float, _S.drain_timeout_s,
            "on SIGTERM: seconds in-flight requests may finish while new ones get 503"),
    _Option("--api-key", "server", "api_keys", parse_list, _S.api_keys,
            "accepted API key(s): comma-separated or a repeated flag; none = no auth",
            multiple=True),
    _Option("--public-paths", "server", "public_paths", parse_list, _S.public_paths,
            "paths served without an API key (comma-separated; '' = none)",
            multiple=True),
    _Option("--cors-origins", "server", "cors_origins", parse_list, _S.cors_origins,
            "origins allowed by CORS, comma-separated ('*' for any); none = CORS off",
            multiple=True),
    _Option("--log-prompts", "server", "log_prompts", _parse_bool, _S.log_prompts,
            "log request prompts (true/false); off, logs carry only ids and sizes"),
)
# fmt: on


def env_var_names() -> list[str]:
    """Every ``PAGEDSERVE_*`` variable `serve` reads (for docs and tests)."""
    return [o.env for o in _OPTIONS]


class _ExtendList(argparse.Action):
    """A list flag: each use adds its comma-separated items. The first use replaces the
    default (which may come from the environment), so flags still win over env vars."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        if current is self.default:
            current = ()
        setattr(namespace, self.dest, (*current, *values))


def build_arg_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The `pagedserve serve` parser; env values become the defaults, so flags win."""
    parser = argparse.ArgumentParser(
        prog="pagedserve serve",
        description="Serve a model over an OpenAI-compatible HTTP API. Every flag can also be "
        f"set with an environment variable {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT=8001); "
        "a flag wins over the variable.",
    )
    for option in _OPTIONS:
        default = option.default
        raw = environ.get(option.env)
        if raw is not None:
            try:
                default = option.parse(raw)
            except ValueError as exc:
                parser.error(f"{option.env}={raw!r}: {exc}")
            if option.choices is not None and default not in (*option.choices, None):
                parser.error(f"{option.env}={raw!r}: choose from {', '.join(option.choices)}")
        if option.multiple:
            parser.add_argument(
                option.flag,
                dest=option.dest,
                type=option.parse,
                default=default,
                action=_ExtendList,
                metavar=option.dest.split("_")[-1].upper(),
                help=f"{option.help} [env {option.env}; default {','.join(option.default)!r}]",
            )
            continue
        parser.add_argument(
            option.flag,
            dest=option.dest,
            type=option.parse,
            default=default,
            choices=option.choices,
            metavar=None if option.choices else option.dest.split("_")[-1].upper(),
            help=f"{option.help} [env {option.env}; default {option.default!r}]",
            nargs="?" if option.negate else None,
            const=True if option.negate else None,
        )
    return parser
