"""The hang view on real engines: a cell that hangs is explained in one sentence naming the rank that never reached
the collective and what it does instead, within the cell's timeout + 2 s, and the cluster stays usable.

Each case is one a user meets: a collective one rank skips (it waits in a receive instead), the same on a 2 x 2 mesh's
dp group, a rank stuck in a loop of its own (its stack is shown), a shape mismatch (named before any timeout), and a
view asked for between cells (`Cluster.why`, what `%dist_why` shows).
"""
from __future__ import annotations

import re
import time

import pytest

from nbdist.errors import DistError, DistUsageError

TIMEOUT = 3.0

SKIPPED_COLLECTIVE = """
import torch, torch.distributed as dist
t = torch.ones(256)
dist.all_reduce(t)
if dist.get_rank() == 2:
    x = torch.zeros(4)
    dist.recv(x, src=1)
else:
    dist.all_reduce(t)
"""


def _all_reduce_world() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def test_a_rank_that_skips_a_collective_is_named_with_what_it_does_instead(cluster4):
    started = time.monotonic()
    with pytest.raises(DistError) as raised:
        cluster4.execute(SKIPPED_COLLECTIVE, timeout=TIMEOUT, output="none")
    message = str(raised.value)
    first = message.split("; nbdist interrupted")[0]
    assert re.fullmatch(
        r"timed out after 3 s: ranks 0, 1, 3 wait in all_reduce #(\d+) on the group of ranks \[0, 1, 2, 3\]; "
        r"rank 2 never reached it: it waits in recv from rank 1 on the group of ranks \[0, 1, 2, 3\], called from "
        r"cell In\[\d+\]:6 in <module>", first), message
    view = cluster4.last_why
    assert view.sentence in message  # the view was made when the cell timed out, before the ranks were freed
    assert time.monotonic() - started < TIMEOUT + 2 + 4  # + the interrupt and the groups' renewal
    rows = {row["rank"]: row for row in view.rows()}
    assert rows[2]["state"] == "waits" and rows[2]["call"].startswith("recv from rank 1")
    assert rows[2]["bytes"] == "16 B" and rows[0]["bytes"] == "1 KiB"
    assert all(rows[r]["where"].endswith(":8 in <module>") for r in (0, 1, 3))
    assert cluster4.run(_all_reduce_world) == [4.0] * 4  # usable after, no restart


def test_the_view_is_ready_within_the_timeout_plus_two_seconds(cluster4):
    """The sentence is made (by Cluster.why, called by the wait) before the stuck ranks are freed: timed here from
    the cell's start to the view's making."""
    made = []
    why = cluster4.why

    def timed_why(*args, **kwargs):
        view = why(*args, **kwargs)
        made.append(time.monotonic())
        return view

    cluster4.why = timed_why
    try:
        started = time.monotonic()
        with pytest.raises(DistError):
            cluster4.execute(SKIPPED_COLLECTIVE, timeout=TIMEOUT, output="none")
    finally:
        del cluster4.why
    assert made and made[0] - started < TIMEOUT + 2, f"view made after {made[0] - started:.2f} s"
    assert cluster4.run(_all_reduce_world) == [4.0] * 4


MESH_CELL = """
import torch, torch.distributed as dist
from nbdist.cluster.meshes.ranks.rank_mesh import here
me = here("{name}")
t = torch.ones(8)
if dist.get_rank() != 3:
    dist.all_reduce(t, group=me.group("dp"))
else:
    import time
    while True:
        time.sleep(0.01)
"""


def test_a_missing_rank_on_a_mesh_group_is_named_with_the_group(cluster4):
    mesh = cluster4.mesh(dp=2, pp=2)
    dp_of_3 = mesh.group_of("dp", 3)
    with pytest.raises(DistError) as raised:
        cluster4.execute(MESH_CELL.format(name=mesh.name), timeout=TIMEOUT, output="none")
    message = str(raised.value)
    # rank 3's dp group: the other member waits in it, naming the group by its dimension; rank 3 runs its loop
    match = re.search(r"rank (\d) waits in all_reduce #\d+ on group dp \(ranks \[(\d), (\d)\]\); rank 3 never reached "
                      r"it: it runs cell In\[\d+\]:10 in <module>, outside any communication call", message)
    assert match, message
    assert match.group(1) in match.group(2, 3)
    assert sorted(int(r) for r in match.group(2, 3)) == sorted(dp_of_3)
    assert cluster4.run(_all_reduce_world) == [4.0] * 4


SPINNING_CELL = """
import torch.distributed as dist
def spin_forever():
    n = 0
    while True:
        n += 1
if dist.get_rank() == 1:
    spin_forever()
else:
    dist.barrier()
"""


def test_a_rank_stuck_in_pure_python_shows_its_stack(cluster):
    with pytest.raises(DistError) as raised:
        cluster.execute(SPINNING_CELL, timeout=TIMEOUT, output="none")
    message = str(raised.value)
    assert re.search(r"rank 0 waits in barrier #\d+ on the group of ranks \[0, 1\]; rank 1 never reached it: it runs "
                     r"cell In\[\d+\]:[45] in spin_forever, outside any communication call", message), message
    stacks = cluster.last_why.stacks()
    assert re.search(r"rank 1, innermost last:\n  cell In\[\d+\]:7 in <module>: spin_forever\(\)\n"
                     r"  cell In\[\d+\]:[45] in spin_forever: (n \+= 1|while True:)", stacks), stacks
    assert "rank 1, innermost last" in str(cluster.last_why)  # shown with the table


