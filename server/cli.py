"""The ``pagedserve`` console script: ``serve``, ``plan`` and ``bench``.

``plan`` and ``bench`` belong to ``planner/`` and ``loadtest/``; they are imported only when
used, so ``pagedserve serve`` does not pay for (or depend on) them, and they do not import
torch through the server.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from engine.config import ModelError
from server.config import ServingConfig

logger = logging.getLogger("pagedserve")
T = TypeVar("T")

USAGE = """usage: pagedserve <command> [options]

commands:
  serve   serve a model over an OpenAI-compatible HTTP API (pagedserve serve --help)
  plan    capacity and speed arithmetic for a model on a device (pagedserve plan --help)
  bench   load-test any OpenAI-compatible server (pagedserve bench --help)
"""


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def on_worker_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a short-lived thread: how the server runs torch work outside the
    engine thread, so that the main thread (the event loop's) never runs a parallel torch op.

    Why: OpenMP gives every thread that runs a parallel region its own team of worker
    threads, kept for the life of the process. A team created on the main thread while the
    model loads (or the CPU peaks are measured) leaves more OpenMP threads than cores once
    the engine thread has its own, and libgomp then stops spinning between parallel regions:
    every matmul of a decode step pays a futex wake-up. On a 2-core CPU that made a batch-1
    decode step markedly slower than the same step on the main thread.
    A team whose thread has exited is reused by the next thread that needs one.
    """
    # The executor's one worker thread exits at the end of the ``with``; exceptions are
    # re-raised here by ``result()``.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-loader") as pool:
        return pool.submit(fn, *args).result()


class ListenError(Exception):
    """The server's address cannot be listened on (taken, or not this machine's)."""


