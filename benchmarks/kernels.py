"""Kernel benchmark.

    python -m benchmarks.kernels [--targets] [--fused] [--quick] [--peak-gbps N]
    python -m benchmarks.kernels --sweep [--budget-s S] [--sweep-rows 64x512,256x512]
    python -m benchmarks.kernels --quant-matmul [--budget-s S] [--quant-modes int8,fp8,dense]


Decode paged attention. For each configuration (batch size x context length x GQA shape x
block size) it times

- ``triton``        the Triton decode kernel, split-K chosen by its heuristic (GPU only),
- ``triton-nosplit``  the same with ``num_splits=1``, printed when the heuristic split,
- ``triton-1launch`` / ``triton-2launch``  the heuristic split merged the other way (in the
                    same launch by the last split, or by a second kernel), when it split,
- ``triton-split=N``  the same with ``num_splits=N`` for each N of ``--splits`` (tuning),
- ``triton[w=W,s=S]`` the heuristic split at ``num_warps=W``, ``num_stages=S`` for each pair
                    of ``--warps`` x ``--stages`` (tuning),
- ``flashinfer``, ``flash-attn``  their paged decode on the same cache, where importable,
- ``reference``     ``kernels.reference.paged_attention_decode`` (gather + matmuls in fp32),
- ``sdpa``          ``scaled_dot_product_attention`` on K/V already contiguous per sequence,
- ``sdpa+gather``   the same plus gathering the paged K/V into that contiguous layout,

and prints the time, the achieved bandwidth (bytes of K/V + Q + O + block tables that a
decode step must move, divided by the time; the same byte count for every implementation so
rows compare) and its fraction of the device's peak memory bandwidth. ``--targets`` runs the
issue's rows (Llama-3-8B shape, 32 query / 8 KV heads, head_dim 128, block 16: batch x
context 1 x 512, 16 x 512, 1 x 4,096, 64 x 4,096, 256 x 4,096).

Fused layer ops (``--fused``): ``add_rms_norm_``, ``rms_norm``, ``silu_mul`` and
``rope_and_store_`` of a Llama-3-8B layer (hidden 4,096, intermediate 14,336) at several
token counts, Triton against the PyTorch twin, bandwidth counted on each op's own bytes.

On CUDA the timer is ``triton.testing.do_bench`` (median, L2 flushed between runs). On CPU
the Triton kernels only run under ``TRITON_INTERPRET=1`` (numpy, orders of magnitude slower,
meaningless to time), so the CPU bench compares the reference with SDPA, against a peak
bandwidth measured with a large tensor copy unless ``--peak-gbps`` is given; with
``TRITON_INTERPRET=1`` set it adds the interpreted Triton rows, for their ``max_err`` only.
Every row checks its output against the reference (``max_err``), so a fast wrong kernel shows.

``--sweep`` times the decode kernel's launches (one- and two-launch split-K, split counts,
``num_warps``, ``num_stages``, tile) on the ``--targets`` rows and prints the best per row
beside today's, bounded by ``--budget-s`` (``benchmarks/decode_sweep.py``), at the
Llama-3-8B shape, a model's (``--model qwen2.5-7b``: a preset, or a directory with its
config.json), or those of ``--shapes`` and ``--head-dim``, in ``--dtype``; with
``--write-tuning FILE`` it writes each row's best as a table that
``PAGEDSERVE_ATTENTION_TUNING=FILE`` puts before ``DECODE_TUNING``'s rows, for this benchmark
and the engine alike (``kernels/attention_tuning.py``).

``--quant-matmul`` times the weight-only int8/fp8 matmul's launches (``kernels/quant_matmul.py``:
today's tiles, the heuristic's split-K launch, column strips, split counts, tl.dot or not,
warps, stages, K tiles) on the Llama-3-8B decode matmuls at 1, 4, 16 and 64 rows beside
torch's ``x @ w`` on the bf16 weight, and prints the best per row, bounded by ``--budget-s``
(``benchmarks/quant_matmul_sweep.py``; ``--quick``: a tiny CPU smoke run under
``TRITON_INTERPRET=1``). ``--quant-modes dense`` times the same kernel on the bf16 weight
itself (``dense_matmul``, ``PAGEDSERVE_DECODE_MATMUL=triton``) at up to 16 rows, prefetching
and as programmatic dependent launches too, against cuBLAS.

The issue's figures on an H100/H200 (``make test-gpu`` runs this)::

    python -m benchmarks.kernels --targets --fused
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from benchmarks.decode_cases import (
    TARGET_ROWS,
    Config,
    Inputs,
    gather,
    make_inputs,
    num_input_sets,
    time_cpu,
    time_sets,
)
from kernels import reference
from planner.devices import device_for_cuda_name

if TYPE_CHECKING:
    from engine.config import ModelConfig

# --dtype's names
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def peak_bandwidth(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """(GB/s, where it came from)."""
    if override is not None:
        return override, "--peak-gbps"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        entry = device_for_cuda_name(name)
        if entry is not None:
            return entry.memory_bandwidth / 1e9, f"device table: {entry.description}"
        return None, f"unknown device {name!r}: pass --peak-gbps"
    return measure_copy_bandwidth(), "measured (256 MiB tensor copy, read + write)"


def measure_copy_bandwidth() -> float:
    """CPU stand-in for a datasheet figure: GB/s of a large copy, counting read and write."""
    src = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, well past any cache
    dst = torch.empty_like(src)
    seconds = time_cpu(lambda: dst.copy_(src), min_seconds=0.3)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def sdpa(
    query: torch.Tensor,  # [batch, num_heads, head_dim]
    key: torch.Tensor,  # [batch, num_kv_heads, context_len, head_dim]
    value: torch.Tensor,  # [batch, num_kv_heads, context_len, head_dim]
    scale: float,
) -> torch.Tensor:  # [batch, num_heads, 1, head_dim]
    q = query.unsqueeze(2)  # [batch, num_heads, 1, head_dim]
    if key.shape[1] != query.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, key, value, scale=scale, enable_gqa=True)
        except TypeError:  # torch < 2.5: no enable_gqa, expand the KV heads instead
            group = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(group, dim=1)
            value = value.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, key, value, scale=scale)


def external_decoders(
    x: Inputs, cfg: Config, scale: float
) -> list[tuple[str, Callable[[], torch.Tensor] | None, str]]:
    """FlashInfer's and FlashAttention's paged decode on the same cache, where importable:
    (name, callable or None, why not). Both read the ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` layout ("NHD") through the same block tables."""
    found: list[tuple[str, Callable[[], torch.Tensor] | None, str]] = []
    device = x.query.device
    try:
        import flashinfer

        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        blocks_per_seq = x.block_tables.shape[1]
        indptr = torch.arange(cfg.batch + 1, dtype=torch.int32, device=device) * blocks_per_seq
        last = (cfg.context_len - 1) % cfg.block_size + 1
        last_page_len = torch.full((cfg.batch,), last, dtype=torch.int32, device=device)
        wrapper.plan(indptr, x.block_tables.flatten(), last_page_len, cfg.num_heads,
                     cfg.num_kv_heads, cfg.head_dim, cfg.block_size, data_type=cfg.dtype,
                     sm_scale=scale)  # fmt: skip
        found.append(("flashinfer", lambda: wrapper.run(x.query, (x.key_cache, x.value_cache)),
                      ""))  # fmt: skip
    except Exception as e:  # ImportError, or a version whose API or build does not fit
        found.append(("flashinfer", None, f"{type(e).__name__}: {e}"[:120]))
    try:
        from flash_attn import flash_attn_with_kvcache

        def flash() -> torch.Tensor:
            return flash_attn_with_kvcache(
                x.query.unsqueeze(1), x.key_cache, x.value_cache, cache_seqlens=x.seq_lens,
                block_table=x.block_tables, softmax_scale=scale,
            )  # fmt: skip

        flash()  # FlashAttention 2 wants blocks of a multiple of 256 tokens: fail here
        found.append(("flash-attn", flash, ""))
    except Exception as e:
        found.append(("flash-attn", None, f"{type(e).__name__}: {e}"[:120]))
    return found


def triton_runs_on(device: torch.device) -> bool:
    """Compiled Triton needs CUDA; on CPU only the interpreter runs the kernels."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def bench_config(
    cfg: Config,
    device: torch.device,
    *,
    splits: list[int] | None = None,
    launch_params: list[tuple[int, int]] | None = None,
    externals: bool = False,
    skipped: list[str] | None = None,
) -> list[tuple[str, int, float, float]]:
    """Rows of (implementation, num_splits, seconds, max |output - reference output|).

    ``splits``: extra rows at these forced split counts. ``launch_params``: extra rows of
    the heuristic split at these (num_warps, num_stages). ``externals``: FlashInfer and
    FlashAttention rows where importable (why not, appended to ``skipped``).
    """
    scale = cfg.head_dim**-0.5
    sets = [make_inputs(cfg, device) for _ in range(num_input_sets(cfg.bytes_moved(), device))]
    x = sets[0]
    expected = reference.paged_attention_decode(
        x.query, x.key_cache, x.value_cache, x.block_tables, x.seq_lens, scale
    ).float()
    rows: list[tuple[str, int, float, float]] = []

    def error(out: torch.Tensor) -> float:
        return float((out.float().reshape(expected.shape) - expected).abs().max())

    def add(name: str, num_splits: int, impl: Callable[[Inputs], torch.Tensor],
            capturable: bool = True) -> None:  # fmt: skip
        seconds = time_sets(impl, sets, device, capturable=capturable)
        rows.append((name, num_splits, seconds, error(impl(x))))

    if triton_runs_on(device):
        import kernels.paged_attention as decode_module
        from kernels.paged_attention import paged_attention_decode

        def triton_decode(
            n: int, one_launch: bool | None = None
        ) -> Callable[[Inputs], torch.Tensor]:
            return lambda i: paged_attention_decode(
                i.query, i.key_cache, i.value_cache, i.block_tables, i.seq_lens, scale,
                num_splits=n, one_launch=one_launch,
            )  # fmt: skip

        tuned = decode_module.choose_launch(
            cfg.batch, cfg.num_kv_heads, x.block_tables.shape[1] * cfg.block_size, device,
            head_dim=cfg.head_dim, kv_dtype=x.key_cache.dtype,
        )  # fmt: skip
        chosen = tuned.num_splits
        candidates = [("triton", chosen, None)]
        if chosen > 1:  # the heuristic split with the other merge, and unsplit
            other = "triton-2launch" if tuned.one_launch else "triton-1launch"
            candidates += [(other, chosen, not tuned.one_launch), ("triton-nosplit", 1, None)]
        candidates += [(f"triton-split={n}", n, None) for n in splits or [] if n != chosen]
        for name, n, one_launch in candidates:
            add(name, n, triton_decode(n, one_launch))
        for warps, stages in launch_params or []:
            launch = replace(tuned, num_warps=warps, num_stages=stages)
            add(f"triton[w={warps},s={stages}]", chosen, lambda i, launch=launch: (
                paged_attention_decode(i.query, i.key_cache, i.value_cache, i.block_tables,
                                       i.seq_lens, scale, launch=launch)
            ))  # fmt: skip
    if externals:
        found = [external_decoders(i, cfg, scale) for i in sets]
        for k, (name, fn, why) in enumerate(found[0]):
            if fn is None:
                if skipped is not None and not any(w.startswith(name) for w in skipped):
                    skipped.append(f"{name}: {why}")
                continue
            fns = {id(i): f[k][1] for i, f in zip(sets, found, strict=True)}
            add(name, 1, lambda i, fns=fns: fns[id(i)]())
    # The reference reads the longest context on the host: not capturable.
    add("reference", 1, lambda i: reference.paged_attention_decode(
        i.query, i.key_cache, i.value_cache, i.block_tables, i.seq_lens, scale
    ), capturable=False)  # fmt: skip
    add("sdpa", 1, lambda i: sdpa(i.query, i.key, i.value, scale))

    def gather_then_sdpa(i: Inputs) -> torch.Tensor:
        key = gather(i.key_cache, i.block_tables, cfg.context_len)
        value = gather(i.value_cache, i.block_tables, cfg.context_len)
        return sdpa(i.query, key, value, scale)

    add("sdpa+gather", 1, gather_then_sdpa)
    return rows


@dataclass(frozen=True)
class FusedConfig:
    """One decoder layer's elementwise ops at ``num_tokens`` rows (default: Llama-3-8B)."""

    num_tokens: int
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    def bytes_moved(self, op: str) -> int:
        """Bytes an op must read and write (weights, tables and slots included)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        t, h = self.num_tokens, self.hidden_size
        if op == "add_rms_norm_":  # x, residual in; residual, out; the weight
            return (4 * t * h + h) * elem
        if op == "rms_norm":
            return (2 * t * h + h) * elem
        if op == "silu_mul":  # gate and up in, out
            return 3 * t * self.intermediate_size * elem
        if op == "rope_and_store_":  # the qkv row in; Q back, K and V to the cache; cos, sin
            qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            return (2 * t * qkv + 2 * t * self.head_dim) * elem + 8 * t
        raise ValueError(op)


FUSED_OPS = ("add_rms_norm_", "rms_norm", "silu_mul", "rope_and_store_")


def bench_fused(cfg: FusedConfig, device: torch.device) -> list[tuple[str, str, float, float]]:
    """Rows of (op, implementation, seconds, max |output - torch twin's output|) for each of
    ``FUSED_OPS``: ``triton`` (where Triton runs), its other launches (``triton[w=W]``,
    ``triton[h=8]``, ``triton[pdl]``) and ``torch``, the arithmetic of the engine's plain ops
    (``kernels.reference``); on CUDA its RoPE stores K/V with the Triton ``store_kv``, as
    the engine does there (the reference's store reads the slots on the host, which no CUDA
    graph can hold). Only the op's own call is timed."""
    from kernels._triton_common import pdl_supported
    from kernels.rms_norm import add_rms_norm_, rms_norm
    from kernels.rms_norm import choose_num_warps as rms_norm_warps
    from kernels.rope_and_store import rope_and_store_
    from kernels.silu_mul import silu_mul

    t, h, d = cfg.num_tokens, cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    num_blocks = -(-t // cfg.block_size) + 1

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(cfg.dtype)

    def make_set() -> dict[str, torch.Tensor]:
        angles = torch.rand(t, d, device=device) * 6.3
        key_cache = torch.zeros((num_blocks, cfg.block_size, nkv, d), dtype=cfg.dtype,
                                device=device)  # fmt: skip
        return dict(
            x=randn(t, h), residual=randn(t, h), weight=randn(h),
            gate_up=randn(t, 2 * cfg.intermediate_size), qkv=randn(t, (nh + 2 * nkv) * d),
            cos=angles.cos().to(cfg.dtype), sin=angles.sin().to(cfg.dtype),
            key_cache=key_cache, value_cache=torch.zeros_like(key_cache),
            slots=torch.randperm(num_blocks * cfg.block_size, device=device)[:t],
        )  # fmt: skip

    if device.type == "cuda":
        from kernels.store_kv import store_kv
    else:
        store_kv = reference.store_kv

    def torch_rope_and_store(qkv, cos, sin, key_cache, value_cache, slots, nh, nkv):
        q_and_k = qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d)
        c, s_ = cos.view(t, 1, d), sin.view(t, 1, d)
        half = d // 2
        rotated = q_and_k * c + torch.cat((-q_and_k[..., half:], q_and_k[..., :half]), -1) * s_
        value = qkv[:, (nh + nkv) * d :].view(t, nkv, d)
        store_kv(rotated[:, nh:], value, key_cache, value_cache, slots)
        return rotated[:, :nh]

    def rope(impl: Callable[..., torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return impl(b["qkv"], b["cos"], b["sin"], b["key_cache"], b["value_cache"], b["slots"],
                    nh, nkv)  # fmt: skip

    def outputs(op: str, b: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Everything a call of ``op`` wrote, as one float32 vector: for RoPE + store, Q
        and both caches. Built after the timed calls, outside them: a copy of the caches
        inside would move as many bytes as the op itself."""
        if op == "rope_and_store_":
            out = torch.cat([out.flatten(), b["key_cache"].flatten(), b["value_cache"].flatten()])
        return out.float()

    # Beside each op's default launch: RoPE + store in tiles of 8 heads (5 programs a
    # Llama-3-8B token, none masked, against 2 of 32 heads with 24 of the second's rows
    # masked); the norms at 4 and 16 warps against choose_num_warps' 8 for a row of 4,096
    # (at 2,048 tokens 4 warps fit every row in one wave of the SMs, 8 need two).
    norm_warps = [w for w in (4, 16) if w != rms_norm_warps(h)]
    variants: dict[str, dict[str, Callable[[dict], torch.Tensor]]] = {
        "add_rms_norm_": {
            f"triton[w={w}]": lambda b, w=w: add_rms_norm_(
                b["x"], b["residual"], b["weight"], 1e-5, num_warps=w
            )
            for w in norm_warps
        },
        "rms_norm": {
            f"triton[w={w}]": lambda b, w=w: rms_norm(b["x"], b["weight"], 1e-5, num_warps=w)
            for w in norm_warps
        },
        "rope_and_store_": {
            "triton[h=8]": lambda b: rope(functools.partial(rope_and_store_, block_h=8), b)
        },
    }
    # ... and each op as a programmatic dependent launch (PAGEDSERVE_PDL=1), where the GPU
    # runs one: back to back in the timed graph, each call launches while the one before
    # finishes, as a layer's launches would.
    if triton_runs_on(device) and pdl_supported(device):
        pdl_launches = {
            "add_rms_norm_": lambda b: add_rms_norm_(
                b["x"], b["residual"], b["weight"], 1e-5, pdl=True
            ),
            "rms_norm": lambda b: rms_norm(b["x"], b["weight"], 1e-5, pdl=True),
            "silu_mul": lambda b: silu_mul(b["gate_up"], pdl=True),
            "rope_and_store_": lambda b: rope(functools.partial(rope_and_store_, pdl=True), b),
        }
        for op, launch in pdl_launches.items():
            variants.setdefault(op, {})["triton[pdl]"] = launch
    ops: dict[str, tuple[Callable[[dict], torch.Tensor], Callable[[dict], torch.Tensor]]] = {
        "add_rms_norm_": (
            lambda b: add_rms_norm_(b["x"], b["residual"], b["weight"], 1e-5),
            lambda b: reference.add_rms_norm_(b["x"], b["residual"], b["weight"], 1e-5),
        ),
        "rms_norm": (
            lambda b: rms_norm(b["x"], b["weight"], 1e-5),
            lambda b: reference.rms_norm(b["x"], b["weight"], 1e-5),
        ),
        "silu_mul": (lambda b: silu_mul(b["gate_up"]), lambda b: reference.silu_mul(b["gate_up"])),
        "rope_and_store_": (
            lambda b: rope(rope_and_store_, b), lambda b: rope(torch_rope_and_store, b),
        ),
    }  # fmt: skip
    per_call = max(cfg.bytes_moved(op) for op in FUSED_OPS)
    sets = [make_set() for _ in range(num_input_sets(per_call, device))]
    rows: list[tuple[str, str, float, float]] = []

    def run_on_copy(
        op: str, launch: Callable[[dict], torch.Tensor], first: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        b = {k: v.clone() for k, v in first.items()}
        return outputs(op, b, launch(b))

    for op in FUSED_OPS:
        kernel, twin = ops[op]
        # In-place ops: each compared call gets its own copy of the first set as it was
        # before any of this op's timed calls changed it.
        first = {k: v.clone() for k, v in sets[0].items()}
        expected = run_on_copy(op, twin, first)
        if triton_runs_on(device):
            for impl, launch in {"triton": kernel, **variants.get(op, {})}.items():
                out = run_on_copy(op, launch, first)
                rows.append((op, impl, time_sets(launch, sets, device),
                             float((out - expected).abs().max())))  # fmt: skip
        rows.append((op, "torch", time_sets(twin, sets, device), 0.0))
    return rows


def print_fused(tokens: list[int], dtype: torch.dtype, device: torch.device,
                peak: float | None) -> None:  # fmt: skip
    print()
    print("# fused layer ops, Llama-3-8B layer (hidden 4096, intermediate 14336, 32/8 heads "
          "x 128); GB/s on each op's own bytes")  # fmt: skip
    print(f"{'tokens':>6} {'op':<16} {'impl':<11} {'time_us':>10} {'GB/s':>8} {'%peak':>6} "
          f"{'vs_torch':>8} {'max_err':>8}")  # fmt: skip
    for t in tokens:
        cfg = FusedConfig(t, dtype=dtype)
        rows = bench_fused(cfg, device)
        for op, impl, seconds, err in rows:
            torch_s = next(sec for o, i, sec, _ in rows if o == op and i == "torch")
            gbps = cfg.bytes_moved(op) / seconds / 1e9
            pct = f"{100 * gbps / peak:5.1f}%" if peak else "   n/a"
            print(f"{t:>6} {op:<16} {impl:<11} {seconds * 1e6:>10.1f} {gbps:>8.1f} {pct:>6} "
                  f"{torch_s / seconds:>7.2f}x {err:>8.1e}")  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()


def sweep(args: argparse.Namespace, device: torch.device) -> list[Config]:
    """The configurations to run: a default grid per device, narrowed by any list flag."""
    if args.quick:
        batches, contexts = [1, 4], [256, 1024]
        shapes, block_sizes = [(9, 3)], [16]
    elif device.type == "cuda":
        batches, contexts = [1, 16, 64, 128], [1024, 4096, 16384]
        shapes, block_sizes = [(32, 32), (32, 8), (9, 3), (64, 8)], [16, 32]
    else:
        batches, contexts = [1, 8, 32], [512, 2048]
        shapes, block_sizes = [(9, 3), (32, 8)], [16]
    dtype = DTYPES[args.dtype]
    if args.targets:
        return [Config(b, ctx, 32, 8, 16, 128, dtype) for b, ctx in TARGET_ROWS]
    batches = args.batches or batches
    contexts = args.contexts or contexts
    shapes = args.shapes or shapes
    block_sizes = args.block_sizes or block_sizes
    configs = [
        Config(b, ctx, h, kvh, bs, args.head_dim if (h, kvh) != (9, 3) else 64, dtype)
        for b in batches
        for ctx in contexts
        for h, kvh in shapes
        for bs in block_sizes
    ]
    return [c for c in configs if c.kv_gib() <= args.max_kv_gib]


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _batch_contexts(text: str) -> list[tuple[int, int]]:
    """``64x512,256x512`` -> [(64, 512), (256, 512)]."""
    try:
        pairs = [x.lower().split("x") for x in text.split(",")]
        rows = [(int(b), int(ctx)) for b, ctx in pairs]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected BATCHxCONTEXT,..., e.g. 64x512, not {text!r}"
        ) from None
    if any(b < 1 or ctx < 1 for b, ctx in rows):
        raise argparse.ArgumentTypeError(f"batches and contexts must be positive: {text!r}")
    return rows


def _model_config(name: str) -> ModelConfig:
    """``--model``: a preset's config, or a model's as the server resolves ``--model``
    (``engine.loader.resolve_model``: "default", a checkpoint directory, a .gguf file);
    argparse turns the error into one line."""
    from engine.config import ModelConfig, ModelError
    from engine.loader import read_hf_config, resolve_model
    from engine.presets import PRESETS, preset

    try:
        config = preset(name)
        if config is None:
            config = read_hf_config(resolve_model(name).path)
        return ModelConfig.from_hf(config)
    except ModelError as e:
        names = ", ".join(PRESETS)
        raise argparse.ArgumentTypeError(
            f"{name!r} is neither a preset ({names}) nor a model: {e}"
        ) from None


def _shape_list(text: str) -> list[tuple[int, int]]:
    pairs = [x.split("/") for x in text.split(",")]
    return [(int(q), int(kv)) for q, kv in pairs]


def write_tuning(
    path: str, table: dict[str, Any], env: str, parse: Callable[[Any, str], object],
    case: Callable[[dict[str, Any]], tuple[Any, ...]],
) -> None:  # fmt: skip
    """Write a sweep's tuning ``table`` (JSON) to ``path`` for ``env`` to name, checked by
    the engine's own reader (``parse``) before it is kept. A table already there, swept on
    the same device, keeps its entries for cases (``case``: an entry's sweep case, sortable)
    this sweep did not time, so two sweeps (e.g. ``--sweep`` and ``--sweep --sweep-rows
    64x512``) make one table; entries are written in ``case`` order."""
    entries = {case(e): e for e in table["entries"]}
    kept = 0
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        parse(old, path)
    except FileNotFoundError:
        old = None
    except (OSError, ValueError) as e:
        print(f"# {path} is not a table to add to ({e}): replaced")
        old = None
    if old is not None and old.get("device") == table["device"]:
        for e in old["entries"]:
            if case(e) not in entries:
                entries[case(e)] = e
                kept += 1
        if kept:
            table = {**table, "source": f"{table['source']}; {kept} entries kept from: "
                                        f"{old.get('source', 'unknown')}"}  # fmt: skip
    elif old is not None:
        print(f"# {path} was swept on {old.get('device')}, not {table['device']}: replaced")
    table = {**table, "entries": [entries[k] for k in sorted(entries)]}
    parse(table, path)  # what the engine will read
    with open(path, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"# wrote {len(table['entries'])} entries ({kept} of them kept from the file) to "
          f"{path}: {env}={path} runs them")  # fmt: skip


def _exit_if_broken(cases: list[str]) -> None:
    """A sweep's rows where launches were timed and none ran and matched the reference
    (``cases``) are a broken kernel, not figures: the run exits non-zero naming them (a GPU
    session's summary shows exit statuses, not lines)."""
    if cases:
        raise SystemExit(f"no launch ran and matched the reference on: {', '.join(cases)}")


def _matmul_case(entry: dict[str, Any]) -> tuple[Any, ...]:
    return (entry["weight"], entry["k"], entry["n"], entry["rows"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a small sweep (CPU CI smoke run)")
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak bandwidth, GB/s")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="default: bf16 on CUDA, fp32 on CPU")  # fmt: skip
    parser.add_argument("--head-dim", type=int, default=128,
                        help="head dim of the non-SmolLM2 shapes (9/3 heads use 64); "
                             "--sweep: of every shape it sweeps")  # fmt: skip
    parser.add_argument("--max-kv-gib", type=float, default=4.0,
                        help="skip configurations whose K+V cache exceeds this")  # fmt: skip
    parser.add_argument("--batches", type=_int_list, help="e.g. 1,64 (overrides the sweep)")
    parser.add_argument("--contexts", type=_int_list, help="context lengths, e.g. 4096")
    parser.add_argument("--block-sizes", type=_int_list, help="e.g. 16,32")
    parser.add_argument("--shapes", type=_shape_list,
                        help="query/KV heads, e.g. 32/8,9/3 (GQA ratio = q/kv); --sweep: "
                             "the shapes to sweep (default 32/8, Llama-3-8B's)")  # fmt: skip
    parser.add_argument("--model", type=_model_config, default=None, metavar="PRESET",
                        help="--sweep and --quant-matmul at a model's shapes (a preset of "
                             "engine/presets.py, e.g. qwen2.5-7b, or a directory with its "
                             "config.json) instead of Llama-3-8B's")  # fmt: skip
    parser.add_argument("--targets", action="store_true",
                        help="the issue's decode rows (32/8 heads x 128, block 16): 1x512, "
                             "16x512, 1x4096, 64x4096, 256x4096")  # fmt: skip
    parser.add_argument("--splits", type=_int_list, help="also time these forced split counts")
    parser.add_argument("--warps", type=_int_list, help="also time these num_warps (decode)")
    parser.add_argument("--stages", type=_int_list, help="also time these num_stages (decode)")
    parser.add_argument("--fused", action="store_true",
                        help="also bench the fused layer ops (Triton runs on CUDA or under "
                             "TRITON_INTERPRET=1)")  # fmt: skip
    parser.add_argument("--fused-tokens", type=_int_list, default=[1, 64, 256, 2048],
                        help="token counts of the fused-op rows")  # fmt: skip
    parser.add_argument("--no-decode", action="store_true", help="skip the decode table")
    parser.add_argument("--sweep", action="store_true",
                        help="time the decode kernel's launches on the --targets rows "
                             "(with --quick: one small row, a CPU smoke run)")  # fmt: skip
    parser.add_argument("--sweep-rows", type=_batch_contexts, default=None,
                        help="--sweep: these BATCHxCONTEXT rows instead of the issue's, e.g. "
                             "64x512,256x512")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--sweep / --quant-matmul: time no new launch after this many "
                             "seconds (default 100 / 240)")  # fmt: skip
    parser.add_argument(
        "--quant-matmul",
        action="store_true",
        help="sweep the int8/fp8 weight-only matmul's launches on the "
        "Llama-3-8B decode shapes (with --quick: a tiny CPU smoke run)",
    )
    parser.add_argument("--quant-modes", default="int8,fp8",
                        help="--quant-matmul: weight formats, e.g. int8; dense: "
                             "dense_matmul on the unquantized weight")  # fmt: skip
    parser.add_argument("--quant-rows", type=_int_list, default=None,
                        help="--quant-matmul: row counts M (default 1,4,16,64)")  # fmt: skip
    parser.add_argument("--write-tuning", default=None, metavar="FILE",
                        help="--quant-matmul: write the decode rows' best launches as a "
                             "table for PAGEDSERVE_MATMUL_TUNING (kernels/matmul_tuning.py); "
                             "--sweep: each row's best as a DECODE_TUNING row for "
                             "PAGEDSERVE_ATTENTION_TUNING (kernels/attention_tuning.py). "
                             "Adds to a table of the same device already at FILE")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    torch.manual_seed(0)
    if (args.sweep or args.quant_matmul) and not triton_runs_on(device):
        parser.exit(2, "error: --sweep and --quant-matmul time Triton kernels: they need "
                       "CUDA, or TRITON_INTERPRET=1 with --quick\n")  # fmt: skip
    if args.model is not None and args.shapes:
        parser.exit(2, "error: --model gives the shapes: drop --shapes\n")
    if args.quant_matmul and device.type != "cuda" and not args.quick:
        parser.exit(2, "error: --quant-matmul off CUDA runs only with --quick (the interpreter "
                       "would take hours on the 8B shapes)\n")  # fmt: skip
    from benchmarks.quant_matmul_sweep import ALL_MODES

    quant_modes = tuple(args.quant_modes.split(","))
    if args.quant_matmul and not set(quant_modes) <= set(ALL_MODES):
        parser.exit(2, f"error: --quant-modes takes int8, fp8 and/or dense, not "
                       f"{args.quant_modes}\n")  # fmt: skip

    peak, source = peak_bandwidth(device, args.peak_gbps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    command = f"python -m benchmarks.kernels {' '.join(argv if argv is not None else sys.argv[1:])}"
    dtype = DTYPES[args.dtype]
    print(f"# {command}")
    print(f"# device: {name}; torch {torch.__version__}; dtype {args.dtype}")
    print(f"# peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown'} ({source})")
    from kernels.attention_tuning import ATTENTION_TUNING_ENV, attention_tuning_env

    try:
        tuned = attention_tuning_env()
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    if tuned is not None:
        print(f"# decode launches: {ATTENTION_TUNING_ENV}={tuned.source} ({len(tuned)} rows, "
              f"swept on {tuned.device}) before DECODE_TUNING's")  # fmt: skip
    if args.sweep:
        from benchmarks.decode_sweep import run_sweep, table_order
        from benchmarks.decode_sweep import tuning_table as attention_table
        from benchmarks.provenance import git_commit
        from kernels._common import num_compute_units
        from kernels.attention_tuning import parse_tuning as parse_attention

        heads, head_dim = args.shapes, args.head_dim
        if args.model is not None:
            heads, head_dim = [(args.model.num_heads, args.model.num_kv_heads)], args.model.head_dim
        rows = run_sweep(device, dtype, peak, quick=args.quick, budget_s=args.budget_s or 100.0,
                         batch_contexts=args.sweep_rows, heads=heads,
                         head_dim=head_dim)  # fmt: skip
        if args.write_tuning:
            table = attention_table(rows, num_compute_units(device), name,
                                    f"{command} at {git_commit()}")  # fmt: skip
            write_tuning(args.write_tuning, table, ATTENTION_TUNING_ENV, parse_attention,
                         table_order)  # fmt: skip
        # A row the budget left untimed is said so above and is not broken.
        _exit_if_broken([row.case.strip() for row in rows if row.results and row.best() is None])
        return
    if args.quant_matmul:
        from benchmarks.quant_matmul_sweep import (
            DEFAULT_BUDGET_S,
            ROWS,
            TORCH,
            model_shapes,
            run_quant_sweep,
        )

        shapes = None if args.model is None else model_shapes(args.model)
        rows = run_quant_sweep(device, dtype, peak, quick=args.quick,
                               budget_s=args.budget_s or DEFAULT_BUDGET_S, modes=quant_modes,
                               rows=tuple(args.quant_rows or ROWS), shapes=shapes)  # fmt: skip
        if args.write_tuning:
            from benchmarks.provenance import git_commit
            from benchmarks.quant_matmul_sweep import tuning_table as matmul_table
            from kernels.matmul_tuning import MATMUL_TUNING_ENV
            from kernels.matmul_tuning import parse_tuning as parse_matmul

            table = matmul_table(rows, name, f"{command} at {git_commit()}")
            write_tuning(args.write_tuning, table, MATMUL_TUNING_ENV, parse_matmul,
                         _matmul_case)  # fmt: skip
        # Rows whose Triton launches were timed (torch's matmul runs on every row).
        _exit_if_broken([
            " ".join(row.label.split())
            for row in rows
            if any(launch != TORCH for launch in row.results) and row.best() is None
        ])  # fmt: skip
        return
    if device.type != "cuda":
        print("# CPU: the Triton kernels run here only under TRITON_INTERPRET=1 (numpy, not")
        print("#   worth timing); benching the PyTorch reference against SDPA instead.")
        if triton_runs_on(device):
            print("# TRITON_INTERPRET=1: triton rows are interpreter timings, read max_err only.")
    header = (
        f"{'batch':>5} {'ctx':>6} {'heads':>7} {'bs':>3} {'impl':<15} {'splits':>6} "
        f"{'time_us':>10} {'GB/s':>8} {'%peak':>6} {'vs_gather':>9} {'max_err':>8}"
    )
    launch_params = None
    if args.warps or args.stages:
        from kernels import paged_attention

        launch_params = [
            (w, st)
            for w in args.warps or [paged_attention.NUM_WARPS]
            for st in args.stages or [paged_attention.NUM_STAGES]
        ]
    skipped: list[str] = []
    if not args.no_decode:
        print(header)
    for cfg in [] if args.no_decode else sweep(args, device):
        rows = bench_config(cfg, device, splits=args.splits, launch_params=launch_params,
                            externals=device.type == "cuda", skipped=skipped)  # fmt: skip
        baseline = next(seconds for impl, _, seconds, _ in rows if impl == "sdpa+gather")
        for impl, splits, seconds, err in rows:
            gbps = cfg.bytes_moved() / seconds / 1e9
            pct = f"{100 * gbps / peak:5.1f}%" if peak else "   n/a"
            print(f"{cfg.batch:>5} {cfg.context_len:>6} {cfg.num_heads:>3}/{cfg.num_kv_heads:<3} "
                  f"{cfg.block_size:>3} {impl:<15} {splits:>6} {seconds * 1e6:>10.1f} "
                  f"{gbps:>8.1f} {pct:>6} {baseline / seconds:>8.2f}x {err:>8.1e}")  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for why in skipped:
        print(f"# not benched: {why}")
    if args.fused and (triton_runs_on(device) or device.type == "cpu"):
        print_fused(args.fused_tokens, dtype, device, peak)


if __name__ == "__main__":
    main()
