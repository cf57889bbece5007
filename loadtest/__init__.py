"""Load generator for OpenAI-compatible servers: HTTP only, no imports from the rest of pagedserve.

Ownership: this package owns workload generation, arrival processes, the streaming client's
measurements, result statistics and files, plots and the batching-mode comparison. It never
imports server/, engine/, scheduler/, kvpool/ or kernels/, so it measures pagedserve in any
batching mode, vLLM or llama.cpp's server alike.
"""

from loadtest.client import ClientOptions, CompletionClient, RequestRecord
from loadtest.config import LoadTestConfig, SweepPoint
from loadtest.distributions import LengthDist
from loadtest.run import PointResult, SweepResult, arun_sweep, run_sweep, write_result
from loadtest.stats import SLO, Summary, percentile, summarize
from loadtest.workloads import RequestSpec, load_trace, synthetic_workload

__all__ = [
    "SLO",
    "ClientOptions",
    "CompletionClient",
    "LengthDist",
    "LoadTestConfig",
    "PointResult",
    "RequestRecord",
    "RequestSpec",
    "Summary",
    "SweepPoint",
    "SweepResult",
    "arun_sweep",
    "load_trace",
    "percentile",
    "run_sweep",
    "summarize",
    "synthetic_workload",
    "write_result",
]