def check_can_listen(host: str, port: int) -> None:
    """Raise ListenError unless ``host`` resolves and its addresses can be bound at ``port``
    now, as asyncio will bind them for uvicorn (``SO_REUSEADDR``, so a port a stopped server
    left in TIME_WAIT passes, and one another server listens on does not). Probe sockets,
    closed again: the port is taken for real once the model is loaded. An address family
    the host cannot use (``::1`` with IPv6 off) is passed over while another address binds,
    as asyncio passes it over (newer versions) or would fail on it: never a refusal where
    the server could run."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror} (--host)") from None
    unavailable: OSError | None = None
    bound = False
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this kernel lacks: asyncio skips it too
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio binds it beside an IPv4 address
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise ListenError(_cannot_listen(host, port, exc)) from None
                unavailable = exc
                continue
        bound = True
    if not bound:
        raise ListenError(_cannot_listen(host, port, unavailable))


def _cannot_listen(host: str, port: int, exc: OSError | None) -> str:
    if exc is None:
        return f"cannot listen on {host}:{port}: no address to bind (--host)"
    hint = (
        "another server listens there: stop it or pick another --port"
        if exc.errno == errno.EADDRINUSE
        else "is --host an address of this machine?"
        if exc.errno == errno.EADDRNOTAVAIL
        else "see --host and --port"
    )
    return f"cannot listen on {host}:{port}: {exc.strerror} ({hint})"


def serve(config: ServingConfig) -> int:
    """Load the engine, start its thread inside the app's lifespan, run uvicorn until a
    signal drains it."""
    from engine.builder import lacks_a_tokenizer
    from engine.llm_engine import LLMEngine
    from engine.protocol import ServingEngine
    from engine.threads import configure_threads
    from engine.tp_group import TensorParallelStartError
    from server.api import create_app
    from server.engine_client import AsyncEngineClient
    from server.metrics import ServerMetrics
    from server.shutdown import serve_until_drained

    configure_logging(config.server.log_level)
    if lacks_a_tokenizer(config.engine):
        config = with_synthetic_tokenizer(config)
    threads, source = configure_threads(config.server.num_threads)
    logger.info("CPU threads: %d (%s)", threads, source)
    worker_status = serve_tensor_parallel_worker(config)
    if worker_status is not None:
        return worker_status
    # Before loading, which takes minutes for a large model on a GPU (weights, warm-up,
    # graphs): a port already taken or a host that is not this machine's fails now, in one
    # line, not after all that in uvicorn's log.
    check_can_listen(config.server.host, config.server.port)
    logger.info("loading model %r (%s)", config.engine.model, config.engine)
    try:
        engine: ServingEngine = on_worker_thread(
            functools.partial(LLMEngine, exit_on_tp_failure=True),
            config.engine,
            config.kvpool,
            config.scheduler,
        )
    except TensorParallelStartError as exc:
        # A rank died before joining, or one on another host never came: every local rank
        # is already stopped (engine/tp_group.py); one line, no traceback.
        logger.critical("%s", exc)
        return 1
    if engine.tokenizer is None:
        # The HTTP API returns text, so it cannot serve a model without a tokenizer (here a
        # checkpoint without tokenizer files); the offline LLM takes token ids instead.
        engine.shutdown()
        raise ModelError(
            f"model {config.engine.model!r} has no tokenizer to serve text with: pass "
            "--tokenizer DIR (a directory with tokenizer.json / tokenizer_config.json)"
        )
    # The engine resolved the device's defaults (the prefill chunk): report those.
    config = dataclasses.replace(config, scheduler=engine.scheduler_config)
    block_size = config.kvpool.block_size
    num_tokens = engine.num_total_blocks * block_size
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%s, %d bytes/token), room for %.1f "
        "sequences of the full context (max_model_len %d); batching %s, max_num_seqs %d, "
        "max_num_batched_tokens %d, prefill_chunk_tokens %d",
        engine.num_total_blocks,
        block_size,
        num_tokens,
        engine.kv_capacity.cache_dtype,
        engine.kv_capacity.bytes_per_token,
        num_tokens / engine.max_model_len,
        engine.max_model_len,
        config.scheduler.batching,
        config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.prefill_chunk_tokens,
    )
    warn_of_bounds_above_the_context(config, engine.max_model_len)
    client = AsyncEngineClient(
        engine,
        stall_timeout_s=config.server.engine_stall_timeout_s,
        check_integrity=config.server.check_integrity,
    )
    # Resolves the MBU/MFU peaks: a device-table lookup, or on CPU a ~3 s measurement the
    # first time on a machine (cached under $PAGEDSERVE_CACHE).
    app = create_app(config, client, on_worker_thread(ServerMetrics.for_engine, config, engine))
    name = config.server.served_model_name or engine.model_id
    logger.info("serving %r on http://%s:%d/v1", name, config.server.host, config.server.port)
    if config.server.api_keys:
        logger.info("API keys: %d configured; open paths: %s", len(config.server.api_keys),
                    ", ".join(config.server.public_paths) or "none")  # fmt: skip
    elif config.server.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who reaches it can use it",
                       config.server.host)  # fmt: skip
    # What is loaded by now (model, tokenizer, grammar compiler, app: hundreds of thousands
    # of objects) lives as long as the process. Frozen out of the collector's generations,
    # a full collection while serving walks only what serving made, instead of stalling
    # every stream for as long as a walk over all of them takes.
    gc.collect()
    gc.freeze()
    # SIGTERM drains in-flight requests (up to --drain-timeout), then the process exits 0.
    try:
        serve_until_drained(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            drain_timeout_s=config.server.drain_timeout_s,
        )
    finally:
        # The frozen generation is never collected, not even by the interpreter's collection
        # at exit, so objects in reference cycles there would outlive the extension modules
        # that define their types. A nanobind extension (triton's, loaded by the Triton
        # backend) reports each one as a leak at exit: a screen of warnings after a clean
        # drain. Unfrozen, the exit's collection frees them as it would without the freeze.
        gc.unfreeze()
    return 0


def warn_of_bounds_above_the_context(config: ServingConfig, max_model_len: int) -> None:
    """A WARNING line for each of ``--max-prompt-tokens`` / ``--max-output-tokens`` above
    the context length, which already bounds prompts and outputs: harmless, so not refused,
    but the user meant some bound. Known only once the engine has resolved the context."""
    for flag, value in (
        ("--max-prompt-tokens", config.server.max_prompt_tokens),
        ("--max-output-tokens", config.server.max_output_tokens),
    ):
        if value is not None and value > max_model_len:
            logger.warning(
                "%s %d has no effect: it is above max_model_len %d, which bounds every "
                "request already (--max-model-len)",
                flag, value, max_model_len,
            )  # fmt: skip


def with_synthetic_tokenizer(config: ServingConfig) -> ServingConfig:
    """``config`` serving a shape preset's dummy weights with a synthetic tokenizer of the
    preset's vocabulary (``engine.presets.write_synthetic_tokenizer``), written into a
    temporary directory removed at exit. Random weights make no text worth reading; what
    the tokenizer keeps is lengths (a prompt's whitespace-separated words are its tokens,
    every generated id decodes to a word of its own), so a load test over text measures
    what it would with the real one. Its words include the load generator's
    (``loadtest.workloads.WORDS``, what ``pagedserve bench`` prompts are made of), one id
    each: a word outside them is the one unknown id, so prompts made of other words share
    their ids, and with them prefix-cache hits a real tokenizer would not give."""
    import atexit
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="pagedserve-tokenizer-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    vocab_size = write_preset_tokenizer(config.engine.model, directory)
    logger.warning(
        "serving %r's random weights with a synthetic tokenizer of %d ids (a prompt's words "
        "are its tokens; outputs are placeholder words): --tokenizer DIR serves a real one",
        config.engine.model, vocab_size,
    )  # fmt: skip
    engine = dataclasses.replace(config.engine, tokenizer=str(directory))
    return dataclasses.replace(config, engine=engine)


def write_preset_tokenizer(model: str, directory: Path) -> int:
    """Write shape preset ``model``'s synthetic tokenizer into ``directory``: its
    vocabulary's size, with the load generator's words (``loadtest.workloads.WORDS``) one
    id each (``engine.presets.write_synthetic_tokenizer``). Returns the vocabulary size."""
    from engine.presets import preset, write_synthetic_tokenizer
    from loadtest.workloads import WORDS

    shape = preset(model)
    assert shape is not None, model
    write_synthetic_tokenizer(shape, directory, WORDS)
    return int(shape["vocab_size"])


def serve_tensor_parallel_worker(config: ServingConfig) -> int | None:
    """A process that only runs tensor-parallel ranks and serves no HTTP: a host other than
    node 0 (``--node-rank`` > 0), or a torchrun rank other than 0. Returns its exit status;
    None for the process that serves."""
    from engine.tp_launch import run_worker, serve_worker_node, torchrun_rendezvous

    engine = config.engine
    rendezvous = torchrun_rendezvous() if engine.tensor_parallel_size > 1 else None
    if rendezvous is not None and rendezvous.rank != 0:
        logger.info("torchrun rank %d: following rank 0", rendezvous.rank)
        # torchrun signals every rank at once: this one stops when rank 0 has drained and
        # sends STOP (or is gone), as a spawned worker does.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return run_worker(rendezvous, engine, config.kvpool, config.scheduler)
    if engine.node_rank > 0:
        return serve_worker_node(engine, config.kvpool, config.scheduler)
    return None


def _until_the_reader_leaves(command: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run a command that prints its results; where their reader goes away first
    (``pagedserve plan ... | head``) stop quietly, as Unix tools do, not with a traceback."""
    try:
        return command(argv)
    except BrokenPipeError:
        # stdout to /dev/null: the interpreter's flush at exit must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        config = ServingConfig.from_cli(rest)
        try:
            return serve(config)
        except (ModelError, ListenError) as exc:
            # A --model or an address the user must change: one line naming it and the fix.
            print(f"pagedserve serve: error: {exc}", file=sys.stderr)
            return 2
    if command == "plan":
        from planner.cli import main as plan_main

        return _until_the_reader_leaves(plan_main, rest)
    if command == "bench":
        from loadtest.cli import main as bench_main

        return _until_the_reader_leaves(
            functools.partial(bench_main, prog="pagedserve bench"), rest
        )
    print(f"pagedserve: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2
