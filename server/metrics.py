"""Prometheus metrics (``GET /metrics``): the only module that imports ``prometheus_client``.

Data flows in as plain values, always on the event loop thread:

* ``record_step(StepStats)`` after every engine step (the engine client's ``on_step`` hook):
  the load gauges, tokens per step, preemptions, prefix-cache counters, the bytes/FLOPs
  counters, and MBU / MFU;
* ``record_occupancy(EngineOccupancy)`` sets the load gauges (queue and KV pool): from every
  step's stats, and by itself when the engine goes idle with no step to say so (the last
  requests aborted; the ``on_idle`` hook), so an idle server never reports a load it shed;
* ``record_tokens(timings, n)`` whenever a request's choice receives tokens: TTFT (on the
  first), inter-token latency (on the others), prompt and generation token counters, so the
  throughput counters move while long requests run;
* ``record_request(timings)`` once per choice when it ends, however it ends (``stop``,
  ``length``, ``abort``, ``error``): the finished counter and the per-request histograms;
* ``record_structured(kind, n, compile_s)`` once per HTTP request with a grammar
  (server/generation_endpoint.py): constrained requests by kind, and the compile time when
  this request compiled the grammar (not when the cache had it);
* ``record_accepted(kind, n)`` once per generation HTTP request about to be queued, with its
  grammar's kind or None: requests by constraint, so the constrained share is one metric's
  ratio;
* ``record_http(handler, status)`` for every HTTP response, from ``HTTPMetricsMiddleware``
  (below).

A *request* here is one engine request, i.e. one choice: an HTTP request with ``n=2`` or two
prompts counts 2, each with its prompt's tokens (HTTP requests have their own counter).
Latency histograms are observed for choices that finished on their own (not ``abort`` /
``error``, whose durations measure the client's patience or a failure).

This module owns the Prometheus exposition: the registry, every metric and its histogram
buckets, and the middleware that counts HTTP responses. What it exports is computed
elsewhere, without ``prometheus_client``: MBU and MFU per step and their smoothed values in
``server/utilization.py`` (the formulas are there), per-request timestamps in
``server/timings.py``, the device peaks in ``server/peaks.py``; the periodic summary log line
is ``server/stats_log.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    choose_encoder,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.outputs import REPLAYS, STEP_PHASES, EngineOccupancy, StepStats
from server.config import ServingConfig
from server.peaks import Peaks, resolve_peaks
from server.stats_log import StatsLog
from server.timings import RequestTimings
from server.utilization import SMOOTHING_S, UtilizationTracker

if TYPE_CHECKING:
    from engine.protocol import ServingEngine

logger = logging.getLogger(__name__)

# Histogram bucket boundaries. Latencies resolve small models: a 135M model decodes a token in
# about a millisecond on an H100, so the inter-token buckets start at 1 ms (vLLM's at 10 ms) and
# the request-phase ones at 1 ms (vLLM's at 300 ms). The tails reach hours, as vLLM's do since
# vllm#15202.
# fmt: off
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0,
                 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
                 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# fmt: on
STEP_TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384
# Grammar compilation: xgrammar compiles a small schema in well under a millisecond and a
# large one (or a first use of the token table) in seconds.
# fmt: off
GRAMMAR_COMPILE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# fmt: on
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")  # engine/structured.py's kinds
# Predicted / measured step time: 0.8 and 1.2 are edges, so the share within +-20% is read
# from two buckets.
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.5, 2.0, 4.0)


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1-2-5 buckets up to ``max_len`` (vLLM's request-length buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10


FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The server's Prometheus registry and the objects that fill it.

    Args:
        model_name: the ``model_name`` label of every metric (the served model name).
        peaks: peak bandwidth / FLOP/s for MBU / MFU; None or unknown figures export none.
        info: labels of ``pagedserve_config_info`` (batching mode, dtype, device, ...).
        max_model_len: top of the per-request token-count buckets.
        num_kv_blocks: the pool size, exported before the first step.
        decode_weight_bytes: weight bytes a one-token decode step reads (engine/cost.py).
        log_interval_s: period of the summary log line; 0 disables it.
        latency_targets: the latency targets in force, seconds by name ("itl", "tpot",
            "ttft"); each is exported as ``pagedserve_target_<name>_seconds``.
        target_itl_ratio: the relative ITL target (``--target-itl-ratio``), exported as
            ``pagedserve_target_itl_ratio`` when set.
        vllm_names: also export the router-facing series under vLLM's names
            (``VLLMNamedSeries``), so routers and autoscalers built for vLLM read this server
            unchanged.
    """

    def __init__(
        self,
        model_name: str = "unknown",
        *,
        peaks: Peaks | None = None,
        info: Mapping[str, str] | None = None,
        max_model_len: int = 8192,
        num_kv_blocks: int | None = None,
        decode_weight_bytes: int | None = None,
        log_interval_s: float = 10.0,
        latency_targets: Mapping[str, float] | None = None,
        target_itl_ratio: float | None = None,
        vllm_names: bool = True,
    ) -> None:
        self.model_name = model_name
        self.peaks = peaks
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        label = ["model_name"]
        # Every series carries this server's model_name, so the attributes below hold the
        # series bound to it once (``metric.labels(name)``), not the metric families:
        # labels() takes a lock and builds its key on every call, and record_step runs after
        # every engine step on the event loop, which at batch 1 shares the cores with the
        # matmul threads (~30 calls: a quarter of the loop's per-token work). Binding also
        # creates every series from the start (zeros), so dashboards and alerts see the
        # metrics before the first request.

        def family(name: str, doc: str, extra: tuple[str, ...]) -> Counter:
            return Counter(f"pagedserve_{name}", doc, [*label, *extra], registry=registry)

        def counter(name: str, doc: str) -> Any:
            return family(name, doc, ()).labels(model_name)

        def gauge(name: str, doc: str, bind: bool = True) -> Any:
            """The bound series, or None (the family exports no sample) when not ``bind``."""
            metric = Gauge(f"pagedserve_{name}", doc, label, registry=registry)
            return metric.labels(model_name) if bind else None

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(
                f"pagedserve_{name}", doc, label, buckets=buckets, registry=registry
            ).labels(model_name)

        # fmt: off
        self.ttft = histogram("time_to_first_token_seconds",
                              "HTTP arrival to the first token, per request", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive token arrivals of a request", ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Per request: (finish - first token) / (output tokens - 1)",
                              ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "HTTP arrival to the last token, per request", PHASE_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "HTTP arrival to the request's first engine step", PHASE_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "First engine step to the first token (all prefill chunks)",
                                 PHASE_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "First token to last token", PHASE_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per "
                                               "request", token_buckets(max_model_len))
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request",
                                                   token_buckets(max_model_len))
        self.step_tokens = histogram("step_tokens", "Tokens computed per engine step "
                                     "(prefill + decode + padding)", STEP_TOKEN_BUCKETS)
        self.step_duration = histogram("step_duration_seconds", "Engine step wall time; _sum is "
                                       "the engine's busy time", STEP_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got a "
                                     "first token")
        self.generation_tokens = counter("generation_tokens", "Tokens delivered to requests")
        self._finished = family("requests_finished", "Requests finished, by reason",
                                ("finished_reason",))
        self.preemptions = counter("preemptions", "Requests preempted (blocks freed, requeued)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache at admission")
        self.prefix_hits = counter("prefix_cache_hits", "Of those, tokens found cached")
        self.spec_drafts = counter("spec_decode_draft_tokens", "Speculative decoding: "
                                   "proposed tokens verified by the target")
        self.spec_accepted = counter("spec_decode_accepted_tokens", "Speculative decoding: "
                                     "of those, tokens accepted")
        self.spec_verifications = counter("spec_decode_verifications", "Speculative decoding: "
                                          "speculative rows verified (each also emits one "
                                          "target token)")
        self.spec_draft_time = histogram("spec_decode_draft_seconds", "Speculative decoding: "
                                         "time proposing, per step that speculates", STEP_BUCKETS)
        # The forward pass that scores the drafts is the step's own, shared with its other
        # rows: it is in step_duration_seconds, not here.
        self.spec_accept_time = histogram("spec_decode_accept_seconds", "Speculative "
                                          "decoding: time choosing the accepted drafts from "
                                          "the target's logits (after the forward pass), per "
                                          "step that speculates", STEP_BUCKETS)
        self._http_requests = family("http_requests", "HTTP responses by route and status",
                                     ("handler", "status"))
        self._structured = family("structured_requests", "Requests whose output follows a "
                                  "grammar (JSON schema, regex, choice, EBNF, tool calls), by "
                                  "kind", ("kind",))
        self._by_constraint = family("requests_by_constraint", "Generation requests accepted, "
                                     "by the grammar their output follows (none: "
                                     "unconstrained); the constrained share is the sum "
                                     "without none over the sum", ("constraint",))
        self.grammar_compile = histogram("grammar_compile_seconds", "Time to compile a new "
                                         "grammar (cache misses only)", GRAMMAR_COMPILE_BUCKETS)
        self.weight_bytes = counter("weight_bytes_read", "Weight bytes read by engine steps")
        self.kv_bytes_read = counter("kv_bytes_read", "KV cache bytes read by engine steps")
        self.kv_bytes_written = counter("kv_bytes_written", "KV cache bytes written by steps")
        self.flops = counter("flops", "Estimated FLOPs of engine steps (engine/cost.py)")
        self._step_phase = family("step_phase_seconds", "Engine step wall time by phase; all "
                                  "but 'forward' is overhead around the model", ("phase",))
        self._step_replay = family("steps_by_replay", "Engine steps by how their forward pass "
                                   "ran: decode_graph, whole_graph, graph_pieces (CUDA graphs) "
                                   "or eager", ("replay",))
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_used = gauge("kv_blocks_used", "KV blocks owned by requests")
        self.kv_total = gauge("kv_blocks_total", "KV blocks in the pool")
        self.kv_usage = gauge("kv_cache_usage_ratio", "KV blocks used / total (0-1)")
        self.kv_cached = gauge("kv_blocks_cached", "Blocks holding a prefix hash, used or not")
        self.kv_evictable = gauge("kv_blocks_evictable", "Cached blocks no request owns")
        self.kv_waste = gauge("kv_waste_ratio", "Allocated KV slots holding no token (0-1)")
        # Utilization needs a known peak: without one these export nothing, not a false 0.
        has_bandwidth = peaks is not None and bool(peaks.bandwidth)
        has_flops = peaks is not None and bool(peaks.flops)
        self.mbu = gauge("mbu", "Model bandwidth utilization of the last step (0-1)",
                         has_bandwidth)
        self.mbu_smoothed = gauge("mbu_smoothed", f"MBU over ~{SMOOTHING_S:g}s of busy time",
                                  has_bandwidth)
        self.mfu = gauge("mfu", "Model FLOP/s utilization of the last step (0-1)", has_flops)
        self.mfu_smoothed = gauge("mfu_smoothed", f"MFU over ~{SMOOTHING_S:g}s of busy time",
                                  has_flops)
        self.bandwidth = gauge("achieved_bandwidth_bytes_per_second",
                               "Bytes moved by the last step / its time")
        self.flops_rate = gauge("achieved_flops_per_second", "FLOPs of the last step / its time")
        # So a load generator can turn its own TPOT into MBU with the bytes this server reads
        # (float32 weights, or GGUF blocks for small batches: --matmul-weights).
        decode_weight_bytes_series = gauge("decode_step_weight_bytes", "Weight bytes a "
                                           "one-token decode step reads",
                                           decode_weight_bytes is not None)
        peak_bandwidth = gauge("peak_bandwidth_bytes_per_second",
                               "Peak memory bandwidth MBU divides by", has_bandwidth)
        peak_flops = gauge("peak_flops_per_second", "Peak FLOP/s MFU divides by", has_flops)
        # Latency targets (--target-itl-ms, ...: scheduler/latency_targets.py). Steps count
        # when requests decoded in them: a prefill-only step delays nobody's next token.
        self.prediction_ratio = histogram("step_time_prediction_ratio",
                                          "Predicted / measured engine step time (latency "
                                          "targets' step-time model)", PREDICTION_RATIO_BUCKETS)
        self.target_steps = counter("target_steps", "Steps with decodes sized by a latency "
                                    "target")
        self.target_steps_met = counter("target_steps_met", "Of those, steps whose time (with "
                                        "the engine loop's gap before it) kept the budget")
        self.target_prefill_cap = histogram("target_prefill_cap_tokens", "Prompt tokens the "
                                            "latency targets let a step with decodes compute "
                                            "(its cap, whether or not prompts filled it)",
                                            STEP_TOKEN_BUCKETS)
        self.target_ttft_boosts = counter("target_ttft_boosts", "Steps whose prefill share "
                                          "grew to keep the TTFT target")
        self.target_conflicts = counter("target_conflicts", "Steps where queued prompts miss "
                                        "the TTFT target even at the largest prefill share")
        config = Info("pagedserve_config", "Serving configuration (batching mode, device, ...)",
                      label, registry=registry)
        # fmt: on
        for name, seconds in (latency_targets or {}).items():
            gauge(f"target_{name}_seconds", f"The {name.upper()} latency target").set(seconds)
        if target_itl_ratio is not None:
            gauge("target_itl_ratio", "The relative ITL target: a step with prompt tokens "
                  "over the same decodes' step alone").set(target_itl_ratio)
        config_labels = dict(info or {})
        if peaks is not None:
            config_labels.update(
                peak_device=peaks.device,
                peak_bandwidth_source=peaks.bandwidth_source,
                peak_flops_source=peaks.flops_source,
            )
        config.labels(model_name).info(config_labels)

        # Series with a second label, bound on first use (the known values up front).
        self._bound: dict[tuple[Any, ...], Any] = {}
        for reason in FINISH_REASONS:
            self._series(self._finished, reason)
        for phase in STEP_PHASES:
            self._series(self._step_phase, phase)
        for replay in REPLAYS:
            self._series(self._step_replay, replay)
        for kind in STRUCTURED_KINDS:
            self._series(self._structured, kind)
        for constraint in ("none", *STRUCTURED_KINDS):
            self._series(self._by_constraint, constraint)
        # The main route's successes from 0, like the series above: a series first scraped
        # after a burst holds its final value in every sample, so rate() reads 0 and the
        # dashboard's error-rate denominator NaN until the next burst.
        self._series(self._http_requests, "/v1/completions", "200")
        if num_kv_blocks is not None:
            self.kv_total.set(num_kv_blocks)
        if decode_weight_bytes is not None:
            decode_weight_bytes_series.set(decode_weight_bytes)
        if peaks is not None and has_bandwidth:
            peak_bandwidth.set(peaks.bandwidth)
        if peaks is not None and has_flops:
            peak_flops.set(peaks.flops)
        block_size = (info or {}).get("block_size")
        self.vllm: VLLMNamedSeries | None = (
            VLLMNamedSeries(
                registry,
                model_name,
                block_size=int(block_size) if block_size is not None else None,
                num_kv_blocks=num_kv_blocks,
            )
            if vllm_names
            else None
        )
        self._utilization = UtilizationTracker(peaks)
        self.last_mbu: float | None = None
        self._stats_log = StatsLog(log_interval_s, logger)

    @classmethod
    def for_engine(cls, config: ServingConfig, engine: ServingEngine) -> ServerMetrics:
        """Metrics for a loaded ``LLMEngine``: peaks resolved for its device and dtype."""
        dtype = str(engine.dtype).removeprefix("torch.")
        device = str(engine.device)
        peaks = resolve_peaks(
            device,
            dtype,
            bandwidth_gbps=config.server.peak_bandwidth_gbps,
            tflops=config.server.peak_tflops,
        )
        info = config_info(
            config,
            device=device,
            dtype=dtype,
            attention=engine.attention_backend,
            matmul_weights=engine.matmul_weights,
            async_scheduling=str(engine.async_scheduling).lower(),
        )
        return cls(
            config.server.served_model_name or engine.model_id,
            peaks=peaks,
            info=info,
            max_model_len=engine.max_model_len,
            num_kv_blocks=engine.num_total_blocks,
            decode_weight_bytes=engine.decode_step_weight_bytes,
            log_interval_s=config.server.stats_log_interval_s,
            latency_targets=latency_targets(config),
            target_itl_ratio=config.scheduler.target_itl_ratio,
            vllm_names=config.server.vllm_metric_names,
        )

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The scrape body and its content type: OpenMetrics if the scraper asks for it with
        ``escaping=allow-utf-8`` (Prometheus 3), else the 0.0.4 text format.

        OpenMetrics with any other name escaping (Prometheus 2.x's default Accept header asks
        for ``application/openmetrics-text;version=1.0.0``, which means ``underscores``) is
        not served: prometheus_client (0.26) then writes the samples of ``vllm:*`` families
        as ``vllm_*`` under ``# TYPE vllm:*`` lines, so the scraper stores (or a parser
        finds) none of the names routers and autoscalers read. Colons are valid in metric
        names, so the text format keeps them for every client.
        """
        encoder, content_type = choose_encoder(accept or "")
        if content_type.startswith("application/openmetrics-text") and not _allows_utf8(
            content_type
        ):
            encoder, content_type = generate_latest, CONTENT_TYPE_PLAIN_0_0_4
        return encoder(self.registry), content_type

    # ------------------------------------------------------------------ recording

    def record_occupancy(self, load: EngineOccupancy) -> None:
        """The load gauges: after every step, and when the engine goes idle without one."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_used.set(load.num_kv_blocks_used)
        self.kv_total.set(load.num_kv_blocks_total)
        self.kv_usage.set(load.num_kv_blocks_used / max(load.num_kv_blocks_total, 1))
        self.kv_cached.set(load.num_kv_blocks_cached)
        self.kv_evictable.set(load.num_kv_blocks_evictable)
        self.kv_waste.set(load.kv_waste_fraction)
        if self.vllm is not None:
            self.vllm.record_occupancy(load)

    def record_step(self, stats: StepStats) -> None:
        self.record_occupancy(stats.occupancy)
        num_tokens = stats.num_prefill_tokens + stats.num_decode_tokens + stats.num_padding_tokens
        self.step_tokens.observe(num_tokens)
        self.step_duration.observe(stats.step_time_s)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        if stats.num_spec_verifications:
            self.spec_drafts.inc(stats.num_draft_tokens)
            self.spec_accepted.inc(stats.num_accepted_tokens)
            self.spec_verifications.inc(stats.num_spec_verifications)
            self.spec_draft_time.observe(stats.spec_draft_s)
            self.spec_accept_time.observe(stats.spec_accept_s)
        self.weight_bytes.inc(stats.weight_bytes)
        self.kv_bytes_read.inc(stats.kv_bytes_read)
        self.kv_bytes_written.inc(stats.kv_bytes_written)
        self.flops.inc(stats.flops)
        for phase, seconds in stats.phase_s.items():
            self._series(self._step_phase, phase).inc(seconds)
        if stats.replay:
            self._series(self._step_replay, stats.replay).inc()
        self._record_utilization(stats)
        self._record_target(stats)
        self._stats_log.add(stats, self.last_mbu)
        if self.vllm is not None:
            self.vllm.record_step(stats)

    def _record_target(self, stats: StepStats) -> None:
        if stats.predicted_step_s is not None and stats.step_time_s > 0:
            self.prediction_ratio.observe(stats.predicted_step_s / stats.step_time_s)
        if stats.target_prefill_cap is not None:
            self.target_prefill_cap.observe(stats.target_prefill_cap)
        if stats.target_met is not None:
            self.target_steps.inc()
            if stats.target_met:
                self.target_steps_met.inc()
        if stats.target_ttft_boost:
            self.target_ttft_boosts.inc()
        if stats.target_conflict:
            self.target_conflicts.inc()

    def _record_utilization(self, stats: StepStats) -> None:
        step = self._utilization.add(stats)
        if step is None:
            return
        self.bandwidth.set(step.bandwidth)
        self.flops_rate.set(step.flops_rate)
        # The ratio gauges exist (are bound) exactly when their peak is known, and then the
        # tracker returns both ratios.
        if step.mbu is not None:
            self.last_mbu = step.mbu
            self.mbu.set(step.mbu)
            self.mbu_smoothed.set(step.mbu_smoothed)
        if step.mfu is not None:
            self.mfu.set(step.mfu)
            self.mfu_smoothed.set(step.mfu_smoothed)

    def record_tokens(self, timings: RequestTimings, num_new_tokens: int) -> None:
        """A choice received ``num_new_tokens`` (``timings.on_tokens`` already ran)."""
        if num_new_tokens <= 0:
            return
        self.generation_tokens.inc(num_new_tokens)
        if timings.num_output_tokens == num_new_tokens:  # its first tokens
            self.prompt_tokens.inc(timings.num_prompt_tokens)
            if timings.ttft_s is not None:
                self.ttft.observe(timings.ttft_s)
        elif timings.last_inter_token_latency_s is not None:
            self.itl.observe(timings.last_inter_token_latency_s)

    def record_request(self, timings: RequestTimings) -> None:
        """A choice ended; call exactly once per choice."""
        reason = timings.finish_reason or "stop"
        self._series(self._finished, reason).inc()
        if reason in ("abort", "error"):
            return
        for histogram, value in (
            (self.e2e, timings.e2e_s),
            (self.tpot, timings.tpot_s),
            (self.queue, timings.queue_s),
            (self.prefill, timings.prefill_s),
            (self.decode, timings.decode_s),
        ):
            if value is not None:
                histogram.observe(max(value, 0.0))
        self.request_prompt_tokens.observe(timings.num_prompt_tokens)
        self.request_generation_tokens.observe(timings.num_output_tokens)

    def record_structured(self, kind: str, num_requests: int, compile_s: float | None) -> None:
        """An HTTP request with a grammar was accepted: ``num_requests`` engine requests
        (its choices) of ``kind``; ``compile_s`` when it compiled the grammar itself."""
        self._series(self._structured, kind).inc(num_requests)
        if compile_s is not None:
            self.grammar_compile.observe(compile_s)

    def record_accepted(self, kind: str | None, num_requests: int) -> None:
        """A generation HTTP request is about to be queued: ``num_requests`` engine requests
        (its choices) constrained by a grammar of ``kind``, or by none."""
        self._series(self._by_constraint, kind or "none").inc(num_requests)

    def record_http(self, handler: str, status: int) -> None:
        self._series(self._http_requests, handler, str(status)).inc()

    def _series(self, family: Any, *labels: str) -> Any:
        """``family.labels(model_name, *labels)``, bound once and kept."""
        key = (id(family), *labels)
        series = self._bound.get(key)
        if series is None:
            series = self._bound[key] = family.labels(self.model_name, *labels)
        return series


