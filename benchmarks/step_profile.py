"""Where a batch-1 decode step's time goes, kernel by kernel, against the memory floor.

    python -m benchmarks.step_profile                          # default and float32 weights
    python -m benchmarks.step_profile --matmul-weights float32 --rounds 5 --out profile.json

``benchmarks.speed`` says how far a batch-1 step is from its floor (weight bytes / memory
bandwidth); this says where the difference lies. Each round probes the machine's read
bandwidth (``planner.cpu.measure_bandwidth``), then decodes one request on the bare engine
(no HTTP: nothing else shares the cores) with the fused C++ stack's step profile on, and
prints for every kernel of a decoder layer, for the final norm and head and for the rest
of the step: its time a step, the bytes it reads, the rate it reads them at, and that rate
as a fraction of the probe's. A matmul well below the probe's rate is streaming badly; a
kernel that reads little but takes long is latency- or compute-bound.

The probe runs between rounds, not during them: the bandwidth this kind of shared machine
gives moves from minute to minute, so compare a round with its own probe.

Needs the C++ CPU kernels (``kernels.cpu``): the profile lives in their fused stack.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from engine.backends.cpu import CpuForward, Matmul
from engine.cost import StepCostModel
from engine.llm import LLM
from kernels import cpu as cpu_kernels
from planner.cpu import measure_bandwidth
from scheduler.request import SamplingParams

# The STEP_KERNELS entries that are matmuls: each is also its DecoderLayer attribute.
MATMULS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The cpu backend's LayerSlots field of each (engine/backends/cpu.py).
_SLOTS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


@dataclass
class Part:
    name: str
    seconds: float  # per decode step
    bytes: float | None = None  # read per decode step, where it is known

    def rate(self) -> float | None:
        return self.bytes / self.seconds if self.bytes and self.seconds > 0 else None


@dataclass
class Round:
    matmul_weights: str
    bandwidth_bytes_s: float  # the probe taken right before the round
    steps: int
    step_s: float  # mean wall time of a decode step
    floor_s: float  # the bytes the step reads / the probe
    float32_floor_s: float  # the float32 weights' bytes / the probe (benchmarks.speed's floor)
    parts: list[Part] = field(default_factory=list)


def read_bytes(matmul: Matmul) -> int:
    """Bytes a one-row matmul reads: its GGUF blocks when it has them (the cpu kernels use
    them for 1 row), else its packed panels, else its plain weight."""
    for t in (matmul.quant, matmul.packed, matmul.w):
        if t is not None:
            return t.numel() * t.element_size()
    raise ValueError("a Linear without weights")


def kv_bytes_per_step(llm: LLM, prompt_tokens: int, output_tokens: int) -> float:
    """Mean K and V bytes one layer's attention reads in a decode step of this request."""
    mc = llm.engine.model_config
    per_token = 2 * mc.num_kv_heads * mc.head_dim * llm.engine.dtype.itemsize
    # Decode step i (1-based) attends to the prompt, the i - 1 tokens before it and itself.
    contexts = [prompt_tokens + i for i in range(1, output_tokens)]
    return per_token * statistics.fmean(contexts) if contexts else 0.0


def profile_round(
    llm: LLM, prompt: list[int], output_tokens: int, bandwidth: float, tag: str
) -> Round:
    engine = llm.engine
    forward = engine.runner.model
    ops = cpu_kernels.load()
    engine.add_request(
        tag, prompt, SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    )
    engine.step()  # the prefill (and the first token): not a decode step
    ops.step_profile(True)
    forward_s = wall_s = 0.0
    steps = 0
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            wall_s += time.perf_counter() - t0
            stats = engine.last_step_stats
            assert stats is not None
            forward_s += stats.phase_s.get("forward", 0.0)
            steps += 1
        kernels = ops.step_profile_read().tolist()
    finally:
        ops.step_profile(False)
    n = len(cpu_kernels.STEP_KERNELS)
    kernel_s, stack_s = kernels[:n], kernels[n]
    layers = forward.spec.layers
    weight_bytes = {
        name: sum(read_bytes(getattr(layer, _SLOTS[name])) for layer in layers) for name in MATMULS
    }
    # A decode step's stack ends with the final norm and the head (decoder_layer.cpp).
    weight_bytes["head"] = read_bytes(forward.spec.head.head)
    kv = kv_bytes_per_step(llm, len(prompt), output_tokens) * len(layers)
    parts = [
        Part(name, seconds / steps, weight_bytes.get(name, kv if name == "attention" else None))
        for name, seconds in zip(cpu_kernels.STEP_KERNELS, kernel_s, strict=True)
    ]
    # The stack's own time: the embedding and RoPE lookups, its buffers, the loop over layers.
    parts.append(Part("stack between kernels", (stack_s - sum(kernel_s)) / steps))
    # The attention plan and the stack call's Python side.
    parts.append(Part("rest of the forward", (forward_s - stack_s) / steps))
    parts.append(Part("outside the forward", (wall_s - forward_s) / steps))
    step_bytes = sum(weight_bytes.values()) + kv
    # benchmarks.speed's decode floor: the float32 layers, final norm and head (the embedding
    # table is not streamed: a step reads one row of it).
    cost = StepCostModel.from_config(engine.model_config, dtype_bytes=4)
    float32_bytes = cost.body_weight_bytes + cost.lm_head_bytes
    return Round(
        matmul_weights=engine.matmul_weights,
        bandwidth_bytes_s=bandwidth,
        steps=steps,
        step_s=wall_s / steps,
        floor_s=step_bytes / bandwidth,
        float32_floor_s=float32_bytes / bandwidth,
        parts=parts,
    )


