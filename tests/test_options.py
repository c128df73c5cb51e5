"""Option validation happens in the kernel before any process starts: one clear line per problem."""
import pytest

from nbdist.cluster.api import parse_rank_spec
from nbdist.errors import DistUsageError
from nbdist.cluster.options import ClusterOptions, max_cpu_engines


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(n=0), "-n must be at least 1"),
        (dict(n=-3), "-n must be at least 1"),
        (dict(n=100_000), "more engines than this machine can hold"),
        (dict(backend="ucc"), "unknown backend 'ucc': choose auto, gloo, nccl, mpi"),
        (dict(backend="nccl"), "--backend nccl needs GPUs"),
        (dict(timeout=0), "--timeout must be a positive"),
        (dict(timeout="5"), "--timeout must be a number of seconds, got '5'"),
        (dict(n=2.0), "-n must be a whole number, got 2.0"),
        (dict(n=True), "-n must be a whole number, got True"),
        (dict(cpu="yes"), "cpu must be True or False"),
    ],
)
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(DistUsageError, match=message):
        ClusterOptions(**options).resolved()


def test_start_names_an_unknown_option_and_a_wrongly_typed_one_differently():
    import nbdist

    with pytest.raises(DistUsageError, match=r"unknown option\(s\) timout: choose from"):
        nbdist.start(timout=5)
    with pytest.raises(DistUsageError, match="--timeout must be a number of seconds, got '5'"):
        nbdist.start(timeout="5")


def test_defaults_to_two_cpu_engines_without_gpus():
    assert ClusterOptions().resolved().n == 2
    assert ClusterOptions(n=3).resolved().n == 3
    assert max_cpu_engines() >= 2


@pytest.mark.parametrize(
    "spec, ranks", [("all", [0, 1, 2, 3]), ("0", [0]), ("0,2", [0, 2]), ("1-3", [1, 2, 3]), ("0,2-3", [0, 2, 3])]
)
def test_rank_specs(spec, ranks):
    assert parse_rank_spec(spec, 4) == ranks


def test_bad_rank_spec():
    with pytest.raises(DistUsageError, match="--ranks 'x'"):
        parse_rank_spec("x", 4)
