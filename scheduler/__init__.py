"""scheduler: request lifecycle and batching policy.

Ownership: the scheduler owns ``waiting``/``running`` and each request's ``status``,
``num_computed_tokens`` and ``output_token_ids``. It allocates and frees KV blocks only
through ``kvpool.KVCacheManager`` and never allocates tensors.
"""

from scheduler.config import SchedulerConfig
from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import RequestTooLargeError, Scheduler, SchedulerUpdate

__all__ = [
    "Request",
    "RequestStatus",
    "RequestTooLargeError",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerUpdate",
]
