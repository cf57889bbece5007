"""Structured output: grammars compiled by xgrammar, one matcher per constrained request, and
the per-step token bitmask that keeps each constrained row's sample inside its grammar.

Owns:
  - ``GrammarCache``: compiled grammars, keyed by ``(kind, spec)``, compiled in its own small
    thread pool (never on the engine thread, never on the event loop). Thread-safe: the
    server compiles a request's grammar before queueing it (a bad schema is a 400 there) and
    the engine thread later finds it compiled. It also checks, without compiling, grammars a
    request carries that its output need not follow (tool parameters), on a thread of their
    own, and caches which passed.
  - ``StructuredDecoder`` (engine thread only): the matcher of every constrained request,
    the bitmask buffer, and the requests parked until their grammar is compiled.

A step, for the rows of constrained requests only, in one of two modes (``check_first``):

  - mask first (CUDA): fill bitmask rows (host, xgrammar) ──> copy those rows alone to the
    logits' device (``copy_rows``) ──> apply_token_bitmask_inplace(logits, bitmask,
    indices=rows) ──> sampler's pick. The fill runs on the host while the GPU runs the
    forward pass it was queued behind.
  - check first (CPU): sampler's pick on the unmasked logits ──> matcher.accept_token(pick)
    and rollback(1), microseconds a row ──> a refused row tries its next-best few tokens
    the same way ──> only rows still without a pick are filled, masked and picked again
    (with the same noise). The pick is the one masking first gives
    (engine/sampler.py says why); what it saves is the fill, which inside a length-bounded
    JSON string (``maxLength``) takes xgrammar milliseconds a row, and on the CPU nothing
    runs beside it: the forward pass that precedes it uses every core.
    Rows whose sampling truncates the distribution (top-k, top-p, min-p) are masked first
    in both modes: their truncation must see the masked logits.

then matcher.accept_token(sampled) for each constrained row.

With no constrained request in the engine the hooks return at their first line: unconstrained
rows never pay for grammars.

Finishing. The matcher's stop tokens are the engine's EOS ids: once the grammar is complete
the mask allows those alone, so the request finishes with ``stop`` through the scheduler's
ordinary EOS check (``ignore_eos`` is overridden for constrained requests by adding them to
their stop token ids). ``max_tokens`` reached first finishes with ``length`` mid-structure,
as OpenAI does.

Vocabulary. The model's head may have more rows than the tokenizer has tokens (padding for
matmul shapes); ``TokenizerInfo`` is built with the head's size, so those ids are never
allowed.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from engine.threads import usable_cpus
from scheduler.output import ScheduledRequest
from scheduler.request import SamplingParams, StructuredOutputParams

logger = logging.getLogger(__name__)

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """The schema, regex, choice list or grammar cannot be compiled; the message says why."""


@dataclass(frozen=True, slots=True)
class CompiledEntry:
    grammar: Any  # xgrammar.CompiledGrammar
    compile_s: float  # seconds the compilation took


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are
    xgrammar EBNF string escapes for the characters json.dumps emits)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiled grammars by ``(kind, spec)``, compiled off the caller's thread.

    Args:
        tokenizer: the served model's transformers tokenizer.
        vocab_size: rows of the model's output head (>= the tokenizer's size).
        stop_token_ids: what ends a completed grammar (the engine's EOS ids).
        max_workers: compile threads; compiles of different schemas run in parallel.
        max_entries: cached grammars kept; the oldest is dropped past it.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_workers: int = 2,
        max_entries: int = 512,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], Future[CompiledEntry]] = {}
        # Checks (``check``) have a thread of their own: one never waits behind a
        # compilation, which can take seconds where a check usually takes a millisecond.
        self._check_executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
        self._checks: dict[tuple[str, str], Future[None]] = {}
        # The tokenizer's token table is read once (tenths of a second for a 50k vocab),
        # started now so the first constrained request rarely waits for it.
        self._compiler: Future[Any] = self._executor.submit(
            _make_compiler, tokenizer, vocab_size, stop_token_ids
        )

    def compile(self, params: StructuredOutputParams) -> tuple[Future[CompiledEntry], bool]:
        """The compiled grammar of ``params``: a finished future when cached, else the
        running compilation (its exception is a ``GrammarError`` for bad input); and whether
        this call started the compilation (what the compile-time metric counts)."""
        return self._cached(self._entries, self._executor, self._compile, params)

    def check(self, params: StructuredOutputParams) -> Future[None]:
        """Whether ``params`` would compile, without compiling it: its conversion to a
        grammar (``to_grammar``), the step of a compilation that rejects bad input, which
        usually takes a millisecond where the compilation (the token masks) can take
        seconds. For grammars a request carries but its output need not follow (the
        ``parameters`` of tools under ``tool_choice: auto``). A passed check is cached; a
        failed one raises ``GrammarError``."""
        return self._cached(self._checks, self._check_executor, _check, params)[0]

    def _cached(
        self,
        entries: dict[tuple[str, str], Future[Any]],
        executor: ThreadPoolExecutor,
        work: Callable[[StructuredOutputParams], Any],
        params: StructuredOutputParams,
    ) -> tuple[Future[Any], bool]:
        key = (params.kind, params.spec)
        with self._lock:
            future = entries.get(key)
            if future is not None:
                return future, False
            future = executor.submit(work, params)
            entries[key] = future
            while len(entries) > self.max_entries:
                entries.pop(next(iter(entries)))
        # A failure is not cached: the next request gets its own error.
        future.add_done_callback(lambda f: self._drop_failed(entries, key, f))
        return future, True

    def _drop_failed(
        self, entries: dict[tuple[str, str], Future[Any]], key: tuple[str, str], future: Future[Any]
    ) -> None:
        if future.exception() is not None:
            with self._lock:
                if entries.get(key) is future:
                    del entries[key]

    def _compile(self, params: StructuredOutputParams) -> CompiledEntry:
        compiler = self._compiler.result()
        start = time.perf_counter()
        grammar = to_grammar(params)
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            raise GrammarError(_reason(exc)) from None
        return CompiledEntry(compiled, time.perf_counter() - start)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._check_executor.shutdown(wait=False, cancel_futures=True)


def to_grammar(params: StructuredOutputParams) -> Any:
    """``params`` as an xgrammar ``Grammar``: the conversion every compilation starts with,
    and where a schema xgrammar does not support, a bad regex or an undefined rule fails.
    Needs no tokenizer.

    Raises:
        GrammarError: with xgrammar's reason.
    """
    import xgrammar as xgr

    try:
        if params.kind == "json":
            # Compact JSON: "any whitespace" lets a small model loop on spaces forever.
            return xgr.Grammar.from_json_schema(params.spec, any_whitespace=False)
        if params.kind == "regex":
            return xgr.Grammar.from_regex(params.spec)
        if params.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(json.loads(params.spec)))
        if params.kind == "grammar":
            return xgr.Grammar.from_ebnf(params.spec)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
        raise GrammarError(_reason(exc)) from None
    raise GrammarError(f"unknown structured output kind {params.kind!r}")


def _check(params: StructuredOutputParams) -> None:
    to_grammar(params)


def _reason(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc)).strip()


def _make_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    # One thread per compilation: the cache's pool runs several compilations side by side.
    return xgr.GrammarCompiler(info, max_threads=1)


class StructuredDecoder:
    """The engine thread's side: matchers of constrained requests, and the sampler's
    constraint hooks (``engine.sampler.LogitsConstraint``).

    Not thread-safe: only the engine thread calls it.
    """

    def __init__(
        self, cache: GrammarCache, fill_threads: int | None = None, *, check_first: bool = True
    ) -> None:
        """Args:
        fill_threads: threads that fill the rows' bitmasks in parallel (xgrammar's C++
            threads, without the GIL); None = the CPUs this process may use. The fill runs
            between forward passes, when the forward's threads are idle; a row's mask
            inside a length-bounded string can take milliseconds, so rows in parallel keep
            a step's grammar work near that of its slowest row.
        check_first: check each constrained row's pick and mask only refused rows (the
            module docstring's two modes); False masks every constrained row first.
        """
        self.cache = cache
        self.check_first = check_first
        self._fill_threads = fill_threads or usable_cpus()[0]
        self._batch_matcher: Any = None  # xgrammar.BatchGrammarMatcher, made on first use
        self._matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher
        self._pending: dict[str, Future[CompiledEntry]] = {}  # compiling, not yet matched
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, host
        # Its twin on the logits' device (CUDA), written only at constrained rows.
        self._device_bitmask: torch.Tensor | None = None

    @property
    def num_constrained(self) -> int:
        return len(self._matchers)

    def constrains(self, request_id: str) -> bool:
        return request_id in self._matchers or request_id in self._pending

    def add(self, request_id: str, params: StructuredOutputParams) -> None:
        """Start (or find) the grammar of a new request; ``ready`` tells when it may run."""
        self._pending[request_id] = self.cache.compile(params)[0]

    def ready(self, request_id: str) -> bool:
        """Whether the request's grammar is compiled (its matcher then exists).

        Raises:
            GrammarError: the grammar failed to compile; the request is forgotten.
        """
        future = self._pending.get(request_id)
        if future is None:
            return True
        if not future.done():
            return False
        del self._pending[request_id]
        entry = future.result()  # raises GrammarError
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(entry.grammar)
        return True

    def wait_any(self, timeout_s: float) -> None:
        """Block until a pending grammar finishes compiling, at most ``timeout_s``: what an
        engine with nothing else to run does instead of spinning."""
        if self._pending:
            wait_futures(list(self._pending.values()), timeout_s, "FIRST_COMPLETED")

    def check_integrity(self, live_request_ids: set[str]) -> None:
        """Every matcher and pending grammar belongs to a request still in the engine."""
        stale = (set(self._matchers) | set(self._pending)) - live_request_ids
        assert not stale, f"grammar state of finished requests: {sorted(stale)[:5]}"

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._pending.pop(request_id, None)

    def mask_before_sampling(
        self,
        logits: torch.Tensor,  # [rows, vocab]
        requests: list[ScheduledRequest],
    ) -> torch.Tensor:
        """The sampler's first hook: masks, in place, the constrained rows that are not
        checked after the pick (all of them unless ``check_first``)."""
        if not self._matchers:
            return logits
        rows = [i for i in self._constrained_rows(requests) if not self._checked(requests[i])]
        return self.mask_rows(logits, requests, rows)

    def refused_rows(
        self,
        token_ids: torch.Tensor,  # [rows] int64, the picks on unmasked logits
        requests: list[ScheduledRequest],
    ) -> list[int]:
        """The sampler's second hook: the checked rows whose pick the grammar refuses.
        Matchers end as they began (an accepted pick is rolled back)."""
        if not self._matchers or not self.check_first:
            return []
        rows = [i for i in self._constrained_rows(requests) if self._checked(requests[i])]
        if not rows:
            return []
        picks = token_ids.tolist()
        refused = []
        for row in rows:
            matcher = self._matchers[requests[row].request_id]
            if matcher.accept_token(picks[row]):
                matcher.rollback(1)
            else:
                refused.append(row)
        return refused

    def first_allowed(
        self,
        candidates: list[list[int]],  # per row of ``rows``: token ids, best first
        requests: list[ScheduledRequest],
        rows: list[int],  # checked rows
    ) -> list[int | None]:
        """Per row, the index of the first candidate its grammar allows, or None; matchers
        end as they began."""
        firsts: list[int | None] = []
        for row, token_ids in zip(rows, candidates, strict=True):
            matcher = self._matchers[requests[row].request_id]
            first = None
            for index, token_id in enumerate(token_ids):
                if matcher.accept_token(token_id):
                    matcher.rollback(1)
                    first = index
                    break
            firsts.append(first)
        return firsts

    def mask_rows(
        self,
        logits: torch.Tensor,  # [rows, vocab]
        requests: list[ScheduledRequest],
        rows: list[int],  # rows of constrained requests
    ) -> torch.Tensor:
        """Fill ``rows``' bitmasks and apply them to the logits, in place."""
        if not rows:
            return logits
        import xgrammar as xgr

        num_rows = logits.shape[0]
        host = self._bitmask
        if host is None or host.shape[0] < num_rows:
            host = xgr.allocate_token_bitmask(max(num_rows, 8), self.cache.vocab_size)
            self._bitmask = host
        bitmask = host[:num_rows]
        matchers = [self._matchers[requests[row].request_id] for row in rows]
        if len(rows) == 1 or self._fill_threads == 1:
            for row, matcher in zip(rows, matchers, strict=True):
                matcher.fill_next_token_bitmask(bitmask, row)
        else:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(self._fill_threads)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        if logits.device.type != "cpu":
            on_device = self._device_bitmask
            if (
                on_device is None
                or on_device.shape[0] < num_rows
                or on_device.device != logits.device
            ):
                on_device = torch.empty_like(host, device=logits.device)
                self._device_bitmask = on_device
            bitmask = on_device[:num_rows]
            copy_rows(host, rows, bitmask)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.cache.vocab_size, indices=rows
        )
        return logits

    def _constrained_rows(self, requests: list[ScheduledRequest]) -> list[int]:
        return [i for i, r in enumerate(requests) if r.request_id in self._matchers]

    def _checked(self, request: ScheduledRequest) -> bool:
        """Whether the row's pick is checked rather than its logits masked first."""
        return self.check_first and samples_whole_distribution(
            request.request.sampling_params, self.cache.vocab_size
        )

    def accept(self, request_ids: list[str], token_ids: list[int | list[int]]) -> None:
        """Advance each constrained request's matcher over its sampled token."""
        if not self._matchers:
            return
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            matcher = self._matchers.get(request_id)
            # A list is a speculative row's tokens; constrained requests get no drafts.
            if matcher is not None and not matcher.is_terminated():
                assert isinstance(token_id, int), "a constrained request got speculative tokens"
                if not matcher.accept_token(token_id):
                    # Only a sampler bug can get here: the mask allowed nothing else.
                    logger.error(
                        "request %s: token %d is outside its grammar", request_id, token_id
                    )