def format_round(r: Round) -> str:
    lines = [
        f"{r.matmul_weights} weights, probe {r.bandwidth_bytes_s / 1e9:.1f} GB/s, "
        f"{r.steps} decode steps: {r.step_s * 1e3:.2f} ms a step, "
        f"{r.step_s / r.floor_s:.2f}x the floor of the bytes it reads "
        f"({r.floor_s * 1e3:.2f} ms), {r.step_s / r.float32_floor_s:.2f}x the float32 floor "
        f"({r.float32_floor_s * 1e3:.2f} ms)",
        f"  {'part':<22}{'ms/step':>9}{'share':>8}{'MB/step':>9}{'GB/s':>8}{'of probe':>10}",
    ]
    for p in r.parts:
        rate = p.rate()
        mb = f"{p.bytes / 1e6:9.1f}" if p.bytes else f"{'':>9}"
        gbs = f"{rate / 1e9:8.1f}{rate / r.bandwidth_bytes_s:10.2f}" if rate else ""
        lines.append(f"  {p.name:<22}{p.seconds * 1e3:9.3f}{p.seconds / r.step_s:8.1%}{mb}{gbs}")
    return "\n".join(lines)


def run(
    configs: Iterable[str],
    rounds: int,
    prompt_tokens: int,
    output_tokens: int,
    model: str = "default",
    probe: Callable[[], float] | None = None,
) -> list[Round]:
    """Rounds of every configuration in ``configs`` (``matmul_weights`` values), printed as
    they finish. ``probe`` returns the read bandwidth in bytes/s (default: the best of
    ``planner.cpu.measure_bandwidth``'s read probes, a quarter second each)."""
    if probe is None:
        probe = lambda: max(measure_bandwidth(repeats=3, budget_s=0.25))  # noqa: E731
    results = []
    for weights in configs:
        # The C++ kernels' fused stack is a float32 CPU path, on any machine.
        llm = LLM(model, matmul_weights=weights, attention_backend="cpu", device="cpu",
                  dtype="float32")  # fmt: skip
        if not isinstance(llm.engine.runner.model, CpuForward):
            raise SystemExit("the step profile needs the C++ cpu kernels' fused stack")
        vocab = llm.engine.model_config.vocab_size
        prompt = [(1000 + 7 * i) % vocab for i in range(prompt_tokens)]
        # Warm-up: first-call costs (allocations, page faults) stay out of the rounds.
        profile_round(llm, prompt, min(output_tokens, 8), 1.0, "warm-up")
        for i in range(rounds):
            bandwidth = probe()
            r = profile_round(llm, prompt, output_tokens, bandwidth, f"round-{i}")
            print(format_round(r), flush=True)
            results.append(r)
        del llm
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--matmul-weights",
        choices=("gguf", "float32", "both"),
        default="both",
        help="which copy the one-row matmuls read (gguf: the default server's)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", help="also write the rounds as JSON here")
    args = ap.parse_args(argv)
    configs = ("gguf", "float32") if args.matmul_weights == "both" else (args.matmul_weights,)
    if cpu_kernels.load() is None:
        print("the step profile needs the C++ cpu kernels (kernels.cpu)", file=sys.stderr)
        return 1
    results = run(configs, args.rounds, args.prompt_tokens, args.output_tokens, args.model)
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
