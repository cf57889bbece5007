"""A model-free runner for scheduler tests, and helpers that drive the step loop.

``FakeRunner`` keeps a fake KV cache (slot -> the token and position written there) and
checks, every step, that the scheduler's output is self-consistent: the token ids it hands over
are the request's, the slots come from its block table, and the context a sampling request
attends to holds exactly its tokens. The "sampled" token is a deterministic function of that
context read back from the cache, so a request recomputed after preemption produces the same
tokens only if the scheduler re-fed the right prompt + output into the right blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpool.manager import KVCacheManager, slots_for
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
from scheduler.scheduler import SchedulerUpdate

EOS = 2


def next_token(context: list[int]) -> int:
    """The fake model: a token in [10, 1010) that depends on every token of the context."""
    h = 0
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return 10 + h % 1000


@dataclass
class FakeRunner:
    block_size: int
    # request id -> tokens to emit in order (the i-th output token), overriding next_token.
    script: dict[str, list[int]] = field(default_factory=dict)
    cache: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (token, position)
    num_forward_tokens: int = 0  # tokens computed so far, padding included
    num_padding_tokens: int = 0

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        sampled: dict[str, int] = {}
        for item in out.scheduled:
            request = item.request
            end = item.start + item.num_tokens
            assert item.token_ids == request.token_ids(item.start, end)
            self.num_forward_tokens += item.num_tokens
            if item.padding:
                # A padding row re-reads its whole cached context and writes nothing.
                assert item.num_tokens == 1 and not item.samples
                assert request.status.finished
                assert item.seq_len == request.num_computed_tokens
                self.num_padding_tokens += 1
                self._read_context(item.block_ids, request, end)
                continue
            slots = slots_for(item.block_ids, self.block_size, item.start, end)
            for position, (token, slot) in enumerate(
                zip(item.token_ids, slots, strict=True), item.start
            ):
                self.cache[slot] = (token, position)
            if item.samples:
                context = self._read_context(item.block_ids, request, end)
                index = request.num_output_tokens
                scripted = self.script.get(request.request_id, [])
                sampled[request.request_id] = (
                    scripted[index] if index < len(scripted) else next_token(context)
                )
        return sampled

    def _read_context(
        self, block_ids: tuple[int, ...], request: Request, seq_len: int
    ) -> list[int]:
        context = []
        for position, slot in enumerate(slots_for(block_ids, self.block_size, 0, seq_len)):
            token, written_at = self.cache[slot]
            assert written_at == position, (
                f"{request.request_id}: slot {slot} holds position {written_at}"
            )
            assert token == request.token_id_at(position), (
                f"{request.request_id}: stale KV at {position}"
            )
            context.append(token)
        return context


@dataclass
class FakeClock:
    """A settable clock for admission windows: ``clock()`` returns ``now``."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_model_len: int = 4096,
    clock: Callable[[], float] | None = None,
    **config: object,
) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    cfg = SchedulerConfig(**config)  # type: ignore[arg-type]
    if clock is None:
        return Scheduler(cfg, kv, max_model_len)
    return Scheduler(cfg, kv, max_model_len, clock=clock)


def req(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 8,
    *,
    arrival_time: float = 0.0,
    **params: object,
) -> Request:
    """A request whose prompt is ``prompt_len`` distinct-ish tokens, EOS id 2."""
    base = sum(map(ord, request_id))
    prompt = [100 + (base * 7 + i * 13) % 900 for i in range(prompt_len)]
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),  # type: ignore[arg-type]
        eos_token_id=EOS,
        arrival_time=arrival_time,
    )


@dataclass
class Step:
    out: SchedulerOutput
    update: SchedulerUpdate

    @property
    def batch(self) -> list[tuple[str, int]]:
        """(request id, tokens) of live requests in batch order."""
        return [(s.request_id, s.num_tokens) for s in self.out.scheduled if not s.padding]

    @property
    def padding_ids(self) -> list[str]:
        return [s.request_id for s in self.out.scheduled if s.padding]

    @property
    def finished_ids(self) -> list[str]:
        return [r.request_id for r in self.update.finished]


def step(sched: Scheduler, runner: FakeRunner) -> Step:
    out = sched.schedule()
    sched.check_integrity()
    update = sched.update_from_output(out, runner.execute(out))
    sched.check_integrity()
    return Step(out, update)


def run_all(
    sched: Scheduler,
    runner: FakeRunner,
    requests: Iterable[Request] = (),
    *,
    max_steps: int = 10_000,
    on_step: Callable[[int, Step], None] | None = None,
) -> dict[str, list[int]]:
    """Add ``requests``, step until none is unfinished; return each request's output tokens.

    Tokens are collected from the per-step updates (what a client would stream), not read off
    the request at the end.
    """
    for request in requests:
        sched.add_request(request)
    streamed: dict[str, list[int]] = {}
    for i in range(max_steps):
        if not sched.has_unfinished():
            break
        s = step(sched, runner)
        for request, token in s.update.new_tokens:
            streamed.setdefault(request.request_id, []).append(token)
        if on_step is not None:
            on_step(i, s)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "blocks leaked"
    return streamed


def run_alone(request: Request, block_size: int = 16) -> list[int]:
    """The tokens ``request`` gets when it runs alone in a roomy pool."""
    alone = Request(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        eos_token_id=request.eos_token_id,
    )
    sched = make_scheduler(num_blocks=256, block_size=block_size)
    return run_all(sched, FakeRunner(block_size), [alone])[request.request_id]
