"""Hydra's launcher (ssh, or srun), wrapped so that the lifeline's token reaches the engines on other hosts without
crossing the network in clear. Runs on the kernel's host, in place of the launcher mpiexec would run.

Why: mpiexec hands the engines' environment to its proxies over its own TCP connection, in clear, so a token there
is read by anyone who captures the cluster's network (and with it the controller's keys, which come down the
lifeline). ssh's channel is encrypted and authenticated, and mpiexec leaves it unused once the proxy runs (it
forwards the ranks' stdin over its own connection), so the token goes down ssh's stdin: the remote command
becomes `PYTHON -S -c RECEIVE NBDIST_LIFELINE_TOKEN "hydra_pmi_proxy" ARGS...`, which reads the token, puts it in
its own environment (readable by this user alone there) and becomes Hydra's proxy, whose ranks inherit it. mpiexec's
own environment never holds it, so nothing of Hydra's overrides it.

srun has no such channel: it starts its tasks with its own environment, which Slurm carries to the nodes in its
launch request, signed by munge but not encrypted. Hydra runs srun once per start (`srun [--nodelist ...] -N n -n n
--input none hydra_pmi_proxy ARGS...`: one proxy per node, MPICH's bootstrap/external/slurm_launch.c), so the
token goes there as MUNGE credentials, one per task: `munge --restrict-uid=<this uid>` encrypts it with the site's
key (munged's default cipher, AES), and only this user's `unmunge` on a node of the site decodes it, once (munged
refuses a replay, and an expired one). The proxy's command becomes `PYTHON -S -c RECEIVE_MUNGE ...
"hydra_pmi_proxy" ARGS...`, which decodes its task's credential, keeps the token in its environment and becomes the
proxy; a node where that fails says so in one line naming it (the kernel ends the start on that line:
launching/launch_output.py). The token goes to munge on its stdin, never on a command line. Where the kernel's
host has no working munge (cluster/launching/across_hosts.py asks) the token goes in srun's environment, in clear,
and the cluster's status says so ("open: ...", docs/security.md).

    python -S token_launcher.py ssh|srun|munge[=SOCKET] LAUNCHER TOKEN_FILE PYTHON [the launcher's arguments]

Standard library only, run with -S: it is started for every host at every start.
"""
from __future__ import annotations

import os
import shlex
import sys

TOKEN_ENV = "NBDIST_LIFELINE_TOKEN"  # cluster/hosts/lifeline.py's name (this file imports nothing of nbdist's)
CREDENTIALS_ENV = "NBDIST_LIFELINE_MUNGE"  # srun's environment: the token's MUNGE credentials, one per task
UNREAD = "could not read the lifeline's token"  # what a node says when it cannot (launch_output.py looks for it)
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


def proxy_at(args: list[str]) -> int | None:
    """Where Hydra's proxy is named in the launcher's arguments (None: not Hydra's)."""
    return next((i for i, arg in enumerate(args) if PROXY in arg), None)


def remote_command(args: list[str], python: str) -> list[str] | None:
    """ssh's arguments with the receiver put before Hydra's proxy; None where no proxy is named (not Hydra's)."""
    at = proxy_at(args)
    if at is None:
        return None
    host = args[at - 1] if at and all(c.isalnum() or c in ".:-_@[]" for c in args[at - 1]) else "(unnamed)"
    return args[:at] + ["sh", "-c", shlex.quote(CHECK.format(host=host)), shlex.quote(python), "-S", "-c",
                        shlex.quote(RECEIVE), TOKEN_ENV] + args[at:]


# Under srun (no shell between: any text passes): decodes this task's credential with unmunge, keeps the token,
# becomes the proxy; else one line naming the node, and exit 1. unmunge says a refusal on stderr, or (a replay) in
# the STATUS it writes before the payload. Arguments: the token's variable, the credentials', munged's socket ("":
# unmunge's default), the proxy and its arguments.
RECEIVE_MUNGE = f"""
import os, subprocess, sys
name, held, socket = sys.argv[1:4]
credentials = os.environ.pop(held, "").split()
task = int(os.environ.get("SLURM_PROCID") or 0)
node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
why = ""
try:
    done = subprocess.run(["unmunge", "--keys=STATUS"] + (["--socket=" + socket] if socket else []),
                          input=credentials[task].encode(), capture_output=True, timeout=60, check=False)
    status, _, token = done.stdout.decode(errors="replace").partition("\\n\\n")
    said = done.stderr.decode(errors="replace").strip().splitlines() or [status.partition(":")[2].strip()]
    why = said[-1] if done.returncode else "" if token.strip() else "the credential holds no token"
except IndexError:
    why = "no credential for task %d (srun was given %d)" % (task, len(credentials))
except FileNotFoundError:
    why = "no unmunge on PATH"
except (OSError, subprocess.SubprocessError) as e:
    why = "unmunge: %s" % e
if why:
    sys.stderr.write("nbdist: node %s {UNREAD} (a MUNGE credential): %s\\n" % (node, why))
    sys.exit(1)
os.environ[name] = token.strip()
os.execv(sys.argv[4], sys.argv[4:])
"""


def srun_command(args: list[str], python: str, socket: str) -> list[str] | None:
    """srun's arguments with the munge receiver put before Hydra's proxy; None where no proxy is named."""
    at = proxy_at(args)
    if at is None:
        return None
    return args[:at] + [python, "-S", "-c", RECEIVE_MUNGE, TOKEN_ENV, CREDENTIALS_ENV, socket] + args[at:]


def tasks(args: list[str]) -> int:
    """How many tasks srun is asked for (Hydra: `-n <nodes>`), 1 where it does not say."""
    for i, arg in enumerate(args[:proxy_at(args)]):
        value = arg.split("=", 1)[1] if arg.startswith("--ntasks=") else (
            args[i + 1] if arg in ("-n", "--ntasks") and i + 1 < len(args) else None)
        if value is not None and value.isdigit():
            return int(value)
    return 1


def credentials(token: str, socket: str, count: int) -> list[str]:
    """`count` MUNGE credentials of the token, each decodable once, by this user only; exits in one line if munge
    fails."""
    import subprocess  # here: the ssh path, started for every host, does without it

    command = ["munge", f"--restrict-uid={os.getuid()}"] + ([f"--socket={socket}"] if socket else [])
    made = []
    for _ in range(count):
        try:
            done = subprocess.run(command, input=token.encode(), capture_output=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            sys.exit(f"nbdist: munge could not encode the lifeline's token: {e}")
        if done.returncode:
            said = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {done.returncode}"]
            sys.exit(f"nbdist: munge could not encode the lifeline's token: {said[-1]}")
        made.append(done.stdout.decode().strip())
    return made


def main() -> None:
    kind, launcher, token_file, python, *args = sys.argv[1:]
    with open(token_file) as f:
        token = f.read().strip()
    if kind == "srun":  # no working munge on the kernel's host: in srun's environment, in clear (status says so)
        os.environ[TOKEN_ENV] = token
        os.execvp(launcher, [launcher, *args])
    if kind.startswith("munge"):
        socket = kind.partition("=")[2]
        wrapped = srun_command(args, python, socket)
        if wrapped is not None:
            os.environ[CREDENTIALS_ENV] = " ".join(credentials(token, socket, tasks(args)))
            args = wrapped
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
