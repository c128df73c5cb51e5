"""Option validation happens in the kernel before any process starts: one clear line per problem."""
import pytest

from nbdist.cluster.api import parse_rank_spec
from nbdist.cluster.options import ClusterOptions, max_cpu_engines
from nbdist.errors import DistUsageError


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


def test_mpi_args_given_as_one_string_are_split_as_a_shell_would():
    options = ClusterOptions(n=2, mpi_args='-launcher-exec "/opt/my ssh" -genv A 1')
    assert options.mpi_args == ("-launcher-exec", "/opt/my ssh", "-genv", "A", "1")
    assert ClusterOptions(n=2, mpi_args=["-genv", "A", "1"]).mpi_args == ("-genv", "A", "1")


def test_hosts_become_hydras_arguments_with_the_kernels_address_for_its_proxies():
    options = ClusterOptions(n=4, hosts="127.0.0.1:2, localhost:2", mpi_args="-launcher ssh")
    assert options.hosts == ("127.0.0.1:2", "localhost:2") and options.multi_host()
    assert options.host_names() == ["127.0.0.1", "localhost"]
    assert options.launch_args("10.1.2.3") == ["-hosts", "127.0.0.1:2,localhost:2", "-localhost", "10.1.2.3",
                                               "-launcher", "ssh"]
    assert options.kernel_address() == "127.0.0.1"  # every named host is this one
    single = ClusterOptions(n=2)
    assert single.launch_args("127.0.0.1") == [] and single.kernel_address() == "127.0.0.1"


def test_a_hostfile_names_its_hosts(tmp_path):
    listed = tmp_path / "hosts"
    listed.write_text("# the lab's nodes\nlocalhost:2\n\n127.0.0.1   # the other\n")
    options = ClusterOptions(n=3, hostfile=str(listed))
    assert options.host_names() == ["localhost", "127.0.0.1"]
    assert options.launch_args("10.0.0.1")[:4] == ["-f", str(listed), "-localhost", "10.0.0.1"]


@pytest.mark.parametrize("options, message", [
    (dict(n=2, hosts="a.invalid,b.invalid"), r"^host 'a\.invalid' cannot be resolved"),
    (dict(n=2, hosts="localhost", hostfile="x"), r"^give one of --hosts, --hostfile and --slurm$"),
    (dict(n=2, hostfile="/no/such/hostfile"), r"^--hostfile '/no/such/hostfile': no such file$"),
    (dict(hosts="localhost,127.0.0.1"), r"^give -n when"),
])
def test_bad_hosts_are_refused_in_one_line(options, message):
    with pytest.raises(DistUsageError, match=message) as refused:
        ClusterOptions(**options).resolved(gpus=0)
    assert "\n" not in str(refused.value)


def test_the_address_toward_a_host_is_the_routing_tables_answer():
    from nbdist.cluster.hosts.ranks import addresses

    assert addresses.route_toward("127.0.0.1") == "127.0.0.1"
    assert addresses.address_toward(["localhost"]) == "127.0.0.1"  # only this host: loopback
    assert addresses.interface_address("lo") == "127.0.0.1"
    with pytest.raises(DistUsageError, match=r"^no IPv4 address on network interface 'nbdist-none'"):
        addresses.interface_address("nbdist-none")
