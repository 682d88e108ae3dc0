"""Hostfiles with bare host names, and Kubeflow's MPI Operator (mgpu_launcher.hostfiles).

The canned files are what the operator writes (github.com/kubeflow/mpi-operator,
pkg/controller/mpi_job_controller.go): v0.8.2 writes ``HOST slots=N`` per worker into
/etc/mpi/hostfile (newConfigMap); before v0.4.0 the v2beta1 controller wrote bare names
(v2/pkg/controller/mpi_job_controller.go at v0.3.0); every version sets
OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile and OMPI_MCA_orte_set_default_slots=
<slotsPerWorker> in the launcher pod, and its elastic /etc/mpi/discover_hosts.sh prints one
``echo HOST`` per running worker, without slots (updateDiscoverHostsInConfigMap).
"""

import os
import shlex

import pytest

import elastickit
from mgpu_launcher import api, cli, discovery, hostfiles

BARE = "pi-worker-0.pi-worker\npi-worker-1.pi-worker\n"  # operator v0.3.0
WITH_SLOTS = "pi-worker-0.pi.default.svc slots=2\npi-worker-1.pi.default.svc slots=2\n"  # v0.8.2
OPERATOR_VARIABLES = ("OMPI_MCA_orte_default_hostfile", "OMPI_MCA_orte_set_default_slots",
                      "MGPU_SLOTS_PER_HOST", "K_MPI_JOB_ROLE", "OMPI_MCA_btl")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture
def operator(tmp_path, monkeypatch):
    """A launcher pod's environment: the hostfile's path in the variable the operator sets."""
    for name in OPERATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "hostfile"
    monkeypatch.setenv("OMPI_MCA_orte_default_hostfile", str(path))

    def write(text, slots_per_worker=None):
        path.write_text(text)
        if slots_per_worker is not None:
            monkeypatch.setenv("OMPI_MCA_orte_set_default_slots", str(slots_per_worker))
        return str(path)
    return write


def _dry_run(capsys, *argv):
    status = cli.main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    return status, shlex.split(out) if status == 0 else [], err


def test_bare_names_get_the_mpijobs_slots_per_worker(operator, script, capsys):
    operator(BARE, slots_per_worker=4)
    status, command, err = _dry_run(capsys, "-np", "8", script)
    assert status == 0, err
    at = command.index("-H")
    assert command[at + 1] == "pi-worker-0.pi-worker:4,pi-worker-1.pi-worker:4"
    assert "--hostfile" not in command
    # mpirun gets only these hosts (Open MPI 4 would read the variable's file too) and may use
    # the network: the job spans hosts
    _, _, env = api.build_job(cli.parse_args(["-np", "8", script]))
    assert "OMPI_MCA_orte_default_hostfile" not in env and "OMPI_MCA_btl" not in env


def test_a_hostfile_with_slots_reaches_mpirun_as_it_is(operator, script, capsys):
    """Open MPI 5 ignores OMPI_MCA_orte_default_hostfile: without --hostfile every rank would
    start in the launcher pod."""
    path = operator(WITH_SLOTS, slots_per_worker=2)
    status, command, err = _dry_run(capsys, "-np", "4", script)
    assert status == 0, err
    assert command[command.index("--hostfile") + 1] == path and "-H" not in command


def test_too_few_slots_from_bare_names_is_an_error_naming_the_flag(operator, script, capsys):
    path = operator(BARE)
    status, _, err = _dry_run(capsys, "-np", "8", script)
    assert status == 2
    assert err.strip() == (
        f"mgpu-train: error: $OMPI_MCA_orte_default_hostfile {path} lists 2 hosts without "
        f"slots=N, which count 1 slot each: 2 slots for -np 8. Say how many processes each "
        f"host runs (its GPUs): --slots-per-host 4 (or MGPU_SLOTS_PER_HOST, or 'HOST slots=N' "
        f"lines in the file)")
    # as many ranks as bare names: one each, on every host (not all on the first one)
    status, command, err = _dry_run(capsys, "-np", "2", script)
    assert status == 0, err
    assert command[command.index("-H") + 1] == "pi-worker-0.pi-worker:1,pi-worker-1.pi-worker:1"


def test_the_flag_wins_over_the_variables(operator, script, capsys, monkeypatch):
    operator(BARE, slots_per_worker=4)
    monkeypatch.setenv("MGPU_SLOTS_PER_HOST", "3")
    assert str(cli.parse_args(["-np", "6", script]).hosts).endswith("-1.pi-worker:3")
    config = cli.parse_args(["-np", "4", "--slots-per-host", "2", script])
    assert str(config.hosts) == "pi-worker-0.pi-worker:2,pi-worker-1.pi-worker:2"
    monkeypatch.setenv("MGPU_SLOTS_PER_HOST", "many")
    assert cli.main(["-np", "2", "--dry-run", script]) == 2
    assert "MGPU_SLOTS_PER_HOST='many': expected a whole number of processes per host >= 1" \
        in capsys.readouterr().err
    monkeypatch.delenv("MGPU_SLOTS_PER_HOST")
    assert cli.main(["-np", "2", "--dry-run", "--slots-per-host", "0", script]) == 2
    assert "--slots-per-host '0': expected a whole number" in capsys.readouterr().err
    assert cli.main(["--slots-per-host", "2", script]) == 2  # worker mode: mpirun's business
    assert "--slots-per-host only apply when mgpu-train starts the job" in \
        capsys.readouterr().err


