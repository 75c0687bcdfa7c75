"""The performance model of a distlm run: FLOPs, peak FLOP/s, and a calibrated alpha-beta planner.

``python -m distlm.plan`` projects step time, tokens/s, scaling efficiency and memory per
rank of an arch, strategy and layout on a cluster profile. The functions below are what
the training log's MFU and the scaling suite need.
"""

from distlm.backends.hardware import measure_cpu_matmul_flops, peak_flops
from distlm.models.flops import ModelShape, count_parameters, flops_per_token, model_flops_utilization, model_shape
from distlm.plan.calibrate import Calibration, calibrate, fit_alpha_beta, read_measurements
from distlm.plan.model import (
    Cluster,
    Link,
    Placement,
    Projection,
    Workload,
    available_clusters,
    load_cluster,
    memory_per_rank,
    project,
    ring_allreduce_time,
)

__all__ = [
    "Calibration",
    "Cluster",
    "Link",
    "ModelShape",
    "Placement",
    "Projection",
    "Workload",
    "available_clusters",
    "calibrate",
    "count_parameters",
    "fit_alpha_beta",
    "flops_per_token",
    "load_cluster",
    "measure_cpu_matmul_flops",
    "memory_per_rank",
    "model_flops_utilization",
    "model_shape",
    "peak_flops",
    "project",
    "read_measurements",
    "ring_allreduce_time",
]
