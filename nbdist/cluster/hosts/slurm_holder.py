"""What holds a Slurm allocation nbdist asked for (cluster/hosts/slurm.py): run by `salloc` on the kernel's host, it prints
the allocation's SLURM_* variables as one JSON line and waits; when it ends (nbdist stops the cluster, or the
kernel's death ends it through its lifeline), salloc gives the allocation back. Standard library only."""
from __future__ import annotations

import json
import os
import signal
import sys


def main() -> None:
    print(json.dumps({k: v for k, v in os.environ.items() if k.startswith("SLURM_")}), flush=True)
    sys.stdout.close()
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
