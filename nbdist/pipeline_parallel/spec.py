"""What one rank needs to run its part of a pipeline: one frozen specification, made in the notebook, sent once.

Plain data (the model travels as the user's builder function, cloudpickled, or as the stage modules themselves):
the kernel makes one StageSpec per rank of the mesh (nbdist/pipeline_parallel/api.py) and the rank builds its
executor from it (nbdist/pipeline_parallel/ranks/pipeline.py). Everything the executor reads about its place in the
world is here, named, instead of spread over positional arguments and attributes set after construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRANSPORTS = ("auto", "mpi", "torch")


@dataclass(frozen=True)
class StageSpec:
    """One rank's share of a pipeline.

    A pipeline runs on the `pp` dimension of a mesh: one pipeline per data-parallel replica (the mesh's `dp`
    dimension, size `replicas`). Along pp, this rank is schedule rank `pipeline_rank`; its messages go over the
    mesh's pp communicator, its gradients are averaged over the dp one.
    """

    name: str  # the pipeline's name on the ranks (registry key)
    number: int  # unique among this kernel's pipelines: part of every message tag
    mesh: str  # the mesh's name on the ranks (nbdist/cluster/meshes/ranks/rank_mesh.py)
    replicas: int  # data-parallel replicas (the mesh's dp size; 1 without dp)
    pipeline_rank: int  # this rank's coordinate along pp: its rank in the schedule
    pipeline_ranks: int  # p: ranks per pipeline (stage s sits on pipeline rank s mod p)
    program: tuple[str, ...]  # this rank's actions in torch's text form ('0F1', '1SEND_B0', ...)
    ticks: tuple[int, ...]  # the lockstep tick of each action (pipeline_parallel/stepping.py)
    stages: int  # model pieces: pipeline ranks x chunks
    microbatches: int  # per replica and step
    layers: dict[int, tuple[int, int]]  # this rank's stages -> (first layer, end layer) of the unsplit model
    model: Any  # bytes: the cloudpickled function that builds the whole model; {stage: module}; or the whole model
    transport: str  # "mpi" (CPU tensors over MPI) or "torch" (torch.distributed): resolved in the kernel
    optimizer: bytes | None = None  # cloudpickled `params -> torch.optim.Optimizer`
    pipedream_lr: float | None = None  # PipeDream's per-micro-batch SGD step (None: a synchronous schedule)
    tp_plan: dict[int, dict[str, str]] | None = None  # this rank's stages -> Linear name -> "colwise" | "rowwise"
    zero: int = 0  # ZeRO stage over the stage's replicas: 1 its optimizer state, 2 its gradients too, 3 its weights
    units: tuple[str, ...] | None = None  # a model cut by its units (not a Sequential): their names, in call order;
    # `layers` then holds unit ranges and each stage is a pruned copy of the model (pipeline_parallel/split.py)
    tied: tuple[tuple[str, ...], ...] = ()  # parameter names that share one tensor (kept equal across stages)
    sync_batchnorm: bool = False  # BatchNorm layers made nbdist's SyncBatchNorm over the dp group

    @property
    def pruned(self) -> bool:
        return self.units is not None

    @property
    def first_stage(self) -> bool:
        return 0 in self.layers

    @property
    def last_stage(self) -> bool:
        return self.stages - 1 in self.layers
