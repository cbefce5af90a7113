"""ExportPlan: everything an exporter needs to know about a plan, and nothing it must recompute.

Every exporter is a pure function ``ExportPlan -> text`` plus a validator ``(text, ExportPlan) -> None``.
An ExportPlan is built from a recommendation (``from_recommendation``) and stored under the ``export`` key
of ``plan.json``, so ``optplan export plan.json`` re-renders launch files without profiling the model again.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.buckets import DeepSpeedBuckets, deepspeed_buckets
from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile, TransformerShape
from optplan.estimators.strategy import Strategy

FILE_NAMES: dict[str, str] = {
    "plan": "plan.json",
    "report": "PLAN.md",
    "deepspeed": "ds_config.json",
    "accelerate": "accelerate.yaml",
    "torchrun": "launch.sh",
    "hostfile": "hostfile",
    "slurm": "slurm.sbatch",
    "hf": "hf_training_args.json",
    "lightning": "lightning.json",
}
"""The file each target writes (stable names: users' scripts refer to them)."""


class NotExportable(OptplanError):
    """The plan cannot be expressed by this target (the message names the target that can, or the fix)."""


class ExportPlan(BaseModel):
    """A plan plus the model and cluster facts the launch files need.

    ``gpus_per_node`` is the cluster's; the plan occupies ``strategy.world_size`` GPUs, i.e. ``nodes``
    nodes of ``procs_per_node`` processes each.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy
    model: str = Field(description="the model's name (file stem or --arch)")
    model_path: str = Field(description="the model file as given ('' for --arch/--params)")
    model_class: str = ""
    block_class: str | None = Field(default=None, description="the repeated block's class name (FSDP wrap unit)")
    params: int = Field(ge=0, description="unique parameters")
    transformer: TransformerShape | None = None
    seq_len: int | None = None
    buckets: DeepSpeedBuckets
    gpu: str
    gpus_per_node: int = Field(ge=1)

    @property
    def world_size(self) -> int:
        """GPUs (processes) the plan occupies."""
        return self.strategy.world_size

    @property
    def procs_per_node(self) -> int:
        """Processes (GPUs) started on each node."""
        return min(self.gpus_per_node, self.world_size)

    @property
    def nodes(self) -> int:
        """Nodes the plan occupies."""
        return -(-self.world_size // self.gpus_per_node)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


def export_plan_for(strategy: Strategy, profile: ModelProfile, cluster: Cluster) -> ExportPlan:
    """The ExportPlan of ``strategy`` for ``profile`` on ``cluster``.

    Raises OptplanError when the plan spans nodes but does not fill whole nodes (launchers start the same
    number of processes on every node).
    """
    world = strategy.world_size
    if world > cluster.gpus_per_node and world % cluster.gpus_per_node:
        raise OptplanError(f"the plan uses {world} GPUs, not a whole number of {cluster.gpus_per_node}-GPU nodes: "
                           "re-plan with a GPU count that fills whole nodes")
    block = profile.repeated_block
    return ExportPlan(
        strategy=strategy, model=profile.name, model_path=profile.path, model_class=profile.model_class,
        block_class=block.class_name if block is not None else None, params=profile.params,
        transformer=profile.transformer, seq_len=profile.seq_len, buckets=deepspeed_buckets(profile),
        gpu=cluster.gpu.name, gpus_per_node=cluster.gpus_per_node,
    )
