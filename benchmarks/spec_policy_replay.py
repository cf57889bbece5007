"""How many drafts to propose, replayed offline: the acceptance-aware policy against fixed k.

    python -m benchmarks.spec_policy_replay                     # 8 grounded + 4 free outputs
    python -m benchmarks.spec_policy_replay --row-costs 0.2,0.3,0.4 --prompts 4

Greedy verification is exact, so a request's output is the same whatever it proposes; and an
n-gram proposal depends only on the tokens so far. So one greedy generation per prompt
(speculation off) fixes everything a policy's choices lead to: at each point, the policy says
``k``, ``propose_ngram`` gives the drafts, the output says how many are kept, and the step
emits that many plus one. The replay scores a policy by **output tokens per unit of step
cost**, a step of ``k`` drafts costing ``1 + k c`` one-row decode steps for the true row cost
``c``: at concurrency 1 that is the TPOT ratio speculation would give if a step cost exactly
that, free of the machine's noise. Each policy is replayed at each true ``c`` with its own
``--speculative-row-cost`` set to that ``c`` too (the policy as if tuned for the machine),
and the engine's default policy (row cost ``default_row_cost("cpu")``) beside them.

Prompts are the benchmark's (benchmarks/speculative.py): grounded copies of Python's
documentation and free-generation stories.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.spec_decode.config import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.policy import CPU_STEP_TOKENS, SpeculationPolicy, default_row_cost


@dataclass(frozen=True, slots=True)
class Replay:
    tokens: int  # output tokens after the first (the first comes from the prefill)
    cost: float  # sum over steps of 1 + c * drafts
    drafts: int
    kept: int


def replay(
    prompt: Sequence[int], output: Sequence[int], policy: SpeculationPolicy, row_cost: float,
    ngram_min: int = DEFAULT_NGRAM_MIN, ngram_max: int = DEFAULT_NGRAM_MAX,
) -> Replay:  # fmt: skip
    """Decode ``output`` (after its first token) as the engine would at concurrency 1 with
    ``policy`` choosing the drafts; a step of k drafts costs ``1 + k row_cost``."""
    history = list(prompt) + list(output[:1])
    t, cost, drafts, kept = 1, 0.0, 0, 0
    while t < len(output):
        policy.begin_step()
        k = policy.wanted("r") if policy.may_propose("r") else 0
        k = min(k, len(output) - t - 1)  # the engine leaves room for the bonus token
        proposal = propose_ngram(history, ngram_min, ngram_max, k) if k > 0 else []
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == output[t + accepted]:
            accepted += 1
        if proposal:
            policy.observe("r", len(proposal), accepted)
        history += output[t : t + accepted + 1]
        t += accepted + 1
        cost += 1 + row_cost * len(proposal)
        drafts += len(proposal)
        kept += accepted
    return Replay(len(output) - 1, cost, drafts, kept)


def fixed_k(k: int) -> Callable[[float], SpeculationPolicy]:
    """A policy that always proposes k (row cost 0 turns the acceptance rule off)."""
    return lambda _c: SpeculationPolicy(k, CPU_STEP_TOKENS, row_cost=0.0)


def score(
    pairs: Sequence[tuple[list[int], list[int]]], make: Callable[[float], SpeculationPolicy],
    row_cost: float,
) -> float:  # fmt: skip
    """Tokens per unit of step cost over every (prompt, output) pair, each with a fresh policy."""
    runs = [replay(p, o, make(row_cost), row_cost) for p, o in pairs]
    return sum(r.tokens for r in runs) / sum(r.cost for r in runs)


def generate(num_grounded: int, num_free: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Greedy outputs of the speculative benchmark's prompts (speculation off)."""
    from benchmarks.speculative import grounded_ids, story_ids
    from engine.llm import LLM
    from scheduler.request import SamplingParams

    llm = LLM("default", enable_prefix_caching=False, num_kv_blocks=2048)
    parts: dict[str, list[tuple[list[int], list[int]]]] = {}
    for name, prompts, max_tokens in (
        ("grounded", [grounded_ids(llm, i, 150) for i in range(num_grounded)], 128),
        ("free", [story_ids(llm, i) for i in range(num_free)], 64),
    ):
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
        parts[name] = [(p, list(o.token_ids)) for p, o in zip(prompts, outs, strict=True)]
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.spec_policy_replay", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--row-costs", default="0.2,0.3,0.4", help="true row costs to score at")
    ap.add_argument("--prompts", type=int, default=8, help="grounded prompts (free: half)")
    ap.add_argument(
        "--outputs", type=Path, default=None,
        help="a JSON of {part: [[prompt, output], ...]} to reuse (written if absent)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    costs = [float(c) for c in args.row_costs.split(",") if c]
    if args.outputs is not None and args.outputs.exists():
        parts = json.loads(args.outputs.read_text())
    else:
        parts = generate(args.prompts, max(1, args.prompts // 2))
        if args.outputs is not None:
            args.outputs.write_text(json.dumps(parts))
    default_c = default_row_cost("cpu")
    policies: list[tuple[str, Callable[[float], SpeculationPolicy]]] = [
        ("acceptance-aware, row cost = c", lambda c: SpeculationPolicy(args.k, CPU_STEP_TOKENS, c)),
        (f"acceptance-aware, row cost {default_c}",
         lambda _c: SpeculationPolicy(args.k, CPU_STEP_TOKENS, default_c)),
        *[(f"always k={k}", fixed_k(k)) for k in range(1, args.k + 1)],
    ]  # fmt: skip
    print(f"output tokens per unit of step cost (a decode step = 1, a step of k drafts 1 + k c); "
          f"prompts: {', '.join(f'{len(v)} {k}' for k, v in parts.items())}")  # fmt: skip
    for part, pairs in parts.items():
        print(f"\n{part}:")
        print(f"  {'policy':34s}" + "".join(f"  c={c:<5}" for c in costs))
        for name, make in policies:
            print(f"  {name:34s}" + "".join(f"  {score(pairs, make, c):7.3f}" for c in costs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