def latency_targets(config: ServingConfig) -> dict[str, float]:
    """The latency targets set, in seconds by name (``itl``, ``tpot``, ``ttft``)."""
    scheduler = config.scheduler
    targets = {
        "itl": scheduler.target_itl_ms,
        "tpot": scheduler.target_tpot_ms,
        "ttft": scheduler.target_ttft_ms,
    }
    return {name: ms / 1000.0 for name, ms in targets.items() if ms is not None}


class VLLMNamedSeries:
    """The series routers and autoscalers read, under vLLM's names (``vllm:...``).

    The Gateway API inference extension's endpoint picker (llm-d), vLLM's production-stack
    router and KEDA/HPA examples scrape ``/metrics`` for the "model server protocol" gauges
    under vLLM's names; ``vllm-router`` and ``sglang-router`` poll HTTP endpoints instead
    (server/router_api.py). Each value here is the same figure as a ``pagedserve_*`` series,
    set from the same ``StepStats`` in the same call, so the two names never disagree:

    ==========================================  =============================================
    ``vllm:num_requests_running``               ``pagedserve_num_requests_running``
    ``vllm:num_requests_waiting``               ``pagedserve_num_requests_waiting``
    ``vllm:kv_cache_usage_perc`` (0-1)          ``pagedserve_kv_cache_usage_ratio``
    ``vllm:gpu_cache_usage_perc`` (0-1)         the same; vLLM's name before v0.10, still
                                                read by older endpoint pickers and
                                                production-stack
    ``vllm:prefix_cache_queries_total``         ``pagedserve_prefix_cache_queries_total``
    ``vllm:prefix_cache_hits_total``            ``pagedserve_prefix_cache_hits_total``
    ``vllm:gpu_prefix_cache_{queries,hits}``    the same two counters under vLLM's older names
    ``vllm:cache_config_info``                  labels ``block_size`` and ``num_gpu_blocks``
                                                (the endpoint picker sizes its prefix index
                                                with them), value 1
    ==========================================  =============================================

    Prometheus allows ``:`` in metric names (``[a-zA-Z_:][a-zA-Z0-9_:]*``); by convention it
    marks recording rules, but vLLM exports these names from ``prometheus_client`` and the
    consumers above match them literally, so they are exported as they are. Only these
    series are mirrored, not the histograms: nothing routes on them, and every series
    doubled is scrape and storage cost. ``--no-vllm-metrics`` turns them off.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        *,
        block_size: int | None,
        num_kv_blocks: int | None,
    ) -> None:
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"vllm:{name}", doc, label, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"vllm:{name}", doc, label, registry=registry).labels(model_name)

        # fmt: off
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent")
        self.gpu_kv_usage = gauge("gpu_cache_usage_perc", "KV-cache usage; 1 means 100 "
                                  "percent (vLLM's name before v0.10)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in "
                                      "the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix "
                                   "cache")
        self.gpu_prefix_queries = counter("gpu_prefix_cache_queries", "Prompt tokens looked "
                                          "up in the prefix cache (vLLM's older name)")
        self.gpu_prefix_hits = counter("gpu_prefix_cache_hits", "Prompt tokens found in the "
                                       "prefix cache (vLLM's older name)")
        cache_info = Gauge("vllm:cache_config_info", "KV cache configuration",
                           ["block_size", "num_gpu_blocks"], registry=registry)
        # fmt: on
        cache_info.labels(
            str(block_size) if block_size is not None else "",
            str(num_kv_blocks) if num_kv_blocks is not None else "",
        ).set(1)

    def record_occupancy(self, load: EngineOccupancy) -> None:
        usage = load.num_kv_blocks_used / max(load.num_kv_blocks_total, 1)
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_usage.set(usage)
        self.gpu_kv_usage.set(usage)

    def record_step(self, stats: StepStats) -> None:
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        self.gpu_prefix_queries.inc(stats.prefix_cache_queries)
        self.gpu_prefix_hits.inc(stats.prefix_cache_hits)


def config_info(config: ServingConfig, **resolved: str) -> dict[str, str]:
    """Labels of ``pagedserve_config_info``: the batching mode and what shapes a step."""
    scheduler, kvpool = config.scheduler, config.kvpool
    return {
        "batching": scheduler.batching,
        "block_allocation": scheduler.block_allocation,
        "max_num_seqs": str(scheduler.max_num_seqs),
        "max_num_batched_tokens": str(scheduler.max_num_batched_tokens),
        "prefill_chunk_tokens": str(scheduler.prefill_chunk_tokens),
        "block_size": str(kvpool.block_size),
        "prefix_caching": str(kvpool.enable_prefix_caching).lower(),
        "kv_cache_dtype": kvpool.cache_dtype,
        **resolved,
    }


class HTTPMetricsMiddleware:
    """Counts every HTTP response by route template and status code (plain ASGI).

    Install it outermost (added last) so it also sees the answers of the other middleware
    (413 body limit, 401, 503 backpressure). A request that fails before a response starts
    counts as 500 (what Starlette's error middleware answers), or 499 if it was cancelled
    because the client went away. Paths that match no route count as ``other``, so random
    URLs cannot grow the label set.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        except asyncio.CancelledError:
            status = status if status is not None else 499
            raise
        except Exception:
            status = status if status is not None else 500
            raise
        finally:
            self.metrics.record_http(_handler(scope), status if status is not None else 500)


def _allows_utf8(content_type: str) -> bool:
    """Whether a negotiated content type writes metric names as they are (no escaping)."""
    params = (p.strip().replace(" ", "") for p in content_type.split(";")[1:])
    return "escaping=allow-utf-8" in params


def _handler(scope: Scope) -> str:
    route_path = getattr(scope.get("route"), "path", None)
    if isinstance(route_path, str):
        return route_path
    # Answered before routing (e.g. a 413 from the body-size limit): the raw path if it is
    # one of the app's routes.
    app = scope.get("app")
    paths = {getattr(r, "path", None) for r in getattr(app, "routes", ())}
    path = scope.get("path", "")
    return path if path in paths else "other"
