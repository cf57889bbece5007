"""``pagedserve plan``: the capacity planner's command line.

``server/cli.py`` dispatches ``pagedserve plan ARGS`` to :func:`main`; ``python -m planner``
runs it too.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, NoReturn

from planner.compare import compare, comparison_dict
from planner.devices import (
    DEVICE_NAMES,
    DEVICES,
    LINKS,
    Device,
    Link,
    default_link,
    get_device,
    get_link,
    physical_memory_bytes,
    with_overrides,
)
from planner.dtypes import KV_DTYPES, WEIGHT_DTYPES, canonical_dtype, compute_dtype
from planner.measured import Measured, load_measured
from planner.models import PRESETS, PlannedModel, gguf_blocks, load_model
from planner.parallel import DEFAULT_KV_TABLE_BATCHES, tp_size_problem
from planner.parallel_report import parallel_section, render_parallel
from planner.plan import Plan, Workload, default_dtype, make_plan
from planner.report import (
    render_comparison,
    render_plan,
    render_targets_held,
    render_targets_measured,
)
from planner.targets import Targets, largest_concurrency_held, measured_against

_DEFAULT_PROMPT_TOKENS = 350
_DEFAULT_OUTPUT_TOKENS = 150


class _OneLineParser(argparse.ArgumentParser):
    """A mistake on the command line is one line naming it, not the 19-line usage block
    above it (``--help`` prints that)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="pagedserve plan",
        description="Transformer-inference arithmetic as a capacity planner: ops:byte, "
        "arithmetic intensity, KV cache capacity and lower bounds for prefill and decode; "
        "optionally held against a loadtest result or a live server's /metrics.",
    )
    p.add_argument(
        "--model",
        default="default",
        help=f"'default' (SmolLM2-135M-Instruct), a preset ({', '.join(sorted(PRESETS))}), "
        "an HF directory with config.json, or a .gguf file",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=DEVICE_NAMES,
        metavar="DEVICE",
        help=f"one of {', '.join(DEVICE_NAMES)}; default: this machine's GPU if "
        "torch sees a known one, else cpu",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=WEIGHT_DTYPES + ("float32", "bfloat16", "float16"),
        help="weight dtype (default: fp32 on cpu, bf16 on GPUs, fp16 without bf16)",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=KV_DTYPES + ("float32", "bfloat16", "float16"),
        help="KV cache dtype (default: the weight dtype; 16-bit for quantized weights)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help=f"P, prompt tokens per request (default {_DEFAULT_PROMPT_TOKENS}, or "
        "the measured mean)",
    )
    p.add_argument(
        "--output-tokens",
        type=int,
        default=None,
        help=f"O, output tokens per request (default {_DEFAULT_OUTPUT_TOKENS}, or "
        "the measured mean)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="b, sequences decoding together (default 1, or the measured concurrency)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="sequence length for capacity and attention intensity "
        "(default: the model's max positions)",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GB",
        help="usable device memory in GB (10^9 bytes), overriding the table",
    )
    p.add_argument(
        "--price-per-hour",
        type=float,
        default=None,
        metavar="USD",
        help="device price per hour (the table's figures are examples)",
    )
    p.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        help="memory bandwidth in GB/s, overriding the table or the cpu measurement",
    )
    p.add_argument(
        "--tflops",
        type=float,
        default=None,
        help="peak TFLOP/s of the matmul dtype, overriding the table or measurement",
    )
    p.add_argument(
        "--matmul-weights",
        choices=("gguf", "float32"),
        default="gguf",
        help="cpu, a GGUF model (default included): gguf (as the server by default) plans "
        "small batches on the file's Q4/Q8 blocks; float32 on the float32 weights",
    )
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="cpu: measure bandwidth and FLOP/s again instead of using the cache",
    )
    p.add_argument(
        "--measured",
        default=None,
        metavar="RESULTS.json|URL",
        help="a loadtest result JSON, a Prometheus text file, or a server's "
        "http://host:port/metrics to compare against",
    )
    p.add_argument(
        "--point",
        default=None,
        help="with a multi-point result: compare only this point (label or index)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with a URL: scrape twice, SECONDS apart, to measure throughput",
    )
    p.add_argument(
        "--target-itl-ms",
        type=float,
        default=None,
        help="inter-token latency target (as pagedserve serve takes it): the plan gives the "
        "largest concurrency that keeps the targets",
    )
    p.add_argument(
        "--target-itl-ratio",
        type=float,
        default=None,
        metavar="R",
        help="inter-token latency target relative to the decodes' own step (as pagedserve "
        "serve takes it): a step with prompt tokens at most R times the same decodes alone; "
        "measured as the ITL p99 over its p50",
    )
    p.add_argument("--target-tpot-ms", type=float, default=None, help="TPOT target")
    p.add_argument("--target-ttft-ms", type=float, default=None, help="TTFT target")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="plan N GPUs sharing the model by tensor parallelism: weights and KV per GPU, "
        "all-reduce traffic per token (the fewest GPUs that fit is printed as well)",
    )
    p.add_argument(
        "--link",
        default=None,
        choices=tuple(LINKS),
        help="the GPU-to-GPU link the all-reduces cross (default: the device's usual one)",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="link bandwidth in GB/s per direction, overriding --link's figure",
    )
    p.add_argument(
        "--kv-table-batches",
        type=_int_list,
        default=DEFAULT_KV_TABLE_BATCHES,
        metavar="B1,B2,...",
        help="batch sizes of the KV cache table (default "
        f"{','.join(map(str, DEFAULT_KV_TABLE_BATCHES))})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--list", action="store_true", help="list devices and model presets, then exit")
    return p


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def resolve_link(args: argparse.Namespace, device: Device) -> Link | None:
    """The link TP's all-reduces cross; None on the CPU (its ranks share memory)."""
    if device.name == "cpu":
        return None
    link = get_link(args.link) if args.link else default_link(device.name)
    if args.link_gbps is not None:
        if args.link_gbps <= 0:
            raise ValueError(f"--link-gbps must be positive, got {args.link_gbps}")
        link = replace(link, bandwidth=args.link_gbps * 1e9)
    return link


