"""Choose a layout: per-device memory and per-step traffic of every ``shard_size`` (and TP size) a cluster allows.

``fabric-hsdp plan`` prints the table; ``HybridFSDPStrategy(shard_size="auto")`` calls
:func:`~fabric_hsdp.planning.auto.auto_topology`. Both go through :func:`make_plan`, so they agree. The formulas are
in docs/concepts.md.
"""

from fabric_hsdp.planning.layout import candidate_layouts
from fabric_hsdp.planning.memory import Memory, Training, Workload, activation_bytes, memory_per_device
from fabric_hsdp.planning.model import ModelShape, model_shape, model_shape_of_module
from fabric_hsdp.planning.plan import Cluster, LayoutPlan, NoLayoutFitsError, Plan, choose_layout, make_plan
from fabric_hsdp.planning.report import plan_dict, plan_table
from fabric_hsdp.planning.sources import load_model_shape
from fabric_hsdp.planning.traffic import Traffic, traffic_per_step

__all__ = [
    "Cluster",
    "LayoutPlan",
    "Memory",
    "ModelShape",
    "NoLayoutFitsError",
    "Plan",
    "Traffic",
    "Training",
    "Workload",
    "activation_bytes",
    "candidate_layouts",
    "choose_layout",
    "load_model_shape",
    "make_plan",
    "memory_per_device",
    "model_shape",
    "model_shape_of_module",
    "plan_dict",
    "plan_table",
    "traffic_per_step",
]