def test_hosts_named_on_the_command_line_leave_the_operators_file_alone(operator, script):
    operator(BARE)
    assert str(cli.parse_args(["-np", "8", "-H", "a:4,b:4", script]).hosts) == "a:4,b:4"
    config = cli.parse_args(["-np", "8", "--mpirun-args", "--host a:4,b:4", script])
    assert config.hosts is None and config.hostfile is None


def test_lines_mix_and_a_host_listed_again_adds_its_slots(tmp_path, script, monkeypatch):
    for name in OPERATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "hosts"
    path.write_text("# mixed\nnode1 slots=2 max_slots=4\nnode2\nnode1 slots=1\n\nnode3  # c\n")
    config = cli.parse_args(["-np", "9", "--hostfile", str(path), "--slots-per-host", "3",
                             script])
    assert str(config.hosts) == "node1:3,node2:3,node3:3"


@pytest.mark.parametrize("line", ["-oProxyCommand=x", "-oProxyCommand=x slots=1", "bad..name",
                                  "node1 slots=2 x"])
def test_a_line_whose_host_is_no_host_name_is_refused(tmp_path, script, capsys, line):
    """Nothing read from the file may reach mpirun as an option."""
    path = tmp_path / "hosts"
    path.write_text(f"node0\n{line}\n")
    assert cli.main(["-np", "1", "--dry-run", "--hostfile", str(path), script]) == 2
    assert f"{path}:2: " in capsys.readouterr().err


def test_discovered_bare_names_get_the_slots_per_host(tmp_path, script, capsys, operator):
    operator(BARE, slots_per_worker=4)  # the elastic job ignores the hostfile, not the slots
    assert discovery.parse("a\nb:2\n", bare_slots=4).slots == (("a", 4), ("b", 2))
    # discover_hosts.sh as the operator writes it
    found = elastickit.executable(tmp_path / "discover_hosts.sh",
                                  "echo pi-worker-0.pi.default.svc\necho pi-worker-1.pi.default.svc")
    status, command, err = _dry_run(capsys, "-np", "8", "--host-discovery-script", found,
                                    script)
    assert status == 0, err
    assert command[command.index("-H") + 1] == \
        "pi-worker-0.pi.default.svc:4,pi-worker-1.pi.default.svc:4"
    config = cli.parse_args(["-np", "2", "--host-discovery-script", found,
                             "--slots-per-host", "1", script])
    assert config.elastic_options.bare_slots == 1


def test_env_shows_the_hostfile_it_detected(operator, capsys, monkeypatch):
    path = operator(BARE, slots_per_worker=4)
    monkeypatch.setenv("K_MPI_JOB_ROLE", "launcher")
    assert cli.main(["--env"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("hostfile "))
    assert line.split(None, 1)[1] == (
        f"{path} (from $OMPI_MCA_orte_default_hostfile): 2 hosts, 2 without slots=, given 4 "
        f"each ($OMPI_MCA_orte_set_default_slots, the MPIJob's slotsPerWorker); 8 slots -> "
        f"mpirun -H pi-worker-0.pi-worker:4,pi-worker-1.pi-worker:4 [MPI Operator launcher pod]")
    os.unlink(path)
    assert cli.main(["--env"]) == 0
    assert "hostfile          error: $OMPI_MCA_orte_default_hostfile" in capsys.readouterr().out


def test_one_reader_reads_both_host_list_syntaxes():
    # discovery output and hostfiles go through mgpu_launcher.hostlists alone: the same
    # comment handling and host-name check, each syntax's slots
    from mgpu_launcher import hostlists
    read = [(l.host, l.slots, l.is_host_name) for l in hostlists.lines(
        "a:2  # two\n\nb\n-x:1\nnot a line\n", "discovery")]
    assert read == [("a", 2, True), ("b", None, True), ("-x", 1, False), (None, None, False)]
    read = [(l.host, l.slots, l.is_host_name) for l in hostlists.lines(
        "a slots=2 max_slots=4 # two\nb\n--mca\nb slots=x\n", "hostfile")]
    assert read == [("a", 2, True), ("b", None, True), ("--mca", None, False),
                    (None, None, False)]
    assert discovery.parse("a:2\n-x:1\n").problems[0].endswith(
        f"'-x' skipped: expected {hostlists.HOST_NAME}")
    with pytest.raises(ValueError, match="expected one of"):
        hostlists.lines("a", "yaml")
