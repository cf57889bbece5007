"""Serving speed on this machine against its floors and against what users would install.

    python -m benchmarks.speed                       # pagedserve + transformers, 1/4/16
    python -m benchmarks.speed --vllm-cmd "vllm serve {model_dir} --port {port} --dtype float32"

One run measures, side by side and on the same workload (128-token prompts, 64 output
tokens, greedy, EOS ignored):

- the floors: weight bytes / measured memory bandwidth for a decode step at batch 1, and
  prompt FLOPs / measured matmul FLOP/s for a prefill (``planner.cpu``);
- ``transformers.generate()``: TTFT and TPOT at batch 1, and throughput of one static
  batch of 16;
- pagedserve's server (started here as a subprocess on 127.0.0.1) at concurrency 1, 4 and
  16 through the HTTP load generator, plus its own MBU gauge when it exports one;
- optionally any other OpenAI-compatible server started from ``--vllm-cmd``.

It prints a table with the ratios to the floors, and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.config import LoadTestConfig
from loadtest.launcher import ServerProcess, build_command, free_port
from loadtest.run import run_sweep
from planner.cpu import measure_cpu_peaks


def weight_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 4  # float32
    return total


@torch.inference_mode()
def measure_transformers(
    model_dir: Path, prompt_tokens: int, output_tokens: int
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (1, prompt_tokens), generator=g)

    def generate(batch: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    generate(ids, 2)  # warm-up
    ttft = min(generate(ids, 1) for _ in range(3))
    total = generate(ids, output_tokens)
    tpot = (total - ttft) / (output_tokens - 1)
    batch = torch.randint(100, 40000, (16, prompt_tokens), generator=g)
    static_16 = 16 * output_tokens / generate(batch, output_tokens)
    return {"ttft_s": ttft, "tpot_s": tpot, "tok_s_c1": 1 / tpot, "tok_s_static16": static_16}


def measure_server(
    name: str,
    cmd: str,
    model_dir: Path,
    concurrencies: list[int],
    prompt_tokens: int,
    output_tokens: int,
    num_requests: int,
    log_dir: Path,
) -> dict[str, Any]:
    port = free_port()
    argv = build_command(cmd, port=port, host="127.0.0.1", model_dir=str(model_dir))
    server = ServerProcess(argv, port, log_dir / f"{name}.log")
    server.start()
    try:
        server.wait_healthy(timeout_s=600)
        rows: dict[str, Any] = {}
        for c in concurrencies:
            result = run_sweep(
                LoadTestConfig(
                    base_url=server.base_url,
                    concurrencies=(c,),
                    num_requests=max(num_requests, 2 * c),
                    prompt_len=f"fixed:{prompt_tokens}",
                    output_len=f"fixed:{output_tokens}",
                    progress=False,
                    warmup_requests=2,
                )
            )
            point = result.points[0]
            s = point.summary
            metrics = point.server_metrics_after or {}
            mbu = next(
                (v for k, v in metrics.items() if "mbu" in k.lower() and "smooth" not in k), None
            )
            rows[str(c)] = {
                "ttft_p50_s": s.ttft_p50_s,
                "tpot_p50_s": s.tpot_p50_s,
                "output_tok_s": s.output_throughput_tok_s,
                "server_mbu": mbu,
            }
        return rows
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.speed", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=16, help="per concurrency (at least 2x it)")
    ap.add_argument(
        "--pagedserve-cmd", default=f"{sys.executable} -m server --host {{host}} --port {{port}}"
    )
    ap.add_argument("--vllm-cmd", default=None, help="template with {port} and {model_dir}")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default="results/speed.json")
    ap.add_argument(
        "--remeasure", action="store_true", help="measure bandwidth/FLOP/s again, not from cache"
    )
    args = ap.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    from engine.loader import resolve_model

    model_dir = resolve_model("default").path
    peaks = measure_cpu_peaks(("fp32",), refresh=args.remeasure)
    wbytes = weight_bytes(model_dir)
    params = wbytes // 4
    decode_floor = wbytes / peaks.bandwidth
    prefill_floor = 2 * params * args.prompt_tokens / peaks.flops["fp32"]
    print(
        f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"bandwidth {peaks.bandwidth / 1e9:.1f} GB/s, "
        f"matmul {peaks.flops['fp32'] / 1e9:.0f} GFLOP/s"
    )
    print(
        f"floors: decode {decode_floor * 1e3:.1f} ms/token at batch 1 "
        f"({wbytes / 1e6:.0f} MB of weights), "
        f"prefill of {args.prompt_tokens} tokens {prefill_floor * 1e3:.0f} ms"
    )
    log_dir = Path(args.out).parent
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "bandwidth_bytes_s": peaks.bandwidth,
        "matmul_flops": peaks.flops["fp32"],
        "decode_floor_s": decode_floor,
        "prefill_floor_s": prefill_floor,
    }
    servers = {"pagedserve": args.pagedserve_cmd}
    if args.vllm_cmd:
        servers["vllm"] = args.vllm_cmd
    for name, cmd in servers.items():
        result[name] = measure_server(
            name,
            cmd,
            model_dir,
            concurrencies,
            args.prompt_tokens,
            args.output_tokens,
            args.num_requests,
            log_dir,
        )
    if not args.skip_transformers:
        result["transformers"] = measure_transformers(
            model_dir, args.prompt_tokens, args.output_tokens
        )

    print(
        f"\n{'':26}{'conc':>5}{'TTFT ms':>9}{'xfloor':>8}"
        f"{'TPOT ms':>9}{'xfloor':>8}{'MBU':>6}{'tok/s':>8}"
    )
    for name in servers:
        for c, row in result[name].items():
            ttft, tpot = row["ttft_p50_s"], row["tpot_p50_s"]
            mbu = decode_floor / tpot if tpot else float("nan")
            print(
                f"{name:26}{c:>5}{ttft * 1e3:>9.0f}{ttft / prefill_floor:>8.2f}"
                f"{tpot * 1e3:>9.1f}{tpot / decode_floor:>8.2f}{mbu:>6.2f}"
                f"{row['output_tok_s']:>8.1f}"
            )
    if "transformers" in result:
        hf = result["transformers"]
        print(
            f"{'transformers.generate()':26}{1:>5}{hf['ttft_s'] * 1e3:>9.0f}"
            f"{hf['ttft_s'] / prefill_floor:>8.2f}"
            f"{hf['tpot_s'] * 1e3:>9.1f}{hf['tpot_s'] / decode_floor:>8.2f}"
            f"{decode_floor / hf['tpot_s']:>6.2f}{hf['tok_s_c1']:>8.1f}"
        )
        print(f"{'transformers static b=16':26}{16:>5}{'':>34}{hf['tok_s_static16']:>8.1f}")
        ps = result["pagedserve"]
        ratios = ", ".join(
            f"c={c}: "
            f"{row['output_tok_s'] / (hf['tok_s_c1'] if c == '1' else hf['tok_s_static16']):.2f}x"
            for c, row in ps.items()
        )
        print(f"pagedserve / transformers (c=1 vs batch 1, else vs static 16): {ratios}")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
