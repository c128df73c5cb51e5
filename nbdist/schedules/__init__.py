"""Pipeline schedules as plain data: build one, check it, simulate its timeline, draw it.

    from nbdist import schedules
    s = schedules.build("1f1b", stages=4, microbatches=8)
    s.actions[0]                 # ['0F0', '0SEND_F0', ...] in torch.distributed.pipelining's text form
    t = s.simulate(forward=1, backward=2)
    t.bubble_fraction            # 3/11
    t.figure()                   # plotly Gantt, one row per rank
"""
from nbdist.schedules.actions import Action
from nbdist.schedules.generators import NAMES, build
from nbdist.schedules.nccl import check_nccl
from nbdist.schedules.schedule import Schedule
from nbdist.schedules.simulate import Timeline, simulate

__all__ = ["NAMES", "Action", "Schedule", "Timeline", "build", "check_nccl", "simulate"]
