"""ServerConfig and ServingConfig: every setting of `pagedserve serve`, parsed once.

Precedence is flag > ``PAGEDSERVE_*`` environment variable > default. Each setting is declared
once in ``_OPTIONS`` (flag, env var, type, default, help, destination), so the flag list, the env
var list and ``--help`` cannot drift apart; ``server/flags.py`` builds the parser from that
table. The result is a frozen ``ServingConfig`` that composes the per-package configs (it
does not inherit them): each component is handed only its own sub-config.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import CUDA_GRAPH_PREFILL_MODES, EngineConfig, check_environment
from engine.spec_decode.config import SpeculativeConfig
from kvpool.config import DEFAULT_BLOCK_SIZE, KVPoolConfig
from kvpool.kv_dtype import KV_CACHE_DTYPES
from scheduler.config import BATCHING_MODES, BLOCK_ALLOCATION_MODES, SchedulerConfig
from server.flags import (
    Option,
    build_arg_parser,
    optional,
    parse_bool,
    parse_bool_or_auto,
    parse_int_list,
    parse_list,
    parse_optional_name,
    parse_size,
)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # server/tools.py implements each
# Other names for the same formats: Qwen 2.5/3 write Hermes' <tool_call> blocks; llama3-json
# is the hyphenated spelling. The flag and its env variable resolve them to the name above.
TOOL_CALL_PARSER_ALIASES = {"qwen": "hermes", "llama3-json": "llama3_json"}
UNKNOWN_FIELD_POLICIES = ("reject", "ignore")
# What a --tokenizer directory must hold (one of): what engine/loader.py load_tokenizer reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def tool_call_parser_name(name: str) -> str:
    """A ``--tool-call-parser`` value as its ``TOOL_CALL_PARSERS`` name (aliases resolved)."""
    return TOOL_CALL_PARSER_ALIASES.get(name, name)


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
        vllm_metric_names: also export the router-facing series under vLLM's names
            (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ...;
            server/metrics.py ``VLLMNamedSeries``), which llm-d's endpoint picker,
            production-stack and autoscalers read.
        check_integrity: run the engine's ``check_integrity()`` after every step (slow;
            for tests and debugging). A violation fails the engine loop loudly.
        peak_bandwidth_gbps: peak memory bandwidth (GB/s) that MBU divides by; None = the
            device table on CUDA, a cached measurement on CPU (server/peaks.py).
        peak_tflops: peak TFLOP/s in the serving dtype that MFU divides by; None as above.
        max_waiting_requests: engine requests (prompts x n) that may wait behind the
            ``max_num_seqs`` running ones; past it new requests get 503 + Retry-After before
            they are tokenized (server/backpressure.py).
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
        num_threads: threads for CPU compute (torch's and the C++ kernels' team); None = the
            CPUs the process may use (affinity, cgroup quota; engine/threads.py).
        allow_special_tokens_in_content: parse control-token strings inside chat message
            content as special tokens (off: they stay text, so content cannot forge turns;
            server/prompts.py).
        header_timeout_s: seconds a connection has to deliver a whole request, headers and
            body, counted from its opening (or, on a kept-alive connection, from the next
            request's first byte); past it the connection gets a 408 and is closed
            (server/connections.py).
        max_connections: past this many open connections, the oldest one still sending its
            request headers is closed with a 503 to make room, or, when none is, the new one
            gets the 503; None = derived from the file-descriptor limit at start.
        stream_send_timeout_s: a response whose client has not read for this long (the
            socket buffers full) is cut off, and its request aborted.
        max_queue_time_s: a request that would wait longer than this for the engine, judged
            from the queue depth and the recent drain rate, gets 503 + Retry-After; one that
            still waits this long is aborted with the same 503. None = no bound.
        chat_template: a Jinja chat template file used instead of the tokenizer's (e.g. one
            that renders ``tools``); None = the tokenizer's.
        tool_call_parser: how ``tool_choice: auto`` output becomes ``tool_calls``: one of
            ``TOOL_CALL_PARSERS`` (server/tools.py); the flag also takes their aliases.
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
    vllm_metric_names: bool = True
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
    num_threads: int | None = None
    allow_special_tokens_in_content: bool = False
    header_timeout_s: float = 30.0
    max_connections: int | None = None
    stream_send_timeout_s: float = 60.0
    max_queue_time_s: float | None = None
    chat_template: str | None = None
    tool_call_parser: str = "hermes"

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
        if not (self.stats_log_interval_s >= 0 and math.isfinite(self.stats_log_interval_s)):
            raise ValueError(
                "stats_log_interval_s must be a number of seconds >= 0 (0 disables the log "
                f"line), got {self.stats_log_interval_s}"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError(
                f"served_model_name cannot be empty, got {self.served_model_name!r} (leave it "
                "unset to serve the model's own name)"
            )
        for name in ("peak_bandwidth_gbps", "peak_tflops"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        for name in ("max_prompt_tokens", "max_output_tokens", "num_threads"):
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
        for name in ("header_timeout_s", "stream_send_timeout_s", "max_queue_time_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be positive, got {self.max_connections}")
        for path in self.public_paths:
            if not path.startswith("/"):
                raise ValueError(f"public paths must start with '/', got {path!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.chat_template is not None:
            if not os.path.isfile(self.chat_template):
                raise ValueError(f"--chat-template {self.chat_template!r} is not a readable file")
            from server.prompts import check_chat_template_file

            check_chat_template_file(self.chat_template)  # compiles, as requests render it


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """The four configs `pagedserve serve` needs, composed rather than inherited."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    kvpool: KVPoolConfig = field(default_factory=KVPoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.engine.async_scheduling and self.scheduler.batching != "continuous":
            raise ValueError("--async-scheduling needs --batching continuous")
        wait_ms = self.scheduler.batch_wait_ms
        if not (wait_ms >= 0 and math.isfinite(wait_ms)):
            raise ValueError(f"batch_wait_ms must be a number of milliseconds >= 0, got {wait_ms}")

    @classmethod
    def from_cli(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> ServingConfig:
        """Parse ``pagedserve serve`` arguments (without the subcommand) and the environment.

        Raises:
            SystemExit: on a bad flag or env value (argparse prints the usage line).
        """
        environ = environ if environ is not None else os.environ
        parser = build_arg_parser(_OPTIONS, environ)
        # ``pagedserve serve MODEL``, as ``vllm serve MODEL``: the positional is --model's
        # other spelling. --model's default becomes a marker so that a flag given beside the
        # positional can be told from an env var or the default (which the positional beats).
        parser.add_argument(
            "positional_model",
            nargs="?",
            metavar="MODEL",
            help="the model, as --model takes it (give one or the other)",
        )
        model_default = parser.get_default("model")
        parser.set_defaults(model=_UNSET)
        args = parser.parse_args(list(argv) if argv is not None else None)
        positional = vars(args).pop("positional_model")
        if args.model is _UNSET:
            args.model = positional if positional is not None else model_default
        elif positional is not None and positional != args.model:
            parser.error(
                f"the model is given twice and differs: MODEL {positional!r} and --model "
                f"{args.model!r}; give only one"
            )
        try:
            check_environment(environ)
            config = cls.from_namespace(args)
            check_tokenizer_path(config.engine.tokenizer)  # before the model loads
            config.engine.check_device()
            return config
        except ValueError as exc:  # a config's own check, the environment or the device
            # One line naming the value: the flags parsed, so the usage would only bury it.
            parser.exit(2, f"{parser.prog}: error: {exc}\n")
            raise  # unreachable: parser.exit exits

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
            engine=EngineConfig(**pick("engine"), speculative=speculative_config(pick)),
            kvpool=KVPoolConfig(**pick("kvpool")),
            scheduler=SchedulerConfig(**pick("scheduler")),
            server=ServerConfig(**pick("server")),
        )


