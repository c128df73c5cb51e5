"""Hydra's launcher (ssh, or srun), wrapped so that the lifeline's token reaches the engines on other hosts without
crossing the network in clear. Runs on the kernel's host, in place of the launcher mpiexec would run.

Why: mpiexec hands the engines' environment to its proxies over its own TCP connection, in clear, so a token there
is read by anyone who captures the cluster's network (and with it the controller's keys, which come down the
lifeline). ssh's channel is encrypted and authenticated, and mpiexec leaves it unused once the proxy runs (it
forwards the ranks' stdin over its own connection), so the token goes down ssh's stdin: the remote command
becomes `PYTHON -S -c RECEIVE NBDIST_LIFELINE_TOKEN "hydra_pmi_proxy" ARGS...`, which reads the token, puts it in
its own environment (readable by this user alone there) and becomes Hydra's proxy, whose ranks inherit it. mpiexec's
own environment never holds it, so nothing of Hydra's overrides it.

srun starts its tasks with its own environment, which Slurm carries to the nodes in its launch request (signed
with munge, not encrypted): the token goes there, which is off Hydra's connection but not off the network
(docs/security.md says so).

    python -S token_launcher.py ssh|srun LAUNCHER TOKEN_FILE PYTHON [the launcher's arguments, as Hydra gives them]

Standard library only, run with -S: it is started for every host at every start.
"""
from __future__ import annotations

import os
import shlex
import sys

TOKEN_ENV = "NBDIST_LIFELINE_TOKEN"  # cluster/hosts/lifeline.py's name (this file imports nothing of nbdist's)
PROXY = "hydra_pmi_proxy"
# Reads its stdin to the end (the token, then EOF), keeps it in the environment, becomes the proxy. No quote, no "!"
# and no "$" inside: it passes through any remote login shell within single quotes.
RECEIVE = ("import os,sys;"
           "os.environ[sys.argv[1]]=bytes().join(iter(lambda:os.read(0,4096),bytes())).decode().strip();"
           "os.execv(sys.argv[2],sys.argv[2:])")


# Runs the receiver if the host has the kernel's Python, else says so naming the host (Hydra only relays the remote
# shell's "python: No such file or directory", naming none). One line of sh without "!": any login shell passes it.
CHECK = ('test -x "$0" || {{ echo "nbdist: host {host} has no $0 (the Python of the kernel, which its engines run): '
         'make the same environment at the same path there" >&2; exit 127; }}; exec "$0" "$@"')


def remote_command(args: list[str], python: str) -> list[str] | None:
    """ssh's arguments with the receiver put before Hydra's proxy; None where no proxy is named (not Hydra's)."""
    at = next((i for i, arg in enumerate(args) if PROXY in arg), None)
    if at is None:
        return None
    host = args[at - 1] if at and all(c.isalnum() or c in ".:-_@[]" for c in args[at - 1]) else "(unnamed)"
    return args[:at] + ["sh", "-c", shlex.quote(CHECK.format(host=host)), shlex.quote(python), "-S", "-c",
                        shlex.quote(RECEIVE), TOKEN_ENV] + args[at:]


def main() -> None:
    kind, launcher, token_file, python, *args = sys.argv[1:]
    with open(token_file) as f:
        token = f.read().strip()
    if kind == "srun":
        os.environ[TOKEN_ENV] = token
        os.execvp(launcher, [launcher, *args])
    wrapped = remote_command(args, python)
    if wrapped is not None:
        read, write = os.pipe()
        os.write(write, token.encode() + b"\n")  # 33 bytes: within any pipe's buffer
        os.close(write)
        os.dup2(read, 0)
        os.close(read)
        args = wrapped
    os.execvp(launcher, [launcher, *args])


if __name__ == "__main__":
    main()