def test_after_a_freed_hang_a_call_numbered_again_from_1_is_not_taken_for_the_old_one(cluster4):
    """A freed hang renews the groups, which number their calls from #1 again; a rank whose last call was the old
    all_reduce #1 has not "completed" the new barrier #1 (lab 38 said so of a rank that was looping)."""
    with pytest.raises(DistError):
        cluster4.execute(SKIPPED_COLLECTIVE, timeout=TIMEOUT, output="none")
    with pytest.raises(DistError) as raised:
        cluster4.execute(SPINNING_CELL, timeout=TIMEOUT, output="none")
    message = str(raised.value)
    assert re.search(r"ranks 0, 2, 3 wait in barrier #1 on the group of ranks \[0, 1, 2, 3\]; rank 1 never reached "
                     r"it: it runs cell In\[\d+\]:[45] in spin_forever", message), message
    assert "completed" not in message.split("; nbdist interrupted")[0], message
    assert cluster4.run(_all_reduce_world) == [4.0] * 4


def test_a_shape_mismatch_is_named_before_any_timeout(cluster):
    started = time.monotonic()
    with pytest.raises(DistError) as raised:
        cluster.execute("import torch, torch.distributed as dist\n"
                        "t = torch.ones(4 if dist.get_rank() == 0 else 8)\ndist.all_reduce(t)", timeout=30,
                        output="none")
    assert time.monotonic() - started < 10
    assert re.search(r"disagree on a collective: .*rank 0.*4.*rank 1.*8", str(raised.value)), str(raised.value)


RUNS_CELL = """
import time, torch, torch.distributed as dist
dist.barrier()
for _ in range(5):
    dist.all_reduce(torch.ones(256))
for _ in range(3):
    dist.all_reduce(torch.ones(8))
if dist.get_rank() == 0:
    time.sleep(0.5)
dist.all_reduce(torch.ones(8))
dist.broadcast(torch.ones(4), 0)
"""


def _recorded() -> list[dict]:
    from nbdist.debugging.ranks import recorder

    return recorder.tail(recorder.SIZE)


def test_sums_are_recorded_as_runs_and_every_call_is_accounted_for(cluster):
    """The backend's hot path writes one entry per run of sums of one size (recorder.py, "Runs"), the one rank 1
    waited 0.5 s in included: on real ranks every call is still accounted for, in order."""
    cluster.execute(RUNS_CELL, output="none")
    for rank, calls in enumerate(cluster.run(_recorded)):
        barrier = max(i for i, c in enumerate(calls) if c["call"] == "barrier")
        after = calls[barrier + 1:]
        seqs = [n for c in after for n in range(c["first"], c["seq"] + 1)]
        first = calls[barrier]["seq"] + 1
        assert seqs == list(range(first, first + 10)), after  # 9 sums and the broadcast, each once, in order
        assert [c["numel"] for c in after for _ in range(c["calls"])] == [256] * 5 + [8] * 4 + [4]
        assert all(c["done"] for c in after), after
        assert len(after) == 3, after  # runs (256, then 8 elements) and the broadcast, not one entry per call


def test_why_between_cells_says_every_engine_waits_for_the_next_cell(cluster):
    cluster.run(_all_reduce_world)
    started = time.monotonic()
    view = cluster.why()
    assert time.monotonic() - started < 1.0
    assert view.sentence == "no rank is running a cell: every engine waits for the next one"
    rows = view.rows()
    assert [row["state"] for row in rows] == ["idle", "idle"]
    assert all(re.fullmatch(r"all_reduce #\d+ on the group of ranks \[0, 1\]", row["last done"]) for row in rows)


def test_why_while_a_cell_runs_in_the_background(cluster):
    """Asked from another thread while the ranks are in a cell (a live dashboard, or a second notebook thread)."""
    import threading

    errors = []

    def hang():
        try:
            cluster.execute("import time, torch, torch.distributed as dist\n"
                            "if dist.get_rank() == 0:\n    time.sleep(2.5)\ndist.all_reduce(torch.ones(1))",
                            timeout=20, output="none")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=hang)
    thread.start()
    time.sleep(1.0)
    view = cluster.why()
    thread.join(30)
    assert not errors, errors
    assert re.fullmatch(r"rank 1 waits in all_reduce #\d+ on the group of ranks \[0, 1\]; rank 0 never reached it: "
                        r"it runs cell In\[\d+\]:3 in <module>, outside any communication call", view.sentence), \
        view.sentence


def test_dist_why_last_before_any_hang_is_one_line():
    from nbdist.cluster.api import Cluster

    fresh = Cluster(n=2)
    with pytest.raises(DistUsageError, match="the cluster is stopped"):
        fresh.why()


def test_on_gloo_the_view_reads_torchs_own_recorder(shared_clusters):
    """A gloo cluster: nbdist's recorder sees none of gloo's calls, torch's own flight recorder does (boot turns it
    on); the rank waiting in gloo's all_reduce is named with its call's number, the other's loop with its line."""
    import nbdist
    from nbdist.cluster.options import ClusterOptions

    shared_clusters.release(4)
    with nbdist.Cluster(ClusterOptions(n=2, backend="gloo")) as gloo:
        gloo.run(_all_reduce_world)
        with pytest.raises(DistError) as raised:
            gloo.execute("import time, torch, torch.distributed as dist\nif dist.get_rank() == 1:\n"
                         "    while True:\n        time.sleep(0.01)\ndist.all_reduce(torch.ones(8))",
                         timeout=TIMEOUT, output="none")
        assert re.search(r"rank 0 waits in all_reduce #2 on the group of ranks \[0, 1\]; rank 1 never reached it: it "
                         r"runs cell In\[\d+\]:4 in <module>, outside any communication call", str(raised.value)), \
            str(raised.value)
        rows = {row["rank"]: row for row in gloo.last_why.rows()}
        assert rows[1]["last done"] == "all_reduce #1 on the group of ranks [0, 1]"