def check_tokenizer_path(tokenizer: str | None) -> None:
    """``--tokenizer`` names a directory the loader (``engine.loader.load_tokenizer``) finds a
    tokenizer in: ``tokenizer.json`` or ``tokenizer.model``. Checked before the model loads,
    which otherwise finds no tokenizer only after loading the weights.

    Raises:
        ValueError: one line naming the path and what is wrong with it.
    """
    if tokenizer is None:
        return
    path = Path(tokenizer)
    if not path.exists():
        raise ValueError(f"--tokenizer {tokenizer!r} does not exist")
    if not path.is_dir():
        raise ValueError(
            f"--tokenizer {tokenizer!r} is not a directory (it takes the directory holding "
            "tokenizer.json / tokenizer_config.json)"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"--tokenizer {tokenizer!r} has no tokenizer: neither "
            f"{' nor '.join(TOKENIZER_FILES)} is in it"
        )


def speculative_config(pick: Callable[[str], dict[str, Any]]) -> SpeculativeConfig | None:
    """The ``speculative`` flags as a ``SpeculativeConfig``, or None without a method.

    Raises:
        ValueError: a speculative flag given without ``--speculative-method``.
    """
    values = pick("speculative")
    method = values.pop("speculative_method")
    fields = {
        "num_speculative_tokens": values["num_speculative_tokens"],
        "ngram_min": values["ngram_min"],
        "ngram_max": values["ngram_max"],
        "model": values["speculative_model"],
        "draft_load_format": values["speculative_load_format"],
        "max_step_tokens": values["speculative_max_step_tokens"],
        "row_cost": values["speculative_row_cost"],
    }
    if method is None:
        if fields["model"] is not None:
            raise ValueError("--speculative-model needs --speculative-method draft")
        return None
    return SpeculativeConfig(method=method, **fields)


