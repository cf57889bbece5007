"""Greedy parity between pagedserve and transformers' generate(), with the one allowed slack.

Two correct float32 implementations can pick different tokens where the top two logits are
within rounding of each other. A divergence is accepted only at a position where the
reference's top-2 logit margin is below ``MARGIN`` (and is reported); after it the two
continuations are different texts and are not compared further.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MARGIN = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    margins: list[float]  # top-1 minus top-2 logit at each generated position


@torch.inference_mode()
def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> Reference:
    """transformers' own generate(), alone, greedy, with the logits of every step."""
    ids = torch.tensor([prompt_ids])
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
    margins = []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        margins.append(float(top2[0] - top2[1]))
    return Reference(tokens, margins)


def assert_parity(ours: list[int], ref: Reference, label: str = "") -> str | None:
    """Assert ``ours`` equals the reference, or diverges only at a near-tie.

    Returns:
        None if identical, else a note describing the accepted near-tie divergence.
    """
    for i, (a, b) in enumerate(zip(ours, ref.token_ids, strict=False)):
        if a != b:
            margin = ref.margins[i]
            assert margin < MARGIN, (
                f"{label}: token {i} differs (ours {a}, transformers {b}) and the reference's "
                f"top-2 margin there is {margin:.2e} >= {MARGIN}: a real mismatch.\n"
                f"ours: {ours}\nref:  {ref.token_ids}"
            )
            note = f"{label}: near-tie divergence at token {i} (margin {margin:.2e}), accepted"
            print(note)
            return note
    assert len(ours) == len(ref.token_ids), (
        f"{label}: lengths differ, ours {len(ours)} vs transformers {len(ref.token_ids)}\n"
        f"ours: {ours}\nref:  {ref.token_ids}"
    )
    return None
