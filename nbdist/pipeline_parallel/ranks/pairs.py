"""One process group per pipeline, for the torch transport (this code runs ON the engines).

Why one: NCCL documents that operations on several communicators in flight at once can deadlock unless every rank
issues them in one consistent order, because CUDA does not promise that kernels of different streams run at the same
time. nbdist used to give every directed pair of neighbours its own group (its own communicator and stream), so a
rank had up to four communicators in flight at once. Now all of a pipeline's messages go through one group, posted in
rounds, each one NCCL group call (torch.distributed.batch_isend_irecv); schedules/nccl.py says why rounds and proves,
schedule by schedule, that they complete. Messages on a directed pair still match first-in first-out (NCCL ignores
tags); gloo (CPU) takes the same path with the same rule (tag 0), so CPU tests exercise what NCCL will do.

Each pipeline has its own group (two pipelines on one mesh would otherwise take each other's messages in FIFO
order), made when it is built. Making groups is collective over the whole world. NCCL makes a group's communicator on
its first collective, which every rank of the group must join (`build` runs one all-reduce, and batched messages use
that same communicator); it connects a pair of ranks on the pair's first message, blocking both until the other
arrives: done lazily inside a step, two ranks that each wait for another neighbour could wait for each other. So
`build` sends one small message through each directed pair, in one global order, before any step runs: the two
ranks of the lowest pair not yet connected have connected all their earlier pairs, so they always meet
(`nbdist.schedules.nccl.check_setup` plays this).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nbdist.cluster.meshes.mesh import Mesh

KIND = "pipeline pairs"  # registry kind: pipeline name -> {"group": its process group} (renewed in place)
Pair = tuple[int, int]  # (sending pp coordinate, receiving pp coordinate)


def directed_pairs(p: int) -> list[Pair]:
    """The directed pairs of pp coordinates that can carry messages: neighbours on the ring, both ways."""
    pairs: list[Pair] = []
    for r in range(p):
        for pair in ((r, (r + 1) % p), ((r + 1) % p, r)):
            if pair[0] != pair[1] and pair not in pairs:
                pairs.append(pair)
    return pairs


def global_order(mesh: Mesh) -> list[tuple[int, Pair, tuple[int, int]]]:
    """(replica, pp pair, world ranks) for every directed pair of every pipeline, in the one order all ranks use."""
    if "pp" not in mesh.names or mesh.dim_size("pp") < 2:
        return []
    return [(replica, pair, (ranks[pair[0]], ranks[pair[1]]))
            for replica, ranks in enumerate(mesh.groups("pp")) for pair in directed_pairs(len(ranks))]


def build(mesh: Mesh, rank: int, device: torch.device) -> dict[str, object]:
    """Make and connect the pipelines' groups (collective: every world rank calls this, in the same order); returns
    {"group": this rank's pipeline group}, empty outside the mesh or with one pipeline rank."""
    if "pp" not in mesh.names or mesh.dim_size("pp") < 2:
        return {}
    mine = {}
    for ranks in mesh.groups("pp"):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine["group"] = group
    if not mine:
        return mine
    probe = torch.zeros(1, device=device)
    dist.all_reduce(probe, group=mine["group"])  # the communicator, made with every rank of the group
    for _, _, (src, dst) in global_order(mesh):  # the first message of each pair, in the global order
        if rank in (src, dst):
            op = dist.P2POp(dist.isend if rank == src else dist.irecv, probe, dst if rank == src else src,
                            group=mine["group"])
            for work in dist.batch_isend_irecv([op]):
                work.wait()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return mine


def connect(name: str, mesh: Mesh) -> None:
    """Make (or make anew) pipeline `name`'s group over `mesh` (collective over the world: every rank calls this;
    ranks outside the mesh only take part in making the groups). Anew: after a step on it was interrupted, the old
    group may hold receives that would take the next step's messages."""
    from nbdist.cluster.launching.ranks.boot import boot
    from nbdist.runtime.ranks import registry

    info = boot()
    fresh = build(mesh, info.rank, torch.device(info.device))
    groups = registry.find(KIND, name)
    if groups is None:
        registry.put(KIND, name, fresh)
    else:  # in place: the pipeline's transport holds this dict
        release(groups)
        groups.clear()
        groups.update(fresh)


def release(groups: dict[str, object]) -> None:
    """Drop a group a step left out of step (an interrupted step's receives cannot be cancelled under FIFO
    matching). NCCL communicators are aborted, so their pending receives end; gloo's are just let go."""
    for group in groups.values():
        abort = getattr(group, "abort", None)
        try:
            if abort is not None and dist.get_backend(group) != "gloo":
                abort()
        except Exception:  # noqa: BLE001, S110 - a group already torn down: nothing left to free
            pass
