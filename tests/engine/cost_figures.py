"""A step-cost model of SmolLM2-135M's scale (float32), for the predictor's and the step
trace's tests: the values only need to be of a real model's scale."""

from engine.cost import StepCostModel

COST = StepCostModel(
    body_weight_bytes=428_000_000,
    lm_head_bytes=113_000_000,
    embedding_row_bytes=2304,
    body_matmul_params=106_000_000,
    lm_head_params=28_300_000,
    attention_flops_per_pair=69_120,
)
KV_BYTES_PER_TOKEN = 46_080
