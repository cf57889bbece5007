"""What a user gets from ``transformers.generate()`` on the same model and workload.

Batch 1 gives TTFT and TPOT; one static batch of each size B > 1 (B prompts of equal length,
generated together to a fixed length) gives the throughput a user of ``generate()`` would
get by batching by hand, which is what pagedserve at concurrency B is compared with.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


@torch.inference_mode()
def measure_transformers(
    model_dir: Path, prompt_tokens: int, output_tokens: int, static_sizes: list[int]
) -> dict[str, object]:
    """Batch-1 latency and static-batch throughput of ``generate()`` (greedy, EOS ignored).

    Returns:
        ``{"ttft_s", "tpot_s", "tok_s_c1", "static_tok_s": {"16": ..., "64": ...}}``;
        ``tok_s_c1`` is output tokens / wall time of one request, prefill included, as the
        load generator counts pagedserve's throughput at concurrency 1.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)

    def generate(batch: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=n,
            min_new_tokens=n,  # EOS ignored: every request makes exactly n tokens
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    ids = torch.randint(100, 40000, (1, prompt_tokens), generator=g)
    generate(ids, 2)  # warm-up
    ttft = min(generate(ids, 1) for _ in range(3))
    total = generate(ids, output_tokens)
    tpot = (total - ttft) / max(output_tokens - 1, 1)
    static: dict[str, float] = {}
    for size in static_sizes:
        batch = torch.randint(100, 40000, (size, prompt_tokens), generator=g)
        static[str(size)] = size * output_tokens / generate(batch, output_tokens)
    return {
        "ttft_s": ttft,
        "tpot_s": tpot,
        "tok_s_c1": output_tokens / total,
        "static_tok_s": static,
    }
