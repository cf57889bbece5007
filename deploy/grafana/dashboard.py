"""Generate the pagedserve Grafana dashboard (deploy/grafana/dashboards/pagedserve.json).

    python deploy/grafana/dashboard.py           # write the JSON
    python deploy/grafana/dashboard.py --check   # exit 1 if the committed JSON is stale

The panels are declared below as plain data (title, unit, PromQL per series) and built with
Grafana's own SDK, ``grafana-foundation-sdk`` (pinned: its output is what is committed, and
tests/deploy/test_dashboard.py fails if the two drift apart). Every PromQL expression here is
evaluated against a real Prometheus scraping a real server by tests/deploy/test_prometheus.py.

Queries use two Grafana variables: ``$model_name`` (a regex over the ``model_name`` label;
"All" is ``.*``) and Grafana's built-in ``$__rate_interval``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders.dashboard import Dashboard, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
from grafana_foundation_sdk.builders.stat import Panel as StatPanel
from grafana_foundation_sdk.builders.timeseries import Panel as TimeseriesPanel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    GridPos,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "pagedserve.json"
# The provisioned datasource (deploy/grafana/provisioning/datasources/prometheus.yml).
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")
SEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class PanelSpec:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (legend, PromQL)
    description: str = ""
    kind: str = "timeseries"  # or "stat"
    width: int = 8
    # A soft maximum: the axis shows at least up to it, and a value above it (MBU > 1 means
    # the peak is set too low) still shows.
    soft_max: float | None = None


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> tuple[tuple[str, str], ...]:
    return tuple(
        (
            f"p{round(q * 100)}",
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
        )
        for q in qs
    )


def rate_sum(metric: str, extra: str = "", by: str = "") -> str:
    selector = SEL + (f", {extra}" if extra else "")
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{{{selector}}}[{RATE}]))"


def _per_busy_second(counters: tuple[str, ...], peak: str) -> str:
    """Windowed utilization: counter rates / engine busy time / peak, per instance."""
    moved = " + ".join(f"sum by (instance) (rate({c}{{{SEL}}}[{RATE}]))" for c in counters)
    busy = f"sum by (instance) (rate(pagedserve_step_duration_seconds_sum{{{SEL}}}[{RATE}]))"
    return f"({moved}) / {busy} / max by (instance) ({peak}{{{SEL}}})"


FINISHED = "pagedserve_requests_finished_total"
BY_CONSTRAINT = "pagedserve_requests_by_constraint_total"
CONSTRAINED = 'constraint!="none"'
HTTP = "pagedserve_http_requests_total"
ERROR, ABORT = 'finished_reason="error"', 'finished_reason="abort"'
HTTP_5XX, HTTP_4XX = 'status=~"5.."', 'status=~"4.."'
PREDICTION = "pagedserve_step_time_prediction_ratio"
LE_LOW, LE_HIGH = 'le="0.8"', 'le="1.2"'  # buckets of server/metrics.py's ratio histogram
BYTES = (
    "pagedserve_weight_bytes_read_total",
    "pagedserve_kv_bytes_read_total",
    "pagedserve_kv_bytes_written_total",
)

ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    ("Latency", (
        PanelSpec("Time to first token", "s", quantiles("pagedserve_time_to_first_token_seconds"),
                  "HTTP arrival to the first token (tokenization and queueing included)."),
        PanelSpec("Time per output token", "s",
                  quantiles("pagedserve_time_per_output_token_seconds"),
                  "Per request: (finish - first token) / (output tokens - 1)."),
        PanelSpec("Inter-token latency", "s", quantiles("pagedserve_inter_token_latency_seconds"),
                  "Gap between consecutive token arrivals of a request."),
        PanelSpec("End-to-end latency and queue time", "s", (
            *(("e2e " + legend, expr) for legend, expr in
              quantiles("pagedserve_e2e_request_latency_seconds", (0.5, 0.99))),
            *(("queue " + legend, expr) for legend, expr in
              quantiles("pagedserve_request_queue_time_seconds", (0.5, 0.99))),
        ), "Queue: HTTP arrival to the request's first engine step."),
        PanelSpec("Prefill and decode time", "s", (
            *(("prefill " + legend, expr) for legend, expr in
              quantiles("pagedserve_request_prefill_time_seconds", (0.5, 0.99))),
            *(("decode " + legend, expr) for legend, expr in
              quantiles("pagedserve_request_decode_time_seconds", (0.5, 0.99))),
        )),
    )),
    ("Throughput and errors", (
        PanelSpec("Requests finished", "reqps", (
            ("{{finished_reason}}", rate_sum(FINISHED, by="finished_reason")),
        ), "Engine requests (one per choice) per second, by finish reason."),
        PanelSpec("Token throughput", "short", (
            ("prompt tokens/s", rate_sum("pagedserve_prompt_tokens_total")),
            ("generation tokens/s", rate_sum("pagedserve_generation_tokens_total")),
        )),
        PanelSpec("Error rate", "percentunit", (
            ("engine errors", f"{rate_sum(FINISHED, ERROR)} / {rate_sum(FINISHED)}"),
            ("aborts", f"{rate_sum(FINISHED, ABORT)} / {rate_sum(FINISHED)}"),
            # A status that never happened has no series: "or vector(0)" reads it as 0.
            ("HTTP 5xx", f"({rate_sum(HTTP, HTTP_5XX)} or vector(0)) / {rate_sum(HTTP)}"),
            ("HTTP 4xx", f"({rate_sum(HTTP, HTTP_4XX)} or vector(0)) / {rate_sum(HTTP)}"),
        ), "Share of finished requests (engine) and of HTTP responses (server) per cause."),
    )),
    ("Efficiency", (
        PanelSpec("MBU (model bandwidth utilization)", "percentunit", (
            ("smoothed", f"pagedserve_mbu_smoothed{{{SEL}}}"),
            ("last step", f"pagedserve_mbu{{{SEL}}}"),
            ("window", _per_busy_second(BYTES, "pagedserve_peak_bandwidth_bytes_per_second")),
        ), "(weight + KV bytes moved) / step time / peak bandwidth; idle time excluded. "
           "Above 100% is possible at batch 1 on CPU: the peak is a DRAM read of 512 MB, far "
           "larger than any cache, while a step reading less than the L3 cache holds (the "
           "default model's GGUF blocks are about 112 MB; the start-up log gives the L3 "
           "size beside the measured peaks) finds much of it in L3, which is faster than "
           "DRAM. Such a reading is honest against DRAM bandwidth, not a wrong peak; a "
           "reading far above 1 with weights larger than the L3 means the peak was measured "
           "under load (see the start-up log's warning).",
            soft_max=1),
        PanelSpec("MFU (model FLOP/s utilization)", "percentunit", (
            ("smoothed", f"pagedserve_mfu_smoothed{{{SEL}}}"),
            ("last step", f"pagedserve_mfu{{{SEL}}}"),
            ("window", _per_busy_second(("pagedserve_flops_total",),
                                        "pagedserve_peak_flops_per_second")),
        ), "Estimated step FLOPs / step time / peak FLOP/s in the serving dtype.", soft_max=1),
        PanelSpec("Achieved vs peak bandwidth", "Bps", (
            ("achieved (last step)", f"pagedserve_achieved_bandwidth_bytes_per_second{{{SEL}}}"),
            ("peak", f"pagedserve_peak_bandwidth_bytes_per_second{{{SEL}}}"),
        )),
    )),
    ("Structured output", (
        PanelSpec("Constrained requests", "percentunit", (
            ("all kinds", f"{rate_sum(BY_CONSTRAINT, CONSTRAINED)} / {rate_sum(BY_CONSTRAINT)}"),
            ("{{constraint}}", f"{rate_sum(BY_CONSTRAINT, CONSTRAINED, by='constraint')} "
                               f"/ ignoring(constraint) group_left {rate_sum(BY_CONSTRAINT)}"),
        ), "Share of accepted engine requests whose output follows a grammar (JSON schema, "
           "regex, choice, EBNF; tool_choice required / named are JSON schemas), in all and "
           "by kind."),
        PanelSpec("Grammar compile time", "s", (
            *quantiles("pagedserve_grammar_compile_seconds", (0.5, 0.99)),
            ("compiles/s", rate_sum("pagedserve_grammar_compile_seconds_count")),
        ), "New grammars only (the cache answers repeats); compiled off the engine thread "
           "while the request waits before the queue."),
    )),
    ("Latency targets", (
        PanelSpec("Steps within the latency targets", "percentunit", (
            ("steps within budget", f"{rate_sum('pagedserve_target_steps_met_total')} / "
                                    f"{rate_sum('pagedserve_target_steps_total')}"),
            ("predictions within 20%",
             f"({rate_sum(PREDICTION + '_bucket', LE_HIGH)} - "
             f"{rate_sum(PREDICTION + '_bucket', LE_LOW)}) / "
             f"{rate_sum(PREDICTION + '_count')}"),
        ), "Share of steps with decodes whose time (with the engine loop's gap before it) kept "
           "the budget --target-itl-ms / --target-itl-ratio / --target-tpot-ms gave them, and "
           "share of steps whose predicted time was within 20% of the measured one.",
           soft_max=1),
        PanelSpec("Inter-token latency vs target", "s", (
            ("ITL p99", quantiles("pagedserve_inter_token_latency_seconds", (0.99,))[0][1]),
            ("TPOT p50", quantiles("pagedserve_time_per_output_token_seconds", (0.5,))[0][1]),
            ("ITL target", f"max(pagedserve_target_itl_seconds{{{SEL}}})"),
            ("TPOT target", f"max(pagedserve_target_tpot_seconds{{{SEL}}})"),
        ), "The latencies the targets keep, beside the targets set."),
        PanelSpec("Step-time prediction (predicted / measured)", "none",
                  quantiles(PREDICTION, (0.1, 0.5, 0.9)),
                  "The latency targets' step-time model against the measured steps; 1 is "
                  "exact.", soft_max=1.5),
        PanelSpec("Prefill chunk chosen per step", "short", (
            *quantiles("pagedserve_target_prefill_cap_tokens", (0.1, 0.5, 0.9)),
        ), "Prompt tokens the targets let a step with decodes compute: its cap, whether or "
           "not prompts filled it. Steps without decodes are not capped and not counted."),
        PanelSpec("TTFT target: boosts and conflicts", "short", (
            ("prefill share grown for TTFT /s", rate_sum("pagedserve_target_ttft_boosts_total")),
            ("TTFT missed even so /s", rate_sum("pagedserve_target_conflicts_total")),
        ), "Steps whose prefill share grew (up to the ITL target) because queued prompts "
           "would miss --target-ttft-ms, and steps where even that misses it."),
    )),
    ("Scheduler and KV cache", (
        PanelSpec("Running and waiting requests", "short", (
            ("running", f"pagedserve_num_requests_running{{{SEL}}}"),
            ("waiting", f"pagedserve_num_requests_waiting{{{SEL}}}"),
        )),
        PanelSpec("KV cache usage", "percentunit", (
            ("blocks used", f"pagedserve_kv_cache_usage_ratio{{{SEL}}}"),
            ("slots wasted (of allocated)", f"pagedserve_kv_waste_ratio{{{SEL}}}"),
            ("prefix-cache hit rate", f"{rate_sum('pagedserve_prefix_cache_hits_total')} "
                                      f"/ {rate_sum('pagedserve_prefix_cache_queries_total')}"),
        ), soft_max=1),
        PanelSpec("KV blocks", "short", (
            ("used", f"pagedserve_kv_blocks_used{{{SEL}}}"),
            ("cached", f"pagedserve_kv_blocks_cached{{{SEL}}}"),
            ("evictable", f"pagedserve_kv_blocks_evictable{{{SEL}}}"),
            ("total", f"pagedserve_kv_blocks_total{{{SEL}}}"),
        )),
        PanelSpec("Preemptions", "short", (
            ("preemptions/s", rate_sum("pagedserve_preemptions_total")),
        ), "Requests preempted (blocks freed, recomputed later) per second."),
        PanelSpec("Tokens per step", "short", quantiles("pagedserve_step_tokens"),
                  "Tokens computed per engine step: prefill chunks + decodes + padding."),
        PanelSpec("Engine step time", "s", quantiles("pagedserve_step_duration_seconds"),
                  "One iteration: schedule, build the batch, forward, sample, update."),
        PanelSpec("Step time by phase", "percentunit", (
            ("{{phase}}", "sum by (phase) (rate(pagedserve_step_phase_seconds_total"
             f"{{{SEL}}}[{RATE}])) / ignoring(phase) group_left "
             "sum(rate(pagedserve_step_phase_seconds_total"
             f"{{{SEL}}}[{RATE}]))"),
        ), "Share of engine step time per phase; all but 'forward' is overhead around the "
           "model (scheduling, input building, sampling, updates, the engine loop)."),
        PanelSpec("Steps by replay", "short", (
            ("{{replay}}", "sum by (replay) (rate(pagedserve_steps_by_replay_total"
             f"{{{SEL}}}[{RATE}]))"),
        ), "Engine steps per second by how their forward pass ran: a CUDA graph (decode_graph, "
           "whole_graph; graph_pieces: cut at attention) or eager (the CPU, --enforce-eager, "
           "or a step larger than the graphs' buckets)."),
        PanelSpec("Speculative decoding: acceptance", "short", (
            ("acceptance rate", f"{rate_sum('pagedserve_spec_decode_accepted_tokens_total')} "
                                f"/ {rate_sum('pagedserve_spec_decode_draft_tokens_total')}"),
            ("mean accepted length",
             f"1 + {rate_sum('pagedserve_spec_decode_accepted_tokens_total')} "
             f"/ {rate_sum('pagedserve_spec_decode_verifications_total')}"),
        ), "Accepted / proposed tokens, and tokens emitted per verified row (accepted drafts "
           "+ the target's own token). No data when speculation is off or auto-disabled."),
        PanelSpec("Speculative decoding: time per step", "s", (
            ("draft p50", "histogram_quantile(0.5, sum by (le) (rate("
             f"pagedserve_spec_decode_draft_seconds_bucket{{{SEL}}}[{RATE}])))"),
            ("accept p50", "histogram_quantile(0.5, sum by (le) (rate("
             f"pagedserve_spec_decode_accept_seconds_bucket{{{SEL}}}[{RATE}])))"),
        ), "Seconds proposing (n-gram lookup or the draft model) and choosing the accepted "
           "drafts from the target's logits, in steps that speculate. The forward pass that "
           "scores the drafts is the step's own (Engine step time)."),
        PanelSpec("Serving configuration", "none", (
            ("{{batching}} batching, {{dtype}} on {{device}}", f"pagedserve_config_info{{{SEL}}}"),
        ), "Batching mode, dtype and device (pagedserve_config_info).", kind="stat"),
    )),
    # One series per scraped server (`instance`): how a router spreads the load over
    # replicas (docker-compose.replicas.yml); a single server shows one line each.
    ("Replicas", (
        PanelSpec("Requests finished per replica", "reqps", (
            ("{{instance}}", rate_sum("pagedserve_requests_finished_total", by="instance")),
        ), "Requests finished per second on each replica.", width=6),
        PanelSpec("Requests in each replica", "short", (
            ("{{instance}}", f"sum by (instance) (pagedserve_num_requests_running{{{SEL}}} "
                             f"+ pagedserve_num_requests_waiting{{{SEL}}})"),
        ), "Running + waiting requests per replica: what a router balances.", width=6),
        PanelSpec("KV cache usage per replica", "percentunit", (
            ("{{instance}}", f"max by (instance) (pagedserve_kv_cache_usage_ratio{{{SEL}}})"),
        ), width=6, soft_max=1),
        PanelSpec("Prefix-cache hit rate per replica", "percentunit", (
            ("{{instance}}", rate_sum("pagedserve_prefix_cache_hits_total", by="instance") + " / "
                             + rate_sum("pagedserve_prefix_cache_queries_total", by="instance")),
        ), "Prompt tokens found cached / looked up, per replica: a prefix-aware router keeps "
           "requests that share a prefix on the replica that holds it.", width=6, soft_max=1),
    )),
)  # fmt: skip


def _target(ref_id: str, legend: str, expr: str) -> PrometheusQuery:
    return PrometheusQuery().expr(expr).legend_format(legend).ref_id(ref_id)


def _panel(spec: PanelSpec) -> TimeseriesPanel | StatPanel:
    panel: TimeseriesPanel | StatPanel
    if spec.kind == "stat":
        panel = (
            StatPanel()
            .text_mode(common.BigValueTextMode.NAME)
            .color_mode(common.BigValueColorMode.NONE)
            .graph_mode(common.BigValueGraphMode.NONE)
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
        )
    else:
        panel = (
            TimeseriesPanel()
            .legend(
                common_builders.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
            .min(0)
        )
        if spec.soft_max is not None:
            panel = panel.axis_soft_max(spec.soft_max)
    panel = panel.title(spec.title).unit(spec.unit).datasource(DATASOURCE)
    panel = panel.grid_pos(GridPos(h=8, w=spec.width))
    if spec.description:
        panel = panel.description(spec.description)
    for i, (legend, expr) in enumerate(spec.queries):
        panel = panel.with_target(_target(chr(ord("A") + i), legend, expr))
    return panel


def build() -> Dashboard:
    model = (
        QueryVariable("model_name")
        .label("Model")
        .datasource(DATASOURCE)
        .query("label_values(pagedserve_config_info, model_name)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .include_all(True)
        .all_value(".*")
        .multi(True)
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )
    dashboard = (
        Dashboard("pagedserve")
        .uid("pagedserve")
        .description("Latency, throughput, errors, MBU/MFU and KV cache; see deploy/README.md")
        .tags(["pagedserve", "llm"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .with_variable(model)
    )
    for title, specs in ROWS:
        dashboard = dashboard.with_row(Row(title))
        for spec in specs:
            dashboard = dashboard.with_panel(_panel(spec))
    return dashboard


def render() -> str:
    body = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    # Grafana needs unique panel ids (rows included); the SDK leaves them unset.
    for i, panel in enumerate(body["panels"], start=1):
        panel["id"] = i
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUTPUT.exists() or OUTPUT.read_text(encoding="utf-8") != text:
            print(f"{OUTPUT} is stale: run python deploy/grafana/dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
