"""The CUDA graphs' CPU stand-ins installed on an engine built without them (off CUDA the
builder captures none): the same buffers, buckets and padding as on CUDA, with the graphs'
work run eagerly (``capture=False``). Sized as the builder sizes the real ones: tables as
wide as the engine's longest sequence, whole prefill graphs over its ``max_num_seqs``."""

from __future__ import annotations

from engine.cuda_graphs import DecodeGraphs
from engine.llm_engine import LLMEngine
from engine.prefill_graphs import PrefillGraphs


def max_blocks_per_seq(engine: LLMEngine) -> int:
    return -(-engine.max_model_len // engine.storage.block_size)


def install_decode_stand_in(engine: LLMEngine, sizes: list[int]) -> DecodeGraphs:
    """Decode graphs' stand-in for batches of ``sizes`` rows, as ``engine.runner.graphs``."""
    graphs = DecodeGraphs(
        engine.runner.model,
        engine.storage,
        sizes,
        max_blocks_per_seq(engine),
        engine.device,
        capture=False,
    )
    engine.runner.graphs = graphs
    return graphs


def install_prefill_stand_in(
    engine: LLMEngine, sizes: list[int], mode: str = "full"
) -> PrefillGraphs:
    """Prefill graphs' stand-in for steps of ``sizes`` tokens, as
    ``engine.runner.prefill_graphs``."""
    graphs = PrefillGraphs(
        engine.runner.model,
        engine.storage,
        sizes,
        engine.device,
        capture=False,
        mode=mode,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
        max_blocks_per_seq=max_blocks_per_seq(engine),
    )
    engine.runner.prefill_graphs = graphs
    return graphs
