"""Sampler: logits of one step -> one token per sampling request, batched on the device.

Order of operations per row (as vLLM and OpenAI define them):
  1. log-probabilities for the response: ``log_softmax`` of the *raw* logits;
  2. ``logit_bias`` and ``min_tokens``' stop-token ban (engine/token_bias.py); then
     penalties: repetition (over prompt + output, HF's divide/multiply rule), then frequency
     and presence (over output tokens, OpenAI's subtractive rule), from the per-request
     token counts the sampler keeps on the device (engine/penalties.py);
  3. greedy rows take the argmax; others divide by temperature, then apply top-k, top-p
     and min-p truncation and draw from the result.

Every step works on the whole batch at once, on the logits' device: the per-request
parameters become [rows] tensors, and the only host-device synchronisation is the final
read of the chosen tokens (and their logprobs), so a CUDA step never waits on the host
mid-way.

The draw is an exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. picks token i
with probability exactly ``p_i`` (the Gumbel-max trick in another form), and it needs no
per-row ``multinomial`` call.

Constraints (structured output, engine/structured.py) act on the penalised logits, on the
constrained rows only, in one of two ways per row: the row is masked before the pick, or the
pick is made on the unmasked logits and checked; a refused row tries its next-best tokens in
order, and only when none of the few is allowed (or scores tie) is it masked and picked again,
with the same noise. The second gives the token the first would: a greedy row's argmax over
all tokens, when allowed, is its argmax over the allowed ones; a row that samples from the
whole tempered distribution (no top-k, top-p or min-p truncation) wins the race among all
tokens with a token that also wins it among the allowed ones, whose probabilities differ from
the unmasked ones by one common factor; and the best-scored allowed token is the first
allowed in score order. Masking commutes with the penalties (-inf stays -inf).

Reproducibility: a seeded row's noise is counter-based, a pure function of (the request's
seed, the output position it samples, the token id), computed for all seeded rows at once
(``seeded_exponential``). Its tokens therefore depend neither on what else is in the batch
nor on its row, nor on how often the request was preempted and recomputed or a step retried,
and the sampler keeps no per-request state for it (its only per-request state is the
penalties' token counts, which the engine drops with ``forget`` when a request ends). Rows
without a seed share one generator, drawn once per step for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.outputs import TokenLogprob
from engine.penalties import TokenCounts, apply_penalties
from engine.to_device import on_device
from engine.token_bias import apply_token_bias, has_token_bias, row_bias
from scheduler.output import ScheduledRequest
from scheduler.request import SamplingParams


class LogitsConstraint(Protocol):
    """What the sampler asks of structured output (engine/structured.py)."""

    @property
    def num_constrained(self) -> int:
        """Requests with a grammar; none: the hooks below change nothing."""
        ...

    def mask_before_sampling(
        self, logits: torch.Tensor, requests: list[ScheduledRequest]
    ) -> torch.Tensor:
        """Mask, in place, the constrained rows that must be masked before the pick."""
        ...

    def refused_rows(self, token_ids: torch.Tensor, requests: list[ScheduledRequest]) -> list[int]:
        """The constrained rows not masked before the pick whose picked token is refused."""
        ...

    def first_allowed(
        self, candidates: list[list[int]], requests: list[ScheduledRequest], rows: list[int]
    ) -> list[int | None]:
        """Per row of ``rows``, the index of the first of its candidate tokens allowed."""
        ...

    def mask_rows(
        self, logits: torch.Tensor, requests: list[ScheduledRequest], rows: list[int]
    ) -> torch.Tensor:
        """Mask, in place, ``rows`` of the logits."""
        ...


# A refused row's best tokens tried, best first, before its mask is filled.
NUM_CANDIDATES = 5


class Picked:
    """One step's chosen tokens (and logprobs, where asked for) on the device, not yet read.

    ``read()`` is the step's one host-device synchronisation. ``start_copy()`` queues the
    copy to host memory behind the step's work without waiting for it, so that the host can
    prepare the next step meanwhile (asynchronous scheduling); ``read()`` then waits for the
    copy only. ``tokens`` stays on the device for a next step that feeds them back in.
    """

    def __init__(
        self,
        tokens: torch.Tensor,  # [rows] int64
        params: list[SamplingParams],
        chosen_logprobs: torch.Tensor | None = None,  # [rows] float32
        top_values: torch.Tensor | None = None,  # [rows, num_top]
        top_ids: torch.Tensor | None = None,  # [rows, num_top] int64
    ) -> None:
        self.tokens = tokens
        self.params = params
        self._device = [tokens, chosen_logprobs, top_values, top_ids]
        self._host: list[torch.Tensor | None] | None = None
        self._copied: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        if self._host is not None or self.tokens.device.type == "cpu":
            return
        # non_blocking into pinned memory (torch pins a non-blocking copy's host result).
        self._host = [t.to("cpu", non_blocking=True) if t is not None else None
                      for t in self._device]  # fmt: skip
        self._copied = torch.cuda.Event()
        self._copied.record()

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The chosen token per row, and per row its ``TokenLogprob`` or None."""
        if self._copied is not None:
            self._copied.synchronize()
        tokens, chosen_lp, top_values, top_ids = (
            self._host if self._host is not None else self._device
        )
        assert tokens is not None
        token_ids = tokens.tolist()
        if chosen_lp is None:
            return token_ids, [None] * len(self.params)
        chosen_values = chosen_lp.tolist()
        top_v = top_values.tolist() if top_values is not None else None
        top_i = top_ids.tolist() if top_ids is not None else None
        logprobs: list[TokenLogprob | None] = []
        for row, p in enumerate(self.params):
            if p.logprobs is None:
                logprobs.append(None)
                continue
            top: list[tuple[int, float]] = []
            if p.logprobs > 0 and top_v is not None and top_i is not None:
                top = list(zip(top_i[row][: p.logprobs], top_v[row][: p.logprobs], strict=True))
            logprobs.append(TokenLogprob(token_ids[row], chosen_values[row], top))
        return token_ids, logprobs