_UNSET = object()  # --model's parser default while the positional MODEL is resolved
_S, _E, _K, _P = ServerConfig(), EngineConfig(), KVPoolConfig(), SchedulerConfig()
_SPEC = SpeculativeConfig()
# fmt: off
_OPTIONS: tuple[Option, ...] = (
    # engine
    Option("--model", "engine", "model", str, _E.model,
           "'default' (embedded SmolLM2-135M-Instruct), an HF directory or a .gguf file"),
    Option("--dtype", "engine", "dtype", optional(str), _E.dtype,
           "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16"),
    Option("--device", "engine", "device", optional(str), _E.device,
           "cpu, cuda, cuda:1, ...; auto picks CUDA when present"),
    Option("--attention-backend", "engine", "attention_backend", str, _E.attention_backend,
           "auto (Triton on CUDA; C++ kernels for float32 on CPU, else torch), triton, cpu "
           "or torch",
           ("auto", "triton", "cpu", "torch")),
    Option("--matmul-weights", "engine", "matmul_weights", str, _E.matmul_weights,
           "gguf (a .gguf model on the C++ CPU kernels: batches of up to 64 rows with "
           "AVX-512 VNNI, 12 with AVX-512, 8 with AVX2, multiply by the file's own "
           "Q4_0/Q4_1/Q8_0 blocks where they de-quantize to "
           "exactly the float32 weights; same output, fewer bytes) or float32 (always the "
           "float32 copy)",
           ("gguf", "float32")),
    Option("--quantization", "engine", "quantization", optional(str), _E.quantization,
           "quantize every matmul weight at load, per output channel: int8 (CPU C++ kernels "
           "or CUDA) or fp8 (e4m3, CUDA only); lossy (benchmarks/quality.py measures it); "
           "auto = the checkpoint's dtype",
           ("int8", "fp8")),
    Option("--max-model-len", "engine", "max_model_len", optional(int), _E.max_model_len,
           "longest prompt + output in tokens; auto = the model's max positions"),
    Option("--seed", "engine", "seed", int, _E.seed,
           "seed of the sampler for requests that give none"),
    Option("--load-format", "engine", "load_format", str, _E.load_format,
           "auto (read the checkpoint) or dummy (random weights of the model's shapes; "
           "--model may then name a preset: llama-3-8b, llama-3.1-8b, llama-3.2-1b, "
           "qwen2.5-7b, qwen3-8b, gemma-2-9b, mixtral-8x7b, qwen3-30b-a3b, smollm2-135m, "
           "tiny-llama)",
           ("auto", "dummy")),
    Option("--generation-config", "engine", "generation_config", str, _E.generation_config,
           "auto (the checkpoint's generation_config.json temperature, top_p, top_k, min_p "
           "and repetition_penalty are the defaults of requests that leave them unset, as "
           "vLLM's --generation-config auto) or none (pagedserve's own defaults); EOS ids "
           "are read from the checkpoint either way",
           ("auto", "none")),
    Option("--tokenizer", "engine", "tokenizer", optional(str), _E.tokenizer,
           "directory of a tokenizer to use instead of the model's (a dummy preset has none)"),
    Option("--enforce-eager", "engine", "enforce_eager", parse_bool, _E.enforce_eager,
           "CUDA: never capture CUDA graphs; every step launches its kernels from Python"),
    Option("--cuda-graph-sizes", "engine", "cuda_graph_sizes", optional(parse_int_list),
           _E.cuda_graph_sizes,
           "CUDA: decode batch sizes to capture a graph for, e.g. 1,2,4,8,16; auto = 1, 2, "
           "4, 8, then steps of 8 to 64 and of 16 to --max-num-seqs"),
    Option("--cuda-graph-max-prefill-tokens", "engine", "cuda_graph_max_prefill_tokens", int,
           _E.cuda_graph_max_prefill_tokens,
           "CUDA: steps with prefill tokens of at most N tokens (a short prompt beside "
           "running decodes) replay CUDA graphs (--cuda-graph-prefill-mode); 0 = such "
           "steps launch every kernel from Python"),
    Option("--cuda-graph-prefill-mode", "engine", "cuda_graph_prefill_mode", str,
           _E.cuda_graph_prefill_mode,
           "CUDA: full (default) = a step with prefill tokens replays one graph of the "
           "whole forward where its attention runs in one launch, and graphs cut at each "
           "layer's attention (attention eager between them) where its decodes need the "
           "split decode kernel; piecewise = always the cut graphs",
           CUDA_GRAPH_PREFILL_MODES),
    Option("--async-scheduling", "engine", "async_scheduling", parse_bool_or_auto,
           _E.async_scheduling,
           "schedule and launch each step while the one before still runs on the device, "
           "so the host's per-step work hides behind the GPU's (same tokens; a request that "
           "meets EOS computes one extra row); continuous batching, not with speculative "
           "decoding. auto (default): on for one CUDA device with continuous batching and "
           "no speculative decoding, off elsewhere; false turns it off"),
    Option("--tensor-parallel-size", "engine", "tensor_parallel_size", int,
           _E.tensor_parallel_size,
           "shard every layer over N ranks (torch.distributed: NCCL on CUDA, gloo on CPU); "
           "the server spawns the other ranks; heads, KV heads, MLP and vocabulary that N "
           "does not divide are padded with zero weights"),
    Option("--nnodes", "engine", "nnodes", int, _E.nnodes,
           "tensor parallelism over several hosts: how many (each runs N / nnodes ranks)"),
    Option("--node-rank", "engine", "node_rank", int, _E.node_rank,
           "this host's place among --nnodes; 0 serves HTTP, the others only run ranks"),
    Option("--master-addr", "engine", "master_addr", str, _E.master_addr,
           "address of node 0 for the torch.distributed rendezvous"),
    Option("--master-port", "engine", "master_port", int, _E.master_port,
           "port of the rendezvous on --master-addr; 0 picks a free one (one host only)"),
    # speculative decoding (engine/spec_decode/): SpeculativeConfig, inside EngineConfig
    Option("--speculative-method", "speculative", "speculative_method", optional(str), None,
           "speculative decoding: ngram (prompt lookup) or draft (--speculative-model); "
           "none = off",
           ("ngram", "draft")),
    Option("--num-speculative-tokens", "speculative", "num_speculative_tokens", int,
           _SPEC.num_speculative_tokens,
           "speculative decoding: most tokens proposed per request and step (k)"),
    Option("--ngram-min", "speculative", "ngram_min", int, _SPEC.ngram_min,
           "ngram speculation: shortest n-gram looked up in the prompt and output"),
    Option("--ngram-max", "speculative", "ngram_max", int, _SPEC.ngram_max,
           "ngram speculation: longest n-gram looked up (tried first)"),
    Option("--speculative-model", "speculative", "speculative_model", optional(str),
           _SPEC.model,
           "draft speculation: the draft model (HF directory, .gguf, 'default'), same "
           "vocabulary as --model"),
    Option("--speculative-load-format", "speculative", "speculative_load_format", str,
           _SPEC.draft_load_format,
           "draft speculation: auto (read the checkpoint) or dummy (random weights; the "
           "model may name a preset)",
           ("auto", "dummy")),
    Option("--speculative-max-step-tokens", "speculative", "speculative_max_step_tokens",
           optional(int), _SPEC.max_step_tokens,
           "speculate only while a step's decodes and drafts stay within this many tokens; "
           "auto = the device's (16 on the CPU, fewer where GGUF blocks stop sooner; on CUDA "
           "half the step's roofline ridge at the GPU's datasheet peaks, 148 for bf16 on an "
           "H100, or 128)"),
    Option("--speculative-row-cost", "speculative", "speculative_row_cost",
           optional(float), _SPEC.row_cost,
           "what verifying one more draft row costs, relative to a one-row decode step: a "
           "request proposes the number of drafts its recent acceptance pays for, none "
           "(pausing) when nothing does; 0 = always the full count; auto = the device's "
           "(0.4 on the CPU, 0.02 on CUDA)"),
    # kvpool
    Option("--block-size", "kvpool", "block_size", int, DEFAULT_BLOCK_SIZE,
           "tokens per KV block (a power of two)"),
    Option("--kv-cache-memory", "kvpool", "memory_bytes", optional(parse_size), _K.memory_bytes,
           "KV cache budget, e.g. 1GiB or 512MB; auto = 1 GiB on CPU, 90%% of free GPU memory"),
    Option("--gpu-memory-utilization", "kvpool", "gpu_memory_utilization", optional(float),
           _K.gpu_memory_utilization,
           "share of the GPU's total memory this server may take (weights, activations, CUDA "
           "graphs and KV cache together; the KV cache gets what the rest leaves), e.g. 0.45 "
           "for each of two servers on one GPU; auto = 90%% of the memory free after the "
           "weights and the steps; --kv-cache-memory overrides it"),
    Option("--num-kv-blocks", "kvpool", "num_blocks", optional(int), _K.num_blocks,
           "exact number of KV blocks; overrides --kv-cache-memory"),
    Option("--kv-cache-dtype", "kvpool", "cache_dtype", str, _K.cache_dtype,
           "auto (the model's dtype), int8 or fp8 (e4m3): 8-bit K/V with a float16 scale per "
           "token and KV head (keys Hadamard-transformed); ~2x the tokens of bf16 and ~4x of "
           "float32 in the same --kv-cache-memory, lossy",
           KV_CACHE_DTYPES),
    Option("--kv-key-offsets", "kvpool", "key_offsets", parse_bool, _K.key_offsets,
           "with --kv-cache-dtype int8/fp8: subtract a per-(layer, KV head) mean key, "
           "calibrated at start-up, from every key before quantizing it (exact for "
           "attention; less error in long contexts, more in a sequence's first tokens)"),
    Option("--no-prefix-caching", "kvpool", "enable_prefix_caching", parse_bool,
           not _K.enable_prefix_caching,
           "turn off sharing of cached full blocks between requests with a common prefix",
           negate=True),
    # scheduler
    Option("--max-num-seqs", "scheduler", "max_num_seqs", int, _P.max_num_seqs,
           "most requests running at once (the batch size of static/dynamic batching)"),
    Option("--max-num-batched-tokens", "scheduler", "max_num_batched_tokens", int,
           _P.max_num_batched_tokens,
           "most tokens computed in one step; prefill work that fits goes in one step"),
    Option("--prefill-chunk-tokens", "scheduler", "prefill_chunk_tokens", int,
           _P.prefill_chunk_tokens,
           "most prompt tokens per step when the prefill waiting does not fit in one "
           "(default: 512 on CPU, --max-num-batched-tokens on a GPU)"),
    Option("--target-itl-ms", "scheduler", "target_itl_ms", optional(float), _P.target_itl_ms,
           "inter-token latency target: each step's prefill is sized so the predicted step "
           "stays under it while requests decode; none = no target"),
    Option("--target-itl-ratio", "scheduler", "target_itl_ratio", optional(float),
           _P.target_itl_ratio,
           "inter-token latency target relative to the decodes' own step: a step with "
           "prompt tokens is sized to take at most this multiple (> 1) of the same decodes "
           "alone; none = no target"),
    Option("--target-tpot-ms", "scheduler", "target_tpot_ms", optional(float),
           _P.target_tpot_ms,
           "time-per-output-token target, kept on average over steps; none = no target"),
    Option("--target-ttft-ms", "scheduler", "target_ttft_ms", optional(float),
           _P.target_ttft_ms,
           "time-to-first-token target: grows the prefill share (within --target-itl-ms "
           "and --target-itl-ratio) when queued prompts would miss it; needs an ITL or TPOT "
           "target"),
    Option("--min-prefill-chunk-tokens", "scheduler", "min_prefill_chunk_tokens", int,
           _P.min_prefill_chunk_tokens,
           "with a latency target: fewest prompt tokens per step while prompts wait"),
    Option("--batching", "scheduler", "batching", str, _P.batching,
           "continuous (iteration-level), static or dynamic",
           BATCHING_MODES),
    Option("--block-allocation", "scheduler", "block_allocation", str, _P.block_allocation,
           "optimistic (preempt by recompute later) or reserve (prompt + max_tokens up front)",
           BLOCK_ALLOCATION_MODES),
    Option("--batch-wait-ms", "scheduler", "batch_wait_ms", float, _P.batch_wait_ms,
           "dynamic batching: longest wait for a full batch"),
    Option("--static-finished", "scheduler", "static_finished", str, _P.static_finished,
           "static/dynamic: keep computing finished sequences as padding (compute) or not (skip)",
           ("compute", "skip")),
    # server
    Option("--host", "server", "host", str, _S.host,
           "address to bind"),
    Option("--port", "server", "port", int, _S.port,
           "TCP port"),
    Option("--served-model-name", "server", "served_model_name", parse_optional_name,
           _S.served_model_name,
           "model name clients send and /v1/models lists; auto = the model's own"),
    Option("--log-level", "server", "log_level", str.lower, _S.log_level,
           "log level",
           LOG_LEVELS),
    Option("--max-body-size", "server", "max_body_bytes", parse_size, _S.max_body_bytes,
           "largest request body (413 above), e.g. 4MiB"),
    Option("--max-n", "server", "max_n", int, _S.max_n,
           "largest n per request"),
    Option("--max-logprobs", "server", "max_logprobs", int, _S.max_logprobs,
           "largest logprobs / top_logprobs"),
    Option("--unknown-fields", "server", "unknown_fields", str, _S.unknown_fields,
           "unrecognised request fields: reject (400, like OpenAI) or ignore (warn, like vLLM)",
           UNKNOWN_FIELD_POLICIES),
    Option("--engine-stall-timeout", "server", "engine_stall_timeout_s", float,
           _S.engine_stall_timeout_s,
           "seconds without a finished engine-loop iteration before /health reports 503"),
    Option("--stats-log-interval", "server", "stats_log_interval_s", float,
           _S.stats_log_interval_s,
           "seconds between throughput log lines; 0 disables"),
    Option("--no-vllm-metrics", "server", "vllm_metric_names", parse_bool,
           not _S.vllm_metric_names,
           "do not export the router gauges under vLLM's names (vllm:num_requests_waiting, "
           "vllm:kv_cache_usage_perc, ...) beside the pagedserve_* ones", negate=True),
    Option("--check-integrity", "server", "check_integrity", parse_bool, _S.check_integrity,
           "debug: check kvpool/scheduler invariants after every step (true/false)"),
    Option("--peak-bandwidth-gbps", "server", "peak_bandwidth_gbps", optional(float),
           _S.peak_bandwidth_gbps,
           "peak memory bandwidth for MBU, GB/s; auto = device table (GPU) or measured (CPU)"),
    Option("--peak-tflops", "server", "peak_tflops", optional(float), _S.peak_tflops,
           "peak TFLOP/s in the serving dtype for MFU; auto = device table or measured"),
    Option("--max-waiting-requests", "server", "max_waiting_requests", int,
           _S.max_waiting_requests,
           "requests (prompts x n) allowed to wait behind max_num_seqs; more get 503"),
    Option("--max-prompt-tokens", "server", "max_prompt_tokens", optional(int),
           _S.max_prompt_tokens,
           "longest prompt in tokens (400 above); auto = the context length"),
    Option("--max-output-tokens", "server", "max_output_tokens", optional(int),
           _S.max_output_tokens,
           "largest max_tokens (400 above; also the cap when a request gives none)"),
    Option("--request-timeout", "server", "request_timeout_s", optional(float),
           _S.request_timeout_s,
           "seconds a generation request may take from arrival (504 after); "
           "X-Request-Timeout may shorten it per request"),
    Option("--drain-timeout", "server", "drain_timeout_s", float, _S.drain_timeout_s,
           "on SIGTERM: seconds in-flight requests may finish while new ones get 503"),
    Option("--api-key", "server", "api_keys", parse_list, _S.api_keys,
           "accepted API key(s): comma-separated or a repeated flag; none = no auth",
           multiple=True),
    Option("--public-paths", "server", "public_paths", parse_list, _S.public_paths,
           "paths served without an API key (comma-separated; '' = none)",
           multiple=True),
    Option("--cors-origins", "server", "cors_origins", parse_list, _S.cors_origins,
           "origins allowed by CORS, comma-separated ('*' for any); none = CORS off",
           multiple=True),
    Option("--log-prompts", "server", "log_prompts", parse_bool, _S.log_prompts,
           "log request prompts (true/false); off, logs carry only ids and sizes"),
    Option("--num-threads", "server", "num_threads", optional(int), _S.num_threads,
           "threads for CPU compute; auto = the CPUs this process may use (affinity mask, "
           "cgroup CPU quota), or OMP_NUM_THREADS when set"),
    Option("--allow-special-tokens-in-content", "server", "allow_special_tokens_in_content",
           parse_bool, _S.allow_special_tokens_in_content,
           "parse control-token strings in chat message content as special tokens (trusted "
           "clients only; off, they stay text and cannot forge turns)"),
    Option("--header-timeout", "server", "header_timeout_s", float, _S.header_timeout_s,
           "seconds a connection has to send a whole request (headers and body); 408 after"),
    Option("--max-connections", "server", "max_connections", optional(int),
           _S.max_connections,
           "open connections allowed (past it, the oldest one still sending headers, else the new"
           " one, gets a 503); auto = the fd limit less those in use and a reserve"),
    Option("--stream-send-timeout", "server", "stream_send_timeout_s", float,
           _S.stream_send_timeout_s,
           "seconds a client may stop reading a response before it is cut off and aborted"),
    Option("--max-queue-time", "server", "max_queue_time_s", optional(float),
           _S.max_queue_time_s,
           "seconds a request may wait for the engine (503 + Retry-After past it, estimated "
           "from the drain rate); none = unbounded"),
    Option("--chat-template", "server", "chat_template", optional(str), _S.chat_template,
           "a Jinja chat template file to use instead of the tokenizer's (e.g. one that "
           "renders tools)"),
    Option("--tool-call-parser", "server", "tool_call_parser", tool_call_parser_name,
           _S.tool_call_parser,
           "how tool_choice auto output becomes tool_calls: hermes, or its alias qwen "
           "(<tool_call> blocks; Qwen 2.5/3, Hermes), or llama3_json, alias llama3-json (a "
           "bare JSON object)", (*TOOL_CALL_PARSERS, *TOOL_CALL_PARSER_ALIASES)),
)
# fmt: on


def env_var_names() -> list[str]:
    """Every ``PAGEDSERVE_*`` variable `serve` reads (for docs and tests)."""
    return [o.env for o in _OPTIONS]
