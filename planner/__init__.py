"""planner: the transformer-inference arithmetic as a capacity planner (``pagedserve plan``).

Owns: the device table (and the measured ``cpu`` entry and its cache), model presets and
config reading for planning, the arithmetic, and reading measurements back. Owns no server
state; imports only ``engine.config`` from the project. See planner/README.md.
"""

from planner.arithmetic import (
    attention_intensity,
    critical_batch_size,
    kv_bytes_per_token,
    kv_capacity_tokens,
    ops_per_byte,
    param_count,
    roofline_time_s,
)
from planner.cli import main
from planner.devices import DEVICES, Device, device_for_cuda_name, get_device
from planner.measured import Measured, load_measured
from planner.models import PRESETS, PlannedModel, load_model
from planner.plan import Plan, Workload, make_plan

__all__ = [
    "DEVICES",
    "PRESETS",
    "Device",
    "Measured",
    "Plan",
    "PlannedModel",
    "Workload",
    "attention_intensity",
    "critical_batch_size",
    "device_for_cuda_name",
    "get_device",
    "kv_bytes_per_token",
    "kv_capacity_tokens",
    "load_measured",
    "load_model",
    "main",
    "make_plan",
    "ops_per_byte",
    "param_count",
    "roofline_time_s",
]
