"""Throughput of a tiny mixture-of-experts model at concurrency 16 (engine/moe.py).

    python -m benchmarks.moe                 # 16 requests at once, 64 output tokens each
    python -m benchmarks.moe --requests 32 --max-tokens 128

Builds a random Qwen3-MoE (8 experts, 2 per token) with transformers, saves it to a
temporary directory, and serves it offline with all requests submitted at once and
``--max-num-seqs`` equal to their count, greedy, EOS ignored (every request produces exactly
its output length). Beside it, the dense Qwen3 whose MLP has the same parameters a token
runs (intermediate size = 2 x the experts'): the cost of routing and of grouping tokens by
expert. Reports output tokens/s, and the mean experts a decode step ran per layer (what the
MBU byte model counts, engine/cost.py). Random weights: the speed is the real model
shape's, the text is meaningless.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from benchmarks.wave import run_wave
from engine.llm import LLM
from engine.outputs import RequestOutput
from scheduler.request import SamplingParams

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)


def build(path: str, moe: bool) -> None:
    import transformers

    if moe:
        config = transformers.Qwen3MoeConfig(**SHAPE, intermediate_size=512, **EXPERTS)
    else:  # what one token runs: 2 experts of 256
        config = transformers.Qwen3Config(**SHAPE, intermediate_size=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)


def run(path: str, requests: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=requests, num_kv_blocks=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (prompt_len,), generator=g).tolist()
               for _ in range(requests)]  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    engine = llm.engine
    touched: list[int] = []

    def on_step(outputs: list[RequestOutput]) -> None:
        stats = engine.last_step_stats
        experts = engine.model.experts_touched()
        if stats is not None and stats.num_prefill_tokens == 0 and experts is not None:
            touched.append(experts)

    wave = run_wave(engine, prompts, params, tag="r", on_step=on_step)
    mc = engine.model_config
    result = {"output_tokens_per_s": wave.output_tokens / wave.seconds, "seconds": wave.seconds}
    if touched:
        result["mean_experts_per_layer_per_decode_step"] = (
            sum(touched) / len(touched) / sum(mc.layer_is_moe())
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="submitted at once")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    report = {}
    for name, moe in (("qwen3_moe 8x256, top 2", True), ("qwen3 dense, 512", False)):
        with tempfile.TemporaryDirectory() as path:
            build(path, moe)
            report[name] = run(path, args.requests, args.prompt_len, args.max_tokens)
    print(json.dumps({"concurrency": args.requests, **report}, indent=2))


if __name__ == "__main__":
    main()
