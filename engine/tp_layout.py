"""What tensor parallelism over N ranks holds per rank: the padded counts of a model
(``TPLayout``), and the shapes no N can shard (``shardable_problem``). Plain integers, no
torch: ``engine/tensor_parallel.py`` shards by it and ``planner/parallel.py`` sizes GPUs by
it, so a plan and a running group agree on every count.

Padding (zero weights, which add nothing to any output) takes every count N does not divide:

    KV heads       up to a multiple of N (at N > H_kv: N heads, one per rank)
    query heads    the padded KV heads times the group size H / H_kv, so every query head
                   keeps reading its own KV head
    intermediate   up to a multiple of N
    vocabulary     up to a multiple of N (the gathered logits are cut back before sampling)

Refused, whatever N (``shardable_problem``): query heads that are not a whole group per KV
head (H not a multiple of H_kv), and a mixture of experts (its experts are not sharded).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class TPLayout:
    """The padded head, intermediate and vocabulary counts of a model at ``world_size`` ranks,
    and one rank's share of each."""

    world_size: int
    num_heads: int  # the model's own counts
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    padded_num_heads: int  # multiples of world_size
    padded_num_kv_heads: int
    padded_intermediate_size: int
    padded_vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig, world_size: int) -> TPLayout:
        n = world_size
        group = config.num_heads // config.num_kv_heads
        kv = _round_up(config.num_kv_heads, n)
        return cls(
            world_size=n,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            padded_num_heads=kv * group,
            padded_num_kv_heads=kv,
            padded_intermediate_size=_round_up(config.intermediate_size, n),
            padded_vocab_size=_round_up(config.vocab_size, n),
        )

    @property
    def num_local_heads(self) -> int:
        return self.padded_num_heads // self.world_size

    @property
    def num_local_kv_heads(self) -> int:
        return self.padded_num_kv_heads // self.world_size

    @property
    def local_intermediate_size(self) -> int:
        return self.padded_intermediate_size // self.world_size

    @property
    def local_vocab_size(self) -> int:
        return self.padded_vocab_size // self.world_size

    @property
    def is_padded(self) -> bool:
        return (
            self.padded_num_heads != self.num_heads
            or self.padded_intermediate_size != self.intermediate_size
            or self.padded_vocab_size != self.vocab_size
        )

    def padding(self) -> list[str]:
        """What is padded, e.g. ``["query heads 9 -> 12", "KV heads 3 -> 4"]``."""
        return [
            f"{what} {own} -> {padded}"
            for what, own, padded in (
                ("query heads", self.num_heads, self.padded_num_heads),
                ("KV heads", self.num_kv_heads, self.padded_num_kv_heads),
                ("intermediate", self.intermediate_size, self.padded_intermediate_size),
                ("vocabulary", self.vocab_size, self.padded_vocab_size),
            )
            if own != padded
        ]

    def describe(self) -> str:
        """One line for the log: what each rank holds, and any padding."""
        n = self.world_size
        parts = [
            f"tensor parallel over {n} ranks: each holds {self.num_local_heads} query heads, "
            f"{self.num_local_kv_heads} KV heads, {self.local_intermediate_size} of the MLP's "
            f"intermediate and {self.local_vocab_size} of the vocabulary"
        ]
        pads = self.padding()
        if pads:
            parts.append(
                f"padded with zero weights (they add nothing to any output): {', '.join(pads)}"
            )
        return "; ".join(parts)


def _round_up(x: int, n: int) -> int:
    return -(-x // n) * n


def shardable_problem(config: ModelConfig) -> str | None:
    """Why no tensor-parallel size can shard ``config`` (one line for the user), or None:
    padding fixes every other count."""
    if config.num_heads % config.num_kv_heads:
        return (
            f"tensor parallelism needs num_heads ({config.num_heads}) to be a multiple of "
            f"num_kv_heads ({config.num_kv_heads})"
        )
    if config.num_experts:
        return (
            f"tensor parallelism does not shard a mixture of experts ({config.model_type}): "
            "serve it with --tensor-parallel-size 1"
        )
    return None


def check_shardable(config: ModelConfig) -> None:
    """Raise ``UnsupportedModelError`` with ``shardable_problem``'s line, if any."""
    problem = shardable_problem(config)
    if problem is not None:
        raise UnsupportedModelError(problem)
