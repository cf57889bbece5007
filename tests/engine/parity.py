"""Greedy parity between pagedserve and transformers' generate(), with the one allowed slack.

Two correct implementations can pick different tokens where the top two logits are within
rounding of each other. A divergence is accepted only at a position where the reference's
top-2 logit margin is within the rounding of the dtype both ran in (and is reported); after
it the two continuations are different texts and are not compared further. The rule per
dtype (``tie_threshold``):

- float32: the margin is below ``MARGIN`` (1e-3), far above float32 rounding of O(10)
  logits, far below a real mismatch.
- bfloat16: the margin is within ``BF16_ULPS`` (2) bf16 ulps of the top logit's magnitude.
  A bf16 logit is rounded to 8 significant bits, so two bf16 runs that order their sums
  differently can each be off by about an ulp: two ulps of the logit is the gap that
  rounding alone can close. Compare bf16 only against a bf16 reference on the same device
  (transformers on CUDA in bf16); against a float32 reference bf16's error is not rounding
  of the same computation but of another one, and no margin rule separates it from a bug.

float16 has no written rule: a test that runs it must write one first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.llm import CompletionOutput

MARGIN = 1e-3
BF16_ULPS = 2


@dataclass
class Reference:
    token_ids: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position
    top_logits: list[float] = field(default_factory=list)  # the top-1 logit there (bf16 rule)

    @classmethod
    def from_output(cls, out: CompletionOutput) -> Reference:
        """An engine run's tokens as the reference, with its top-2 logprob margins (= logit
        margins); the run must have asked for logprobs of at least the top 2."""
        return cls(out.token_ids, [lp.top[0][1] - lp.top[1][1] for lp in out.logprobs])


def bf16_ulp(x: float) -> float:
    """The gap between adjacent bfloat16 values at ``|x|``: ``2**(e - 7)`` for ``|x|`` in
    ``[2**e, 2**(e + 1))`` (8 significant bits); below the smallest normal, the subnormal gap."""
    magnitude = abs(x)
    smallest_normal = torch.finfo(torch.bfloat16).tiny  # 2**-126
    if magnitude < smallest_normal:
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


def tie_threshold(dtype: torch.dtype, top_logit: float) -> tuple[float, str]:
    """(the largest margin at which a divergence is accepted, the rule in words)."""
    if dtype == torch.float32:
        return MARGIN, f"< {MARGIN}"
    if dtype == torch.bfloat16:
        threshold = BF16_ULPS * bf16_ulp(top_logit)
        return threshold, (
            f"<= {BF16_ULPS} bf16 ulps of the top logit {top_logit:.4g} ({threshold:.3g})"
        )
    raise ValueError(f"no written near-tie rule for {dtype}")


def is_near_tie(dtype: torch.dtype, margin: float, top_logit: float) -> bool:
    """Whether a divergence at a reference margin of ``margin`` is accepted in ``dtype``."""
    threshold, _ = tie_threshold(dtype, top_logit)
    return margin < threshold if dtype == torch.float32 else margin <= threshold


@torch.inference_mode()
def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> Reference:
    """transformers' own generate(), alone, greedy, with the logits of every step (on the
    model's device, in its dtype)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    margins, top_logits = [], []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
        top_logits.append(float(top2[0]))
    return Reference(tokens, margins, top_logits)


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts of ``lengths`` random token ids (3-255: no special tokens), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def random_prompts_and_references(
    checkpoint, device: str, seed: int, lengths: tuple[int, ...], max_new_tokens: int
) -> tuple[list[list[int]], list[Reference]]:
    """Random prompts of ``lengths`` tokens (ids 3-255, from ``seed``) and transformers'
    greedy continuations of them in float32 on ``device`` (no EOS: every one runs its
    ``max_new_tokens``)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint), torch_dtype=torch.float32
    ).to(device)
    prompts = random_prompts(seed, lengths)
    return prompts, [hf_greedy(hf, p, max_new_tokens, eos_token_id=None) for p in prompts]


def assert_parity(
    ours: list[int], ref: Reference, label: str = "", dtype: torch.dtype = torch.float32
) -> str | None:
    """Assert ``ours`` equals the reference, or diverges only at a near-tie of ``dtype``'s
    rule (``tie_threshold``).

    Returns:
        None if identical, else a note describing the accepted near-tie divergence.
    """
    for i, (a, b) in enumerate(zip(ours, ref.token_ids, strict=False)):
        if a != b:
            margin = ref.margins[i]
            top = ref.top_logits[i] if ref.top_logits else float("nan")
            if dtype != torch.float32:
                assert ref.top_logits, f"{label}: the {dtype} rule needs the reference's logits"
            _, rule = tie_threshold(dtype, top)
            assert is_near_tie(dtype, margin, top), (
                f"{label}: token {i} differs (ours {a}, transformers {b}) and the reference's "
                f"top-2 margin there is {margin:.2e}, not {rule}: a real mismatch.\n"
                f"ours: {ours}\nref:  {ref.token_ids}"
            )
            note = (
                f"{label}: near-tie divergence at token {i} (margin {margin:.2e} {rule}), accepted"
            )
            print(note)
            return note
    assert len(ours) == len(ref.token_ids), (
        f"{label}: lengths differ, ours {len(ours)} vs transformers {len(ref.token_ids)}\n"
        f"ours: {ours}\nref:  {ref.token_ids}"
    )
    return None
