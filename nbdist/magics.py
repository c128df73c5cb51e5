"""IPython magics: a thin skin over nbdist's Python API (parse arguments, call the API, show the result)."""
from __future__ import annotations

import shlex
from functools import wraps

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from nbdist import cluster as clusters
from nbdist.errors import DistUsageError, show_errors_in_ipython


def _no_arguments(magic: str, line: str) -> None:
    """A magic that takes nothing refuses what it is given, rather than doing its work anyway."""
    if line.strip():
        raise DistUsageError(f"%{magic} takes no arguments, got {line.strip()!r}")


def _parsed(magic, line: str):
    """The magic's arguments, the line split as a shell would (as the functions split mpi_args): IPython's own
    splitting keeps the quotes, so `--mpi-args "-launcher-exec /path"` reached mpiexec as one argument. A line that
    cannot be split (an unclosed quote) is one line too."""
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise DistUsageError(f"cannot read the arguments {line.strip()!r}: {e}") from None
    return magic.parser.parse_args(_values_attached(magic.parser, words))


def _values_attached(parser, words: list[str]) -> list[str]:
    """`--mpi-args "-n 5"` as `--mpi-args=-n 5`: argparse takes a value that begins with a dash for an option of
    its own (here -n) and says "expected one argument"; attached, it is the value, as the function form takes it."""
    takes_value = {option for action in parser._actions if action.nargs is None and action.option_strings
                   for option in action.option_strings if option.startswith("--")}
    out: list[str] = []
    words = iter(words)
    for word in words:
        if word in takes_value:
            value = next(words, None)
            out.append(word if value is None else f"{word}={value}")
        else:
            out.append(word)
    return out


def _usage_errors(method):
    """Bad input becomes IPython's one-line UsageError, with no traceback from nbdist's internals."""

    @wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except DistUsageError as e:
            raise UsageError(str(e)) from None

    return wrapper


def _slurm_choice(args) -> dict | bool | None:
    """--slurm and its options as nbdist.start's `slurm`: True (the current allocation, or one node), or the
    request's choices; asking for nodes without --slurm is refused."""
    request = {name: getattr(args, name) for name in ("nodes", "tasks_per_node", "gpus_per_node", "partition", "time",
                                                        "account") if getattr(args, name) is not None}
    if args.salloc_args:
        request["salloc_args"] = args.salloc_args
    if request and not args.slurm:
        raise DistUsageError(f"--{next(iter(request)).replace('_', '-')} is a Slurm choice: add --slurm")
    if not args.slurm:
        return None
    return request or True