def copy_rows(
    source: torch.Tensor,  # [>= rows, ceil(vocab / 32)] int32, host
    rows: list[int],
    target: torch.Tensor,  # [>= rows, ceil(vocab / 32)] int32, any device
) -> None:
    """``target[rows] = source[rows]``, with only those rows crossing to ``target``'s device:
    the constrained rows of a step, not the whole batch's. They stay at their own indices
    because ``apply_token_bitmask_inplace(indices=rows)`` reads row i's mask at bitmask row
    i; the other rows of ``target`` keep whatever they held, which it never reads.

    NOTE: the rows are gathered into a new host tensor, and a copy from pageable memory is
    staged before the call returns, so ``source`` may be refilled next step while the copy
    is still queued on the device.
    """
    index = torch.tensor(rows, dtype=torch.int64)
    gathered = source.index_select(0, index)  # [len(rows), ceil(vocab / 32)]
    target.index_copy_(
        0,
        index.to(target.device, non_blocking=True),
        gathered.to(target.device, non_blocking=True),
    )


def samples_whole_distribution(params: SamplingParams, vocab_size: int) -> bool:
    """Greedy, or sampling with no truncation (top-k, top-p, min-p) of the tempered
    distribution: a pick that masking cannot change unless the mask refuses it."""
    return params.greedy or (
        params.top_p >= 1.0 and params.min_p <= 0.0 and not 0 < params.top_k < vocab_size
    )