class Sampler:
    def __init__(
        self,
        seed: int,
        device: torch.device,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Args:
        argmax: the greedy pick, [rows, vocab] -> [rows] int64, with ``torch.argmax``'s
            rule (the first index of the largest value, a NaN the largest); torch's own by
            default (the C++ CPU kernels bring a faster one over a large vocabulary).
        """
        self.device = device
        self._argmax = argmax if argmax is not None else _torch_argmax
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        # Set by the engine when it serves structured output (engine/structured.py): masks
        # constrained rows before the pick or checks their picks (module docstring).
        # Logprobs stay those of the raw logits.
        self.constraint: LogitsConstraint | None = None
        # Penalised requests' output-token counts and seen tokens, kept up to date step by
        # step; the speculator's verification reads them too.
        self.penalties = TokenCounts(device)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_samples, vocab] float32
        requests: list[ScheduledRequest],
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Returns:
        The chosen token per row, and per row its logprob (with top-N alternatives when
        the request asked for them) or None when the request did not ask for logprobs.
        """
        return self.pick(logits, requests).read()

    def forget(self, request_id: str) -> None:
        """Drop a finished (or aborted) request's penalty counts; idempotent."""
        self.penalties.forget(request_id)

    @torch.inference_mode()
    def pick(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> Picked:
        """Choose every row's token on the logits' device and return the choice unread
        (``Picked.read`` is the step's synchronisation). Structured output's checked rows
        read their picks mid-way: a constrained batch waits for the device here."""
        params = [r.request.sampling_params for r in requests]
        constraint = self.constraint
        if (constraint is None or not constraint.num_constrained) and (
            all(p.argmax_only for p in params)
            # Greedy rows kept off only by min_tokens, once past it (rare: checked second).
            or all(
                p.argmax_only
                or (p.argmax_past_min_tokens and _output_position(r) >= p.min_tokens)
                for p, r in zip(params, requests, strict=True)
            )
        ):
            # The common batch: one argmax, one read; what the general path below computes
            # for it (no logprobs, penalties or noise).
            return Picked(self._argmax(logits), params)
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if num_top is not None else None

        if any(has_token_bias(p) for p in params):  # then a new tensor
            logits = apply_token_bias(
                logits, [row_bias(r.request, _output_position(r)) for r in requests]
            )
        if constraint is not None:
            logits = constraint.mask_before_sampling(logits, requests)
        penalised = [i for i, p in enumerate(params) if p.needs_penalties]
        if penalised:
            seen = self.penalties.seen([requests[i].request for i in penalised], logits.shape[1])
            if len(penalised) == len(params):
                logits = apply_penalties(logits, seen, params)  # a new tensor
            else:
                rows = on_device(logits.device, penalised)
                logits = logits.clone()
                logits[rows] = apply_penalties(logits[rows], seen, [params[i] for i in penalised])

        chosen = self._argmax(logits)  # greedy rows keep this
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        noise = scores = None
        if random_rows:
            rows = on_device(logits.device, random_rows)
            probs = truncated_probs(logits[rows], [params[i] for i in random_rows])
            noise = self._exponential_noise(probs, [requests[i] for i in random_rows])
            scores = probs / noise
            chosen[rows] = scores.argmax(dim=-1)
        if constraint is not None:
            refused = constraint.refused_rows(chosen, requests)
            if refused:
                refused = self._next_allowed(
                    chosen, logits, scores, params, requests, refused, random_rows, constraint
                )
            if refused:
                logits = constraint.mask_rows(logits, requests, refused)
                self._pick_again(chosen, logits, params, refused, random_rows, noise)

        if raw_logprobs is None:
            return Picked(chosen, params)
        chosen_lp = raw_logprobs.gather(1, chosen[:, None]).squeeze(1)
        top_values, top_ids = raw_logprobs.topk(num_top, dim=-1) if num_top else (None, None)
        return Picked(chosen, params, chosen_lp, top_values, top_ids)

    def _next_allowed(
        self,
        chosen: torch.Tensor,  # [rows] int64, updated in place
        logits: torch.Tensor,  # [rows, vocab]
        scores: torch.Tensor | None,  # [len(random_rows), vocab]: probs / noise
        params: list[SamplingParams],
        requests: list[ScheduledRequest],
        rows: list[int],
        random_rows: list[int],
        constraint: LogitsConstraint,
    ) -> list[int]:
        """Try refused rows' best NUM_CANDIDATES tokens (by logit, or by race score), best
        first: the first one allowed is the pick masking would make, unless another token
        shares its score (the pick would then be the lowest allowed id among them, which the
        list may not show). Returns the rows left to be masked: ties, or none allowed."""
        ranked_rows = []
        for i in rows:
            if params[i].greedy:
                ranked_rows.append(logits[i])
            else:
                assert scores is not None
                ranked_rows.append(scores[random_rows.index(i)])
        ranked = torch.stack(ranked_rows)
        values, token_ids = ranked.topk(min(NUM_CANDIDATES, ranked.shape[1]), dim=-1)
        candidates = token_ids.tolist()
        left = []
        for row, first, row_values, row_ids in zip(
            rows,
            constraint.first_allowed(candidates, requests, rows),
            values.tolist(),
            candidates,
            strict=True,
        ):
            if first is not None and _untied(row_values, first):
                chosen[row] = row_ids[first]
            else:
                left.append(row)
        return left

    def _pick_again(
        self,
        chosen: torch.Tensor,  # [rows] int64, updated in place
        logits: torch.Tensor,  # [rows, vocab], ``rows`` now masked
        params: list[SamplingParams],
        rows: list[int],
        random_rows: list[int],
        noise: torch.Tensor | None,  # [len(random_rows), vocab]: the draw already made
    ) -> None:
        """Pick ``rows`` again from their masked logits: the argmax, or the race with the
        noise these rows already drew (a checked row truncates nothing, so its tempered
        probabilities over the allowed tokens are the masked-first ones)."""
        greedy = [i for i in rows if params[i].greedy]
        if greedy:
            index = on_device(logits.device, greedy)
            chosen[index] = self._argmax(logits[index])
        sampled = [i for i in rows if not params[i].greedy]
        if sampled:
            assert noise is not None
            index = on_device(logits.device, sampled)
            noise_rows = on_device(noise.device, [random_rows.index(i) for i in sampled])
            probs = truncated_probs(logits[index], [params[i] for i in sampled])
            chosen[index] = (probs / noise[noise_rows]).argmax(dim=-1)

    def _exponential_noise(
        self, probs: torch.Tensor, requests: list[ScheduledRequest]
    ) -> torch.Tensor:
        """[rows, vocab] i.i.d. Exp(1) draws: unseeded rows from the shared generator in one
        draw, seeded rows from ``seeded_exponential`` in one batch."""
        seeds = [r.request.sampling_params.seed for r in requests]
        seeded = [j for j, seed in enumerate(seeds) if seed is not None]
        if not seeded:
            return torch.empty_like(probs).exponential_(generator=self._shared)
        device, vocab = probs.device, probs.shape[1]
        seeded_noise = seeded_exponential(
            on_device(device, [_int64(seeds[j]) for j in seeded], torch.long),
            on_device(device, [_output_position(requests[j]) for j in seeded], torch.long),
            vocab,
        ).to(probs.dtype)
        if len(seeded) == len(requests):
            return seeded_noise
        unseeded = [j for j, seed in enumerate(seeds) if seed is None]
        shared = torch.empty(len(unseeded), vocab, dtype=probs.dtype, device=device)
        shared.exponential_(generator=self._shared)
        noise = torch.empty_like(probs)
        noise.index_copy_(0, on_device(device, unseeded), shared)
        return noise.index_copy_(0, on_device(device, seeded), seeded_noise)


# splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014)
# over int64 tensors: multiplications and additions wrap modulo 2**64 on every device, and
# right shifts are arithmetic, so every shift is masked to make it the logical one.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # the stream's increment, as a signed int64
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)
# Uniforms have 24 bits: (2m + 1) / 2**24, the midpoints of 2**23 equal cells of (0, 1). The
# odd numerator is below 2**24, so it and the quotient are exact in float32, which every GPU
# computes at full rate (most run float64 at a small fraction of it); u never reaches 0 or 1,
# so -log(u) lies in [6e-8, 16.7]: finite, never 0 (float32's log is accurate near 1), and no
# 0 / 0 ever makes a truncated token a NaN that argmax would pick.
_UNIFORM_BITS = 24


def _xorshift_(z: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """``z ^= z >>> shift`` in place (a logical shift of z's 64 bits)."""
    torch.bitwise_right_shift(z, shift, out=scratch)
    scratch.bitwise_and_((1 << (64 - shift)) - 1)
    z.bitwise_xor_(scratch)


def _mix_(z: torch.Tensor, scratch: torch.Tensor, *, last: bool = True) -> torch.Tensor:
    """splitmix64's output function of the states ``z``, in place. ``last=False`` leaves out
    its final ``z ^= z >>> 31``, which changes bits 0-32 only: enough for the top bits."""
    _xorshift_(z, 30, scratch)
    z.mul_(_MIX_1)
    _xorshift_(z, 27, scratch)
    z.mul_(_MIX_2)
    if last:
        _xorshift_(z, 31, scratch)
    return z


def _draw(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Draw number ``index`` of the splitmix64 stream seeded with ``key`` (broadcast)."""
    z = key + (index + 1) * _GOLDEN_GAMMA
    return _mix_(z, torch.empty_like(z))


def seeded_exponential(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64: the output position each row samples
    vocab: int,
) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) noise, each entry a pure function of (seed, position,
    token id): draw number ``token`` of the splitmix64 stream keyed by draw number
    ``position`` of the stream seeded with the seed. Distinct (seed, position) pairs get
    independent-looking rows; the same pair always gets the same row, on any device (the
    integer part is exact; the float32 ``log`` may differ in its last bit between devices).
    A fixed number of whole-block operations, whatever the number of rows."""
    device = seeds.device
    row_keys = _draw(_draw(seeds, torch.zeros_like(seeds)), positions)  # [rows]
    token_ids = torch.arange(vocab, dtype=torch.long, device=device)
    z = row_keys[:, None] + (token_ids + 1) * _GOLDEN_GAMMA  # [rows, vocab]
    _mix_(z, torch.empty_like(z), last=False)  # the scratch goes before the float32 result
    # The top 24 bits with the lowest set: 2m + 1 for m the top 23 bits.
    z.bitwise_right_shift_(64 - _UNIFORM_BITS)
    z.bitwise_and_((1 << _UNIFORM_BITS) - 1).bitwise_or_(1)
    u = z.to(torch.float32).mul_(2.0**-_UNIFORM_BITS)
    return u.log_().neg_()


def _int64(seed: int) -> int:
    """A seed as the int64 with the same low 64 bits (any Python int is a valid seed)."""
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


def _output_position(item: ScheduledRequest) -> int:
    """The output position the row samples: the token after the step's last one. It is the
    same whenever that token is sampled (after a preemption the recompute's last chunk ends
    where the lost step ended), and not the count of the request's earlier draws."""
    return item.seq_len - item.request.num_prompt_tokens


def _untied(values: list[float], j: int) -> bool:
    """Whether ``values[j]`` (``values`` sorted, largest first) is a finite score that no
    other token shares; the last entry may share it with tokens past the list."""
    value = values[j]
    return (
        j + 1 < len(values)
        and value > float("-inf")
        and values[j + 1] != value
        and (j == 0 or values[j - 1] != value)
    )


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, per row ([rows, vocab]);
    truncated entries are 0 and the rest are not renormalised (the exponential race does
    not need it)."""
    rows, vocab = logits.shape
    device = logits.device
    temps = on_device(device, [p.temperature for p in params])[:, None]
    logits = logits / temps
    if any(0 < p.top_k < vocab for p in params):
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        kth_index = on_device(device, [k - 1 for k in ks], torch.long)[:, None]
        kth = logits.topk(max(ks), dim=-1).values.gather(1, kth_index)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = on_device(device, [p.top_p for p in params])[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # *before* it already does. A row with top_p = 1 keeps everything, and every row
        # its most likely token (a top_p that rounds to 0 in float32 would drop it too).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (before >= top_p) & (top_p < 1.0)
        drop[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if any(p.min_p > 0.0 for p in params):
        min_p = on_device(device, [p.min_p for p in params])[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs
