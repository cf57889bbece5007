"""Several GPUs in the planner: TP shards, all-reduce traffic, the fewest GPUs, the KV table.

Every expected figure is worked out by hand in the comment beside it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.tp_layout import TPLayout
from planner.cli import main
from planner.devices import LINKS, default_link, get_device
from planner.models import load_model
from planner.parallel import (
    allreduce_bytes,
    allreduce_bytes_per_token,
    fewest_gpus,
    gib,
    kv_bytes_per_token,
    kv_cache_table,
    logits_gather_bytes,
    params_per_gpu,
    plan_tp,
    tp_padding,
    tp_size_problem,
)

LLAMA2_70B = load_model("llama-2-70b").config  # h 8192, i 28672, L 80, H 64, H_kv 8, V 32000
LLAMA3_8B = load_model("llama-3-8b").config  # h 4096, L 32, H 32, H_kv 8, d 128, V 128256


def _bf16(**kw: int) -> dict[str, object]:
    return dict(weight_dtype="bf16", kv_dtype="bf16", activation_dtype="bf16", **kw)


def test_params_per_gpu_llama2_70b_on_4() -> None:
    # Per layer: q and o 2 * 8192 * (64*128/4 = 2048) = 33,554,432; k and v
    # 2 * 8192 * (2 heads * 128) = 4,194,304; MLP 3 * 8192 * 28672 / 4 = 176,160,768;
    # norms 2 * 8192 = 16,384; sum 213,925,888, x 80 = 17,114,071,040. Embedding and head
    # 2 * (32000 / 4) * 8192 = 131,072,000; final norm 8,192.
    assert params_per_gpu(LLAMA2_70B, 4) == 17_114_071_040 + 131_072_000 + 8_192
    # One GPU holds the whole model.
    assert params_per_gpu(LLAMA2_70B, 1) == 68_976_648_192


def test_kv_heads_pad_beyond_their_count() -> None:
    # 16 GPUs, 8 KV heads: the engine pads them to 16, one per GPU (and the 64 query heads to
    # 128, 8 per GPU), so KV per token per GPU is 2 * 80 * 1 * 128 * 2 = 40,960 bytes, not
    # half of it.
    tp = plan_tp(LLAMA2_70B, get_device("h100-sxm"), LINKS["nvlink4"], 16,
                 **_bf16(batch=1, tokens_per_sequence=100))  # fmt: skip
    assert tp.problem is None
    assert tp.kv_heads_per_gpu == 1
    assert tp.kv_bytes_per_token_per_gpu == 40_960
    assert tp.padding == "query heads 64 -> 128, KV heads 8 -> 16"
    # Per layer: q and o 2 * 8192 * 8 * 128 = 16,777,216; k and v 2 * 8192 * 128 = 2,097,152;
    # MLP 3 * 8192 * 1,792 = 44,040,192; norms 16,384: 62,930,944, x 80 = 5,034,475,520.
    # Embedding and head 2 * 2,000 * 8192 = 32,768,000; final norm 8,192.
    assert tp.params_per_gpu == 5_034_475_520 + 32_768_000 + 8_192


def test_sizes_that_do_not_divide_are_padded_as_the_engine_pads() -> None:
    # Llama 2 70B on 3: KV heads 8 -> 9 (3 each), query heads 9 x 8 = 72 (24 each),
    # intermediate 28,672 -> 28,674 (9,558 each), vocabulary 32,000 -> 32,001 (10,667 each).
    assert tp_size_problem(LLAMA2_70B, 3) is None
    assert tp_padding(LLAMA2_70B, 3) == (
        "query heads 64 -> 72, KV heads 8 -> 9, intermediate 28672 -> 28674, "
        "vocabulary 32000 -> 32001"
    )
    assert tp_padding(LLAMA2_70B, 4) is None and tp_padding(LLAMA2_70B, 1) is None
    # The planner's counts are the engine's: one TPLayout for both.
    layout = TPLayout.of(LLAMA2_70B, 3)
    assert (layout.num_local_heads, layout.num_local_kv_heads) == (24, 3)
    assert (layout.local_intermediate_size, layout.local_vocab_size) == (9_558, 10_667)
    # Per layer: q and o 2 * 8192 * 24 * 128 = 50,331,648; k and v 2 * 8192 * 3 * 128 =
    # 6,291,456; MLP 3 * 8192 * 9,558 = 234,897,408; norms 16,384: 291,536,896, x 80 =
    # 23,322,951,680. Embedding and head 2 * 10,667 * 8192 = 174,768,128; final norm 8,192.
    assert params_per_gpu(LLAMA2_70B, 3) == 23_322_951_680 + 174_768_128 + 8_192
    tp = plan_tp(LLAMA2_70B, get_device("a100-40gb"), LINKS["nvlink3"], 3,
                 **_bf16(batch=1, tokens_per_sequence=100))  # fmt: skip
    assert tp.problem is None and tp.kv_heads_per_gpu == 3
    # KV per token per GPU: 2 * 80 * 3 * 128 * 2 = 122,880 bytes (the padding head's too).
    assert tp.kv_bytes_per_token_per_gpu == 122_880


def test_only_what_no_size_can_shard_is_refused() -> None:
    # 6 query heads over 4 KV heads are not whole groups: refused at every N, as the engine
    # refuses it (engine/tp_layout.py), with the engine's line.
    odd = dataclasses.replace(LLAMA3_8B, num_heads=6, num_kv_heads=4)
    for n in (2, 3):
        assert "multiple of num_kv_heads (4)" in (tp_size_problem(odd, n) or "")
    assert tp_size_problem(odd, 1) is None  # one GPU runs it unsharded
    moe = dataclasses.replace(LLAMA3_8B, model_type="mixtral", num_experts=8)
    assert "mixture of experts" in (tp_size_problem(moe, 2) or "")
    assert tp_size_problem(moe, 1) is None
    assert not plan_tp(odd, get_device("a100-40gb"), LINKS["nvlink3"], 2,
                       **_bf16(batch=1, tokens_per_sequence=1)).fits  # fmt: skip
    assert tp_size_problem(LLAMA2_70B, 12) is None
    with pytest.raises(ValueError, match="at least 1"):
        plan_tp(LLAMA2_70B, get_device("a100-40gb"), LINKS["nvlink3"], 0,
                **_bf16(batch=1, tokens_per_sequence=1))  # fmt: skip


def test_allreduce_traffic_per_token() -> None:
    # Ring all-reduce of S bytes over N GPUs: each sends 2 (N-1)/N S; over 4 GPUs, 1.5 S.
    assert allreduce_bytes(1000, 4) == 1500
    assert allreduce_bytes(1000, 1) == 0
    # Llama 2 70B, bf16, 4 GPUs: 2 all-reduces x 80 layers x 1.5 x 8192 x 2 bytes.
    assert allreduce_bytes_per_token(LLAMA2_70B, 4, 2) == 3_932_160
    # Logits: rank 0 receives 3 shards of 32000 / 4 = 8000 bf16 values.
    assert logits_gather_bytes(LLAMA2_70B, 4, 2) == 48_000
    tp = plan_tp(LLAMA2_70B, get_device("a100-40gb"), LINKS["nvlink3"], 4,
                 **_bf16(batch=8, tokens_per_sequence=500))  # fmt: skip
    # NVLink 3 moves 300 GB/s each way: 3,932,160 / 300e9 = 13.1072 us per token; a decode
    # step of 8 tokens 104.8576 us.
    assert tp.allreduce_time_per_token_s == pytest.approx(13.1072e-6)
    assert tp.decode_step_allreduce_time_s == pytest.approx(104.8576e-6)
    assert tp.allreduces_per_step == 160
    # Weights per GPU: 17,245,151,232 params x 2 bytes, streamed at 1,555 GB/s.
    assert tp.weight_bytes_per_gpu == 34_490_302_464
    assert tp.decode_step_weight_time_s == pytest.approx(34_490_302_464 / 1555e9)


def test_fewest_gpus_llama2_70b() -> None:
    a100_40 = get_device("a100-40gb")
    # bf16 weights are 137.95 GB: 1 GPU no, 2 GPUs 68.98 GB each no, 3 (padded) hold
    # 47.00 GB each no, 4 hold 34.49 GB each plus 500 tokens x 81,920 bytes of KV.
    tp = fewest_gpus(LLAMA2_70B, a100_40, default_link("a100-40gb"),
                     **_bf16(batch=1, tokens_per_sequence=500))  # fmt: skip
    assert tp is not None and tp.tensor_parallel_size == 4
    assert tp.kv_bytes_per_gpu == 500 * 81_920
    # On 80 GB cards, 2 suffice for one request...
    tp = fewest_gpus(LLAMA2_70B, get_device("a100-80gb"), LINKS["nvlink3"],
                     **_bf16(batch=1, tokens_per_sequence=500))  # fmt: skip
    assert tp is not None and tp.tensor_parallel_size == 2
    # ...but not for 64 sequences of 4,096 tokens: at N = 2, 262,144 tokens x 163,840 bytes
    # = 42.95 GB of KV beside 68.98 GB of weights > 80 GB; at N = 3 (padded: 3 KV heads per
    # GPU) 262,144 x 122,880 = 32.21 GB of KV beside 47.00 GB of weights: 79.21 GB fit.
    tp = fewest_gpus(LLAMA2_70B, get_device("h100-sxm"), LINKS["nvlink4"],
                     **_bf16(batch=64, tokens_per_sequence=4096))  # fmt: skip
    assert tp is not None and tp.tensor_parallel_size == 3
    assert tp.weight_bytes_per_gpu + tp.kv_bytes_per_gpu == 46_995_456_000 + 32_212_254_720
    # On 16 GB cards: 8 GPUs hold 17.25 GB each; 9 pad KV heads to 9 (one each), query heads
    # to 72 (8 each), intermediate to 28,674 (3,186 each) and vocabulary to 32,004 (3,556
    # each): per layer 2*8192*8*128 + 2*8192*128 + 3*8192*3186 + 2*8192 = 97,189,888, x 80
    # plus 2 * 3,556 * 8192 + 8192 = 7,833,460,736 params, 15.67 GB, and 500 tokens x 2 * 80
    # * 128 * 2 = 20.48 MB of KV fit in 16 GB. (A runtime that refuses what N does not
    # divide would need 16.)
    tp = fewest_gpus(LLAMA2_70B, get_device("t4"), LINKS["pcie3"],
                     **_bf16(batch=1, tokens_per_sequence=500))  # fmt: skip
    assert tp is not None and tp.tensor_parallel_size == 9
    assert tp.params_per_gpu == 7_833_460_736
    assert tp.padding is not None and "KV heads 8 -> 9" in tp.padding


def test_kv_table_llama3_8b() -> None:
    # k = 2 x 32 layers x 8 KV heads x 128 x B: 131,072 bytes in bf16; fp8/int8 store a
    # float16 scale per token and KV head beside the values: 2 x 32 x 8 x (128 + 2) = 66,560.
    assert kv_bytes_per_token(LLAMA3_8B, "bf16") == 131_072
    table = kv_cache_table(LLAMA3_8B, 8192, ["bf16", "fp8", "int8"], [1, 32],
                           tensor_parallel_size=2)  # fmt: skip
    assert table.dtypes == ("bf16", "fp8", "int8")
    # 32 sequences x 8,192 tokens x 131,072 bytes = 34,359,738,368 bytes = 32 GiB.
    assert table.bytes[1][0] == 34_359_738_368
    assert gib(table.bytes[1][0]) == 32.0
    assert gib(table.bytes[1][1]) == gib(table.bytes[1][2]) == 16.25
    assert gib(table.bytes[0][0]) == 1.0
    # Over 2 GPUs each holds 4 of the 8 KV heads: half.
    assert gib(table.per_gpu_bytes[1][0]) == 16.0


def test_kv_table_takes_a_bytes_per_token_function() -> None:
    # Another layout: one fp32 scale per 16-token block per KV head per layer (K and V)
    # beside int8 values: 65,536 + 2 x 32 x 8 x 4 / 16 = 65,664 bytes per token.
    def per_block_scales(cfg, dtype: str) -> float:  # type: ignore[no-untyped-def]
        values = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
        return values + (2 * cfg.num_layers * cfg.num_kv_heads * 4 / 16 if dtype == "int8" else 0)

    table = kv_cache_table(LLAMA3_8B, 100, ["int8"], [2], bytes_per_token=per_block_scales)
    assert table.bytes_per_token == (65_664,)
    assert table.bytes[0][0] == 2 * 100 * 65_664


def test_cli_several_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "llama-2-70b", "--device", "a100-40gb", "--context", "4096"]
    assert main([*argv, "--tensor-parallel-size", "4", "--kv-table-batches", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 4 x a100-40gb, link nvlink3" in out
    assert "fewest GPUs: 4 x a100-40gb" in out
    # Llama 2 70B k = 327,680 bytes in bf16: 8 x 4,096 x 327,680 = 10,737,418,240 = 10 GiB.
    assert "10,737,418,240 B = 10.00 GiB [2.50]" in out
    assert main([*argv, "--json", "--link", "pcie4", "--link-gbps", "25"]) == 0
    data = json.loads(capsys.readouterr().out)["parallel"]
    assert data["fewest_gpus"]["tensor_parallel_size"] == 4
    assert data["tensor_parallel"]["link_bandwidth"] == 25e9
    assert data["kv_table"]["dtypes"] == ["bf16", "fp8", "int8"]


def test_cli_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "llama-2-70b", "--device", "a100-40gb",
                 "--tensor-parallel-size", "0"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tensor-parallel-size must be at least 1" in err
    with pytest.raises(SystemExit):
        main(["--kv-table-batches", "1,x"])


def test_a_mixture_of_experts_is_one_gpus_or_none(capsys: pytest.CaptureFixture[str]) -> None:
    """Mixtral 8x7B: its experts are not sharded, so one GPU holds all 93 GB of it or it is
    not served; the plan says why, and its step reads the experts a batch runs."""
    mixtral = load_model("mixtral-8x7b").config
    h100 = get_device("h100-sxm")
    one = plan_tp(mixtral, h100, LINKS["nvlink4"], 1, **_bf16(batch=1, tokens_per_sequence=256))
    assert one.params_per_gpu == 46_702_792_704 and not one.fits
    # Batch 1 reads its 2 experts of 8 a layer: 12.75e9 weights plus the input embedding's
    # 0.13e9, which this section counts as read.
    assert one.decode_step_weight_time_s == pytest.approx(2 * 12.88e9 / 3.35e12, rel=1e-3)
    assert (
        fewest_gpus(mixtral, h100, LINKS["nvlink4"], **_bf16(batch=1, tokens_per_sequence=256))
        is None
    )
    assert main(["--model", "mixtral-8x7b", "--device", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "does not hold this workload, and more cannot share it: tensor parallelism does " \
        "not shard a mixture of experts" in out  # fmt: skip
    assert main(["--model", "mixtral-8x7b", "--device", "h200"]) == 0
    assert "fewest GPUs: 1 x h200" in capsys.readouterr().out
