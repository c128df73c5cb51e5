"""What a Waiter asks of the cluster whose ranks it waits on, as one small interface (`WaitedOn`), and a running
cluster's answers (`Recovery`): where each rank runs, whether the engines live, which rank died, how to interrupt a
rank on any host, how to bring the ranks back in step after a failure, what follows a death, and the hang view.

Kernel side. The waiter (remote.py) decides when; this module says how, for nbdist's clusters."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from nbdist.cluster.waiting.deaths import DeathWatch
from nbdist.cluster.waiting.ranks import gpu_sync, groups, mpi_groups
from nbdist.cluster.waiting.tracebacks import ranks_label

if TYPE_CHECKING:
    import ipyparallel as ipp

    from nbdist.cluster.hosts.lifeline_server import LifelineServer

GPU_SYNC_SECONDS = 10.0  # after a rank failed on GPUs, how long the others' queued GPU work may take to complete
GROUPS_SECONDS = 10.0  # how long the ranks may take to say which groups they hold (each answers alone)


class WaitedOn(Protocol):
    """The cluster, as a Waiter sees it."""

    def pids(self) -> dict[int, tuple[str, int]]:
        """rank -> (host, pid) of its engine."""

    def alive(self) -> bool:
        """Every engine is still running (as its launcher sees it)."""

    def death(self) -> str | None:
        """A line naming the rank that died, as soon as its process is gone, or None."""

    def signal_rank(self, rank: int, number: int) -> bool:
        """Send a signal to one rank's engine, on any host; False when it is gone."""

    def back_in_step(self) -> str:
        """After a failure the engines survived: bring them back in step; what was done ("" for nothing)."""

    def after_death(self) -> str | None:
        """What follows a death, said; None: restart the engines."""

    def restart(self) -> Any:
        """Fresh engines: the way out when stuck ranks cannot be freed otherwise."""

    def why(self) -> Any:
        """The hang view: what each rank waits in (asked before stuck ranks are freed); None where none can be."""


class ClusterFace(Protocol):
    """What Recovery uses of a Cluster: its public face (api.Cluster is one)."""

    world_size: int
    devices: list[str]
    generation: int | None

    def restart(self) -> Any: ...

    def signal_rank(self, rank: int, number: int) -> bool: ...

    def why(self) -> Any: ...


class Recovery:
    """A running nbdist Cluster's answers to its waiter."""

    def __init__(self, cluster: ClusterFace, engines: ipp.Cluster, lifeline: LifelineServer | None, rows: list[dict],
                 view: Callable[[list[int]], Any], end: Callable[[], None]):
        """`engines`: the ipyparallel cluster the launch made; `rows`: each rank's status row from its start."""
        self.cluster, self.engines, self.rows, self.view, self.end = cluster, engines, rows, view, end
        launcher = next(iter(engines.engines.values()), None)
        self.watch = DeathWatch(self.pids(), getattr(launcher, "output_file", None),
                                lost=lifeline.lost if lifeline else None,
                                launched={row["rank"]: row.get("launched_pid") or row["pid"] for row in rows},
                                records=getattr(engines, "profile_dir", None))

    def pids(self) -> dict[int, tuple[str, int]]:
        return {row["rank"]: (row["host"], row["pid"]) for row in self.rows}

    def alive(self) -> bool:
        return all(es.state == "running" for es in self.engines.engines.values())

    def death(self) -> str | None:
        return self.watch.check()

    def signal_rank(self, rank: int, number: int) -> bool:
        return self.cluster.signal_rank(rank, number)

    def restart(self) -> Any:
        return self.cluster.restart()

    def why(self) -> Any:
        return self.cluster.why()

    def after_death(self) -> str:
        """One rank's death ended the MPI job: the cluster says so on its next use (until restarted), so that the
        error names the dead rank at once rather than after the seconds a restart takes."""
        self.end()
        return "%dist_restart (or cluster.restart()) starts fresh engines; engine variables are lost"

    def back_in_step(self) -> str:
        """After a rank failed and the engines survived: GPUs synchronised (or the engines restarted), then nbdist's
        MPI groups renewed. Returns what was done, for the error line ("" when nothing needed doing)."""
        generation = self.cluster.generation
        done = self.gpus_in_step() if any(d.startswith("cuda") for d in self.cluster.devices) else ""
        if self.cluster.generation != generation:  # restarted: fresh engines hold no group to renew
            return done
        unrenewable = self.groups_apart()
        return "; ".join(part for part in (done, unrenewable or self.renew_mpi_groups()) if part)

    def groups_apart(self) -> str:
        """Why the ranks cannot be renewed together ("" when they can): a rank whose process group was destroyed
        holds no group to renew, and the others would wait for it."""
        ranks = list(range(self.cluster.world_size))
        try:
            held = self.view(ranks).apply_async(groups.has_process_group).get(timeout=GROUPS_SECONDS)
        except Exception as e:  # noqa: BLE001 - said in the error line; a restart is the user's next step
            return (f"asking the ranks for their process groups failed ({type(e).__name__}), so they were not "
                    "brought back in step: restart with %dist_restart")
        destroyed = [rank for rank, has in zip(ranks, held) if not has]
        if not destroyed:
            return ""
        return (f"{ranks_label(destroyed)} {'has' if len(destroyed) == 1 else 'have'} no process group any more "
                "(torch.distributed.destroy_process_group() ended it), so no collective can run: %dist_restart (or "
                "cluster.restart()) starts fresh engines with a new one; engine variables are lost")

    def renew_mpi_groups(self) -> str:
        """After ranks were interrupted inside an operation of nbdist's MPI backend, its groups are out of step (MPI
        cannot cancel a collective): every rank gives each of them a fresh communicator (the process group's
        `renew`), and the engines and their variables are kept. Said only where some rank gave up an operation."""
        ranks = list(range(self.cluster.world_size))
        try:
            renewed = self.view(ranks).apply_async(mpi_groups.renew).get(timeout=60)
        except Exception as e:  # noqa: BLE001 - said in the error line; a restart is the user's next step
            return f"renewing the MPI groups failed ({type(e).__name__}): restart with %dist_restart"
        count = max((groups for groups, _ in renewed), default=0)
        if not any(broken for _, broken in renewed):
            return ""  # no operation was given up: renewed quietly (a stray message may have been left behind)
        return f"their {count} MPI group(s) renewed, engine variables kept"

    def gpus_in_step(self) -> str:
        """After a rank failed on GPUs: NCCL collectives the others queued may wait for it and later pair with the
        wrong operation. Every rank synchronises its GPU within GPU_SYNC_SECONDS; if one cannot, the only safe way
        back is fresh engines (ranks/gpu_sync.py). Returns what was done, for the error line."""
        ranks = list(range(self.cluster.world_size))
        try:
            ar = self.view(ranks).apply_async(gpu_sync.synchronise, GPU_SYNC_SECONDS)
            finished = ar.get(timeout=GPU_SYNC_SECONDS + 10)
        except Exception:
            finished = [False] * len(ranks)
        behind = [r for r, ok in zip(ranks, finished) if ok is not True]
        if not behind:
            return f"every rank's GPU work then completed (synchronised within {GPU_SYNC_SECONDS:g} s): in step"
        self.cluster.restart()
        return (f"rank(s) {', '.join(map(str, behind))} still had GPU work waiting after {GPU_SYNC_SECONDS:g} s "
                "(an NCCL operation the failed rank never joined), so nbdist restarted the engines: fresh processes "
                "and process group, engine variables lost")
