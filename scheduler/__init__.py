"""scheduler: request lifecycle and batching policy.

Ownership: the scheduler owns ``waiting``/``running`` and each request's ``status``,
``num_computed_tokens`` and ``output_token_ids``. It allocates and frees KV blocks only
through ``kvpool.KVCacheManager`` and never allocates tensors.
"""

from scheduler.admission import RequestTooLargeError
from scheduler.config import SchedulerConfig
from scheduler.output import ScheduledRequest, SchedulerOutput, SchedulerUpdate
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler

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
