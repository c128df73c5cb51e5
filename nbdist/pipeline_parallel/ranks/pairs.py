"""One process group per direction between neighbouring pipeline ranks (this code runs ON the engines).

Why: NCCL matches point-to-point messages between two ranks in the order they were issued (it ignores tags), and all
the messages between a pair share one communicator and one stream. With activations going one way and gradients the
other on that one stream, a receive posted early blocks the send queued behind it: the first GPU step hangs. Here
every *directed* pair of neighbours along a mesh's pp dimension (r -> r+1 and r+1 -> r, around the ring for the
looped placement of interleaved schedules) gets its own group, so each stream carries one-way traffic in program
order; `nbdist.schedules.check_nccl` proves, schedule by schedule, that this order matches on both sides.

Each pipeline has its own pair groups (two pipelines on one mesh would otherwise take each other's messages in
FIFO order), made when it is built. Making groups is collective over the whole world, and NCCL creates a pair's
communicator on its first message, blocking both ranks until the other arrives: set up lazily inside a step, two ranks
that each post a receive first wait for each other. So `build` makes every group in one global order and sends one small
message through each, in that same order, before any step runs: the two ranks of the lowest pair not yet connected have
connected all their earlier pairs, so they always meet. gloo (CPU) takes the same path, with the same FIFO rule (tag 0),
so CPU tests exercise what NCCL will do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nbdist.cluster.mesh import Mesh

KIND = "pipeline pairs"  # registry kind: pipeline name -> {pair: group}
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


def build(mesh: Mesh, rank: int, device: torch.device) -> dict[Pair, object]:
    """Make and connect the pair groups (collective: every world rank calls this, in the same order); returns this
    rank's groups by pp pair."""
    mine: dict[Pair, object] = {}
    ordered = []
    for _, pair, (src, dst) in global_order(mesh):
        group = dist.new_group([src, dst])
        if rank in (src, dst):
            mine[pair] = group
            ordered.append((group, src, dst))
    probe = torch.zeros(1, device=device)
    for group, src, dst in ordered:  # the first message of each pair, in the global order
        if rank == src:
            dist.send(probe, dst, group=group)
        else:
            dist.recv(probe, src, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return mine


def connect(name: str, mesh: Mesh) -> None:
    """Make (or make anew) pipeline `name`'s pair groups over `mesh` (collective over the world: every rank calls
    this; ranks outside the mesh only take part in making the groups). Anew: after a step on them was abandoned,
    the old groups may hold receives that would take the next step's messages."""
    from nbdist.cluster.ranks import registry
    from nbdist.cluster.ranks.boot import boot

    info = boot()
    fresh = build(mesh, info.rank, torch.device(info.device))
    groups = registry.find(KIND, name)
    if groups is None:
        registry.put(KIND, name, fresh)
    else:  # in place: the pipeline's transport holds this dict
        release(groups)
        groups.clear()
        groups.update(fresh)


def release(groups: dict[Pair, object]) -> None:
    """Drop pair groups a step left out of step (an interrupted step's receives cannot be cancelled under FIFO
    matching). NCCL communicators are aborted, so their pending receives end; gloo's are just let go."""
    for group in groups.values():
        abort = getattr(group, "abort", None)
        try:
            if abort is not None and dist.get_backend(group) != "gloo":
                abort()
        except Exception:  # a group already torn down: nothing left to free
            pass