def _detect_device() -> str:
    """The device to plan for when none is named: a known local GPU, else the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            from planner.devices import device_for_cuda_name

            known = device_for_cuda_name(torch.cuda.get_device_name())
            if known is not None:
                return known.name
    except Exception:  # noqa: BLE001 - a broken CUDA setup still gets a CPU plan
        pass
    return "cpu"


def resolve_device(args: argparse.Namespace, weight_dtype: str | None) -> Device:
    """The device entry with flags applied; ``cpu`` is measured (or read from the cache)."""
    name = args.device or _detect_device()
    if name == "cpu":
        from planner.cpu import cpu_device

        w = canonical_dtype(weight_dtype) if weight_dtype else "fp32"
        # CPU matmuls run in the weight dtype if torch has it, else dequantized to fp32.
        c_dtype = w if w in ("fp32", "bf16", "fp16") else "fp32"
        if args.bandwidth_gbps is not None and args.tflops is not None:
            # Both figures given: nothing to measure.
            device = Device(
                "cpu", "this machine's CPU (figures from flags)", 0.0, physical_memory_bytes(), {}
            )
        else:
            device = cpu_device((c_dtype,), refresh=args.remeasure)
        tflops_dtype = c_dtype
    else:
        device = get_device(name)
        w = canonical_dtype(weight_dtype) if weight_dtype else default_dtype(device)
        try:
            tflops_dtype = compute_dtype(w, device.peak_flops)
        except ValueError:
            if args.tflops is None:
                raise
            tflops_dtype = w  # the user supplies the missing peak
    return with_overrides(
        device,
        bandwidth_gbps=args.bandwidth_gbps,
        tflops=args.tflops,
        tflops_dtype=tflops_dtype,
        memory_gb=args.gpu_memory,
        price_per_hour=args.price_per_hour,
    )


def _workload(args: argparse.Namespace, measured: Measured | None) -> Workload:
    """Flags win; a measurement fills what the flags left out, so like is compared with like."""

    def pick(flag: int | None, seen: float | None, default: int) -> int:
        if flag is not None:
            return flag
        return max(1, round(seen)) if seen else default

    m = measured
    return Workload(
        prompt_tokens=pick(
            args.prompt_tokens, m.prompt_tokens if m else None, _DEFAULT_PROMPT_TOKENS
        ),
        output_tokens=pick(
            args.output_tokens, m.output_tokens if m else None, _DEFAULT_OUTPUT_TOKENS
        ),
        batch=pick(args.batch, m.concurrency if m else None, 1),
        context=args.context,
    )


def _select(points: list[Measured], selector: str | None) -> list[Measured]:
    if selector is None:
        return points
    if selector.isdigit() and int(selector) < len(points):
        return [points[int(selector)]]
    chosen = [p for p in points if p.label == selector]
    if not chosen:
        labels = ", ".join(p.label for p in points)
        raise ValueError(f"no point {selector!r}; the result has: {labels}")
    return chosen


def _list_text() -> str:
    lines = ["devices (dense peaks, example prices):"]
    for d in DEVICES.values():
        peaks = ", ".join(f"{k} {v / 1e12:g}" for k, v in d.peak_flops.items())
        price = f"${d.price_per_hour:.2f}/h" if d.price_per_hour is not None else "-"
        lines.append(
            f"  {d.name:<16}{d.memory_bandwidth / 1e9:>6,.0f} GB/s {d.memory_bytes / 1e9:>5.0f} GB"
            f"  {price:>9}  TFLOP/s: {peaks}"
        )
    lines.append("  cpu             measured on this machine (cached; --bandwidth-gbps/--tflops)")
    lines.append("links (tensor-parallel all-reduces; GB/s each way):")
    for link in LINKS.values():
        lines.append(f"  {link.name:<19}{link.bandwidth / 1e9:>6,.1f}  {link.description}")
    lines.append("model presets: " + ", ".join(sorted(PRESETS)))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Plan (and compare); returns the JSON object and the text rendering."""
    model: PlannedModel = load_model(args.model)
    device = resolve_device(args, args.dtype)
    points = (
        _select(load_measured(args.measured, window_s=args.window), args.point)
        if args.measured
        else []
    )

    blocks, block_rows, cache_bytes = None, 0, None
    if device.name == "cpu":
        from planner.cpu import l3_cache_bytes, max_quant_rows

        cache_bytes = l3_cache_bytes()
        if model.gguf is not None and args.matmul_weights == "gguf":
            blocks, block_rows = gguf_blocks(model.gguf, model.config), max_quant_rows()

    targets = Targets.from_ms(
        args.target_itl_ms, args.target_tpot_ms, args.target_ttft_ms, args.target_itl_ratio
    )

    def plan_for(measured: Measured | None) -> Plan:
        return make_plan(
            model,
            device,
            _workload(args, measured),
            args.dtype,
            args.kv_dtype,
            blocks=blocks,
            block_rows=block_rows,
            cache_bytes=cache_bytes,
            targets=targets if targets.any else None,
        )

    plan = plan_for(points[0] if points else None)
    out: dict[str, Any] = plan.to_dict()
    texts = [render_plan(plan)]
    if args.tensor_parallel_size < 1:
        raise ValueError(
            f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}"
        )
    link = resolve_link(args, device)
    section, tp, fewest, table = parallel_section(
        plan, model.config, device, link, args.tensor_parallel_size, args.kv_table_batches
    )
    out["parallel"] = section
    unshardable = tp_size_problem(model.config, 2)
    texts.append(render_parallel(device, tp, fewest, table, plan.dtypes["kv"], unshardable))
    if points:
        comparisons = []
        checks = []
        for measured in points:
            point_plan = plan if measured is points[0] else plan_for(measured)
            rows = compare(point_plan, measured)
            comparison = comparison_dict(point_plan, measured, rows)
            text = render_comparison(point_plan, measured, rows)
            if targets.any:
                check = measured_against(
                    targets,
                    measured.tpot_s,
                    measured.ttft_s,
                    measured.concurrency,
                    itl_p99_s=measured.itl_p99_s,
                    itl_p50_s=measured.itl_p50_s,
                )
                checks.append(check)
                comparison["latency_targets"] = check
                text += "\n" + render_targets_measured(check)
            comparisons.append(comparison)
            texts.append(text)
        out["comparisons"] = comparisons
        if checks:
            held = largest_concurrency_held(checks)
            out["latency_targets_measured"] = held
            texts.append(render_targets_held(held))
    return out, "\n\n".join(texts)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``pagedserve plan ...`` or ``python -m planner ...``; returns the exit code."""
    arg_list = list(sys.argv[1:] if argv is None else argv)
    if arg_list[:1] == ["plan"]:  # tolerate being handed the subcommand too
        arg_list = arg_list[1:]
    parser = build_parser()
    args = parser.parse_args(arg_list)
    if args.list:
        print(_list_text())
        return 0
    try:
        out, text = run(args)
    except (ValueError, OSError, KeyError) as exc:
        print(f"pagedserve plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2) if args.json else text)
    return 0
