"""Engine entry point: `python -m nbdist.cluster.ranks.main [ipengine args]`, launched by mpiexec once per rank.

Order matters for start-up time: the lifeline first (no orphans), then the slow part (import torch, MPI
rendezvous, process group) while the controller is still starting, and only then the ipyparallel engine, which
waits for the controller's connection file if it is not there yet.
"""
from __future__ import annotations

import sys


def main() -> None:
    from nbdist.cluster import lifeline

    lifeline.start()
    from nbdist.cluster.ranks import boot

    boot.boot()
    from ipyparallel.engine.app import main as ipengine_main

    sys.argv[0] = "ipengine"
    ipengine_main()


if __name__ == "__main__":
    main()
