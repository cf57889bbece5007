"""The several-GPU part of ``pagedserve plan``: tensor-parallel shards, the fewest GPUs, and
the KV table, computed from a single-device plan and rendered as text."""

from __future__ import annotations

from typing import Any

from engine.config import ModelConfig
from planner.devices import Device, Link
from planner.parallel import (
    DEFAULT_KV_TABLE_BATCHES,
    KVTable,
    TPPlan,
    fewest_gpus,
    gib,
    kv_cache_table,
    kv_table_dtypes,
    plan_tp,
)
from planner.plan import Plan
from planner.report import fmt_bytes, fmt_count, fmt_time


def parallel_section(
    plan: Plan,
    cfg: ModelConfig,
    device: Device,
    link: Link | None,
    tensor_parallel_size: int,
    kv_batches: tuple[int, ...] = DEFAULT_KV_TABLE_BATCHES,
) -> tuple[dict[str, Any], TPPlan | None, TPPlan | None, KVTable]:
    """The JSON of the section, the TP plan at ``tensor_parallel_size``, the fewest GPUs
    (None when no link: the CPU), and the KV table."""
    w = plan.workload
    kwargs = dict(
        weight_dtype=plan.dtypes["weights"],
        kv_dtype=plan.dtypes["kv"],
        activation_dtype=plan.attention["activation_dtype"],
        batch=w["batch"],
        tokens_per_sequence=w["prompt_tokens"] + w["output_tokens"],
    )
    tp = fewest = None
    if link is not None:
        tp = plan_tp(cfg, device, link, tensor_parallel_size, **kwargs)
        fewest = fewest_gpus(cfg, device, link, **kwargs)
    table = kv_cache_table(
        cfg,
        w["context"],
        kv_table_dtypes(plan.dtypes["kv"]),
        kv_batches,
        tensor_parallel_size=tensor_parallel_size,
    )
    out = {
        "tensor_parallel": tp.to_dict() if tp is not None else None,
        "fewest_gpus": fewest.to_dict() if fewest is not None else None,
        "kv_table": table.to_dict(),
    }
    return out, tp, fewest, table


def _tp_rows(tp: TPPlan) -> list[tuple[str, str]]:
    weights = f"{fmt_bytes(tp.weight_bytes_per_gpu)} ({fmt_count(tp.params_per_gpu)} params)"
    fits = f"{fmt_bytes(tp.memory_bytes_per_gpu)}: {'yes' if tp.fits else 'no'}"
    allreduce_time = (
        f"{fmt_time(tp.allreduce_time_per_token_s)} on the link "
        "(bandwidth only; add the per-call latency x count)"
    )
    step = (
        f"weights {fmt_time(tp.decode_step_weight_time_s)} + all-reduce "
        f"{fmt_time(tp.decode_step_allreduce_time_s)} (lower bounds)"
    )
    padded = [("padded (zero weights)", tp.padding)] if tp.padding is not None else []
    return [
        *padded,
        ("weights per GPU", weights),
        ("KV heads per GPU", f"{tp.kv_heads_per_gpu:g}"),
        ("KV per token per GPU", fmt_bytes(tp.kv_bytes_per_token_per_gpu)),
        (f"KV of the workload ({tp.workload_tokens:,} tok)", fmt_bytes(tp.kv_bytes_per_gpu)),
        ("fits in", fits),
        ("KV capacity per GPU", f"{tp.kv_tokens_per_gpu:,} tokens"),
        ("all-reduces per step", f"{tp.allreduces_per_step} (2 per layer)"),
        ("all-reduce bytes / token / GPU", fmt_bytes(tp.allreduce_bytes_per_token)),
        ("all-reduce time / token", allreduce_time),
        ("logits gather / token", f"{fmt_bytes(tp.logits_gather_bytes_per_token)} to rank 0"),
        (f"decode step, batch {tp.decode_batch}", step),
    ]


def render_parallel(
    device: Device,
    tp: TPPlan | None,
    fewest: TPPlan | None,
    table: KVTable,
    default_kv: str,
    unshardable: str | None = None,
) -> str:
    """``unshardable``: why no N > 1 can shard the model (``tp_size_problem``), if so."""
    lines: list[str] = []
    if tp is not None:
        n = tp.tensor_parallel_size
        lines.append(f"tensor parallel: {n} x {device.name}, link {tp.link} "
                     f"({tp.link_bandwidth / 1e9:,.1f} GB/s each way)")  # fmt: skip
        if tp.problem is not None:
            lines.append(f"  cannot shard: {tp.problem}")
        else:
            lines += [f"  {label:<32}{value}" for label, value in _tp_rows(tp)]
        if fewest is None and tp.problem is not None:
            lines.append(f"  fewest GPUs: one {device.name} does not hold this workload")
        elif fewest is None and unshardable is not None:
            lines.append(f"  fewest GPUs: one {device.name} does not hold this workload, and "
                         f"more cannot share it: {unshardable}")  # fmt: skip
        elif fewest is None:
            lines.append(f"  fewest GPUs: none up to 64 x {device.name} hold this workload")
        else:
            lines.append(
                f"  fewest GPUs: {fewest.tensor_parallel_size} x {device.name} "
                f"({fmt_bytes(fewest.weight_bytes_per_gpu)} weights + "
                f"{fmt_bytes(fewest.kv_bytes_per_gpu)} KV per GPU"
                + (f"; padded: {fewest.padding})" if fewest.padding is not None else ")")
            )
        lines.append("")
    per_gpu = table.tensor_parallel_size > 1 and tp is not None
    title = f"KV cache at {table.context:,} tokens per sequence"
    lines.append(title + (f" (per GPU of {table.tensor_parallel_size} in brackets)" if per_gpu
                          else ""))  # fmt: skip
    labels = [f"auto ({d})" if d == default_kv else d for d in table.dtypes]
    grid = [[f"{fmt_bytes(k)} / token" for k in table.bytes_per_token]]
    for r in range(len(table.batches)):
        row = []
        for c in range(len(table.dtypes)):
            total = table.bytes[r][c]
            cell = f"{total:,.0f} B = {gib(total):,.2f} GiB"
            if per_gpu:
                cell += f" [{gib(table.per_gpu_bytes[r][c]):,.2f}]"
            row.append(cell)
        grid.append(row)
    widths = [max(len(labels[c]), *(len(row[c]) for row in grid)) for c in range(len(labels))]
    lines.append(
        f"  {'batch':>6}" + "".join(f"  {x:>{w}}" for x, w in zip(labels, widths, strict=True))
    )
    for b, row in zip(("", *table.batches), grid, strict=True):
        lines.append(f"  {b:>6}" + "".join(f"  {x:>{w}}" for x, w in zip(row, widths, strict=True)))
    return "\n".join(lines)