@magics_class
class DistMagics(Magics):
    @magic_arguments()
    @argument("-n", type=int, default=None, help="number of engines (default: one per GPU, else 2)")
    @argument("--cpu", action="store_true", help="CPU engines even where GPUs exist")
    @argument("--backend", default="auto", help="gloo or mpi (CPU engines; mpi: torch.distributed over MPI shared "
              "memory) or nccl (one GPU per engine, CPU tensors through gloo); default: nccl on GPUs, else mpi")
    @argument("--timeout", type=float, default=60.0, help="seconds the start-up may take")
    @argument("--hosts", default="", help="start the engines on these hosts through ssh, e.g. a,b or a:2,b:2 (slots)")
    @argument("--hostfile", default=None, help="MPI's host file: one host[:slots] per line (ssh)")
    @argument("--iface", default=None, help="the network interface the hosts reach each other by, if several")
    @argument("--slurm", action="store_true", help="engines in a Slurm allocation: the current one, or one asked for "
              "with --nodes and the options below (given back at %%dist_stop or when the kernel dies)")
    @argument("--nodes", type=int, default=None, help="Slurm: nodes to ask for")
    @argument("--tasks-per-node", type=int, default=None, help="Slurm: engines per node (default: GPUs per node, or 1)")
    @argument("--gpus-per-node", type=int, default=None, help="Slurm: GPUs per node")
    @argument("--partition", default=None, help="Slurm: partition")
    @argument("--time", default=None, help="Slurm: time limit, e.g. 01:00:00")
    @argument("--account", default=None, help="Slurm: account")
    @argument("--salloc-args", default="", help="Slurm: more salloc arguments, as one string")
    @argument("--mpi-args", default="", help='extra mpiexec arguments, e.g. "-launcher-exec ./my-ssh"')
    @argument("--no-fork", action="store_true", help="start every rank as a fresh process, not forked from this kernel")
    @argument("--restart", action="store_true", help="replace a running cluster")
    @line_magic
    @_usage_errors
    def dist_start(self, line: str) -> None:
        """Start MPI engines with torch.distributed initialised on each."""
        args = _parsed(self.dist_start, line)
        cluster = clusters.start(
            args.n,
            restart=args.restart,
            cpu=args.cpu,
            backend=args.backend,
            timeout=args.timeout,
            mpi_args=args.mpi_args,  # split as a shell would by ClusterOptions
            hosts=args.hosts,
            hostfile=args.hostfile,
            iface=args.iface,
            slurm=_slurm_choice(args),
            fork=not args.no_fork,
        )
        display(cluster.status())

    @line_magic
    @_usage_errors
    def dist_status(self, line: str) -> None:
        """Show rank, host, pid, device, backend and memory of every engine, and what each rank holds."""
        _no_arguments("dist_status", line)
        display(clusters.current().status())

    @line_magic
    @_usage_errors
    def dist_stop(self, line: str) -> None:
        """Stop the engines, the controller and mpiexec."""
        _no_arguments("dist_stop", line)
        cluster = clusters.current()
        cluster.stop()
        print(f"stopped {cluster.world_size} engines")

    @line_magic
    @_usage_errors
    def dist_restart(self, line: str) -> None:
        """Fresh engines and process group, e.g. after a hang."""
        _no_arguments("dist_restart", line)
        display(clusters.current().restart().status())

    @magic_arguments()
    @argument("trainer", help="the name of an nbdist.Trainer in the notebook")
    @argument("--steps", type=int, default=None, help="steps to train")
    @argument("--epochs", type=float, default=None, help="passes over the data set (instead of --steps)")
    @argument("--resume", default=None, help="a checkpoint (or checkpoint folder) to resume from first")
    @argument("--save", action="store_true", help="write a checkpoint at the end")
    @line_magic
    @_usage_errors
    def dist_train(self, line: str) -> None:
        """Train an nbdist.Trainer: %dist_train tr --steps 100 [--resume ckpt] [--save] (tr.history keeps it)."""
        args = _parsed(self.dist_train, line)
        from nbdist.training.trainer import Trainer

        trainer = self.shell.user_ns.get(args.trainer)
        if not isinstance(trainer, Trainer):
            raise UsageError(f"{args.trainer!r} is not an nbdist.Trainer in this notebook")
        if args.resume:
            trainer.resume(args.resume)
        if args.steps or args.epochs:
            trainer.fit(steps=args.steps, epochs=args.epochs)
        if args.save:
            print(f"saved {trainer.save()}")

    @magic_arguments()
    @argument("--ranks", default="all", help="ranks to run on: all, 0, 0,2 or 1-3")
    @argument("--timeout", type=float, default=None, help="seconds before the cell is stopped on every rank")
    @argument("--output", default="rank0", help="whose output to show: rank0, all or none (errors: always)")
    @cell_magic
    @_usage_errors
    def dist(self, line: str, cell: str) -> None:
        """Run the cell on the chosen ranks; output labelled [rank N]."""
        args = _parsed(self.dist, line)
        if args.timeout is not None:
            from nbdist.cluster.options import run_timeout

            run_timeout(args.timeout, "--timeout")
        clusters.current().execute(cell, ranks=args.ranks, timeout=args.timeout, output=args.output)

    @magic_arguments()
    @argument("--last", action="store_true", help="the view made when a cell last timed out or was interrupted")
    @argument("--stacks", action="store_true", help="also every rank's Python stack (innermost last)")
    @line_magic
    @_usage_errors
    def dist_why(self, line: str) -> None:
        """What every rank does now and why the ranks wait: the call each waits in, the rank that never reached
        it and what that rank does instead (each rank's flight recorder and stack)."""
        args = _parsed(self.dist_why, line)
        cluster = clusters.current()
        view = cluster.last_why if args.last else cluster.why()
        if view is None:
            raise DistUsageError("no cell has timed out or been interrupted on this cluster yet: %dist_why without "
                                 "--last asks the ranks now")
        display(view)
        if args.stacks:
            print(view.stacks(list(view.ranks)))

    @line_magic
    @_usage_errors
    def dist_traceback(self, line: str) -> None:
        """Every frame of each rank's traceback in the last failure (a failure shows the user's frames only)."""
        _no_arguments("dist_traceback", line)
        import sys

        from nbdist.cluster.waiting.remote import last_tracebacks, write_grouped

        tracebacks = last_tracebacks()
        if not tracebacks:
            raise DistUsageError("no rank has failed yet in this kernel: nothing to show")
        write_grouped(tracebacks.items(), sys.stdout)


def register(ipython) -> None:
    ipython.register_magics(DistMagics)
    show_errors_in_ipython(ipython)
