"""PNG plots of sweep and comparison results. matplotlib is optional.

Without matplotlib every function returns an empty list and the CLI prints a note; nothing
else in loadtest/ depends on it. Plots read the result JSON dicts, so a saved file can be
re-plotted later.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _ok(requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in requests if r["error"] is None and not r["cancelled"]]


def ttft_values(requests: Sequence[dict[str, Any]]) -> list[float]:
    return sorted(r["ttft_s"] for r in _ok(requests) if r["ttft_s"] is not None)


def tpot_values(requests: Sequence[dict[str, Any]]) -> list[float]:
    """Per-request TPOT, same definition as ``stats.tpot``."""
    return sorted(
        (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
        for r in _ok(requests)
        if r["ttft_s"] is not None and r["e2e_s"] is not None and r["output_tokens"] > 1
    )


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if values:
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=label)


def plot_sweep(result: dict[str, Any], prefix: str | Path) -> list[Path]:
    """Throughput-vs-latency curve and TTFT/TPOT CDFs of a sweep.

    Returns:
        The files written (``{prefix}-throughput_latency.png``, ``{prefix}-cdf.png``), or
        ``[]`` when matplotlib is not installed.
    """
    if not matplotlib_available():
        return []
    plt = _pyplot()
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    points = result["points"]
    labels = [p["point"]["label"] for p in points]
    summaries = [p["summary"] for p in points]
    x = [s["output_throughput_tok_s"] for s in summaries]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, name in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99")):
        axes[0].plot(x, [s[key] for s in summaries], marker="o", label=name)
    for key, name in (("tpot_p50_s", "TPOT p50"), ("itl_p99_s", "ITL p99")):
        axes[1].plot(x, [s[key] for s in summaries], marker="o", label=name)
    # Label each point of the TTFT curve with its sweep point (concurrency or rate).
    for xi, yi, label in zip(x, [s["ttft_p50_s"] for s in summaries], labels, strict=True):
        if yi is not None:
            axes[0].annotate(label, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ax, title in zip(axes, ("time to first token", "per-token latency"), strict=True):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['server']['model']}: throughput vs latency")
    fig.tight_layout()
    curve = prefix.with_name(prefix.name + "-throughput_latency.png")
    fig.savefig(curve, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for point, label in zip(points, labels, strict=True):
        _cdf(axes[0], ttft_values(point["requests"]), label)
        _cdf(axes[1], tpot_values(point["requests"]), label)
    for ax, name in zip(axes, ("TTFT (s)", "TPOT (s)"), strict=True):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    cdf = prefix.with_name(prefix.name + "-cdf.png")
    fig.savefig(cdf, dpi=120)
    plt.close(fig)
    return [curve, cdf]


def plot_compare(compare: dict[str, Any], prefix: str | Path) -> list[Path]:
    """Bar chart of the batching modes per scenario, and TTFT CDFs per mode.

    Args:
        compare: the JSON dict written by ``loadtest.compare``.
        prefix: output path prefix.

    Returns:
        ``[{prefix}-modes.png, {prefix}-ttft_cdf.png]``, or ``[]`` without matplotlib.
    """
    if not matplotlib_available():
        return []
    plt = _pyplot()
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    modes = [m["name"] for m in compare["modes"]]
    scenarios = [s["name"] for s in compare["scenarios"]]
    metrics = (
        ("output_throughput_tok_s", "output tokens/s"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("goodput_req_s", "goodput (req/s)"),
    )

    def summary(mode: dict[str, Any], scenario: str) -> dict[str, Any] | None:
        run = mode["runs"].get(scenario)
        return run["points"][0]["summary"] if run and run["points"] else None

    fig, axes = plt.subplots(
        len(scenarios),
        len(metrics),
        figsize=(4 * len(metrics), 3 * len(scenarios)),
        squeeze=False,
    )
    for row, scenario in enumerate(scenarios):
        for col, (key, name) in enumerate(metrics):
            ax = axes[row][col]
            values = []
            for mode in compare["modes"]:
                s = summary(mode, scenario)
                values.append((s or {}).get(key) or 0.0)
            ax.bar(modes, values, color=[f"C{i}" for i in range(len(modes))])
            ax.set_title(f"{scenario}: {name}", fontsize=9)
            ax.tick_params(axis="x", labelsize=8, rotation=20)
            ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    bars = prefix.with_name(prefix.name + "-modes.png")
    fig.savefig(bars, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4), squeeze=False)
    for col, scenario in enumerate(scenarios):
        ax = axes[0][col]
        for mode in compare["modes"]:
            run = mode["runs"].get(scenario)
            if run and run["points"]:
                _cdf(ax, ttft_values(run["points"][0]["requests"]), mode["name"])
        ax.set_title(f"{scenario}: TTFT CDF", fontsize=9)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    cdf = prefix.with_name(prefix.name + "-ttft_cdf.png")
    fig.savefig(cdf, dpi=120)
    plt.close(fig)
    return [bars, cdf]
