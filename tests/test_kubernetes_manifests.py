"""examples/kubernetes/: every field the MPIJobs set is one the MPI Operator's CRD declares, with
the CRD's type (tests/kubernetes/crd_fields.py holds those paths, read from the CRD), and the
launcher's command line is one mgpu-train accepts, starting one rank per worker GPU."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "kubernetes"))
import crd_fields  # noqa: E402

yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifests (pip install pyyaml)")

from mgpu_launcher import cli  # noqa: E402

IN_IMAGE = "/opt/mgpu-launch/"  # the Dockerfile's WORKDIR for the repository's files
#: the replica types the operator knows (pkg/apis/kubeflow/v2beta1/types.go)
REPLICA_TYPES = {"Launcher", "Worker"}
TYPES = {"string": (str,), "integer": (int,), "boolean": (bool,), "object": (dict,),
         "array": (list,), "int-or-string": (int, str)}


def _fields():
    table = {}
    for line in crd_fields.FIELDS.splitlines():
        path, kind, *rest = line.split()
        extra = dict(item.split("=", 1) for item in rest)
        table[path] = (kind, extra.get("enum", "").split("|") if "enum" in extra else None,
                       extra.get("required", "").split(",") if "required" in extra else [])
    return table


def check(value, table, path=""):
    """Problems of `value` at `path` against the CRD fields (empty: none)."""
    problems = []
    if path:
        kind, enum, required = table[path]
        if not isinstance(value, TYPES[kind]) or (kind == "integer" and isinstance(value, bool)):
            problems.append(f"{path}: {value!r} is not {kind}")
        if enum is not None and value not in enum:
            problems.append(f"{path}: {value!r} is not one of {enum}")
        problems += [f"{path}: {key!r} is required" for key in required
                     if isinstance(value, dict) and key not in value]
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else key
            if child in crd_fields.OBJECT_META:
                continue
            if child not in table and f"{path}.*" in table:
                child = f"{path}.*"
            if child not in table:
                problems.append(f"{child}: no such field in the MPIJob CRD")
            else:
                problems += check(item, table, child)
    elif isinstance(value, list):
        problems += [p for item in value for p in check(item, table, f"{path}[]")]
    return problems


def _load(name):
    with open(name) as manifest:
        return yaml.safe_load(manifest)


def test_there_are_a_plain_and_an_elastic_mpijob():
    names = sorted(os.path.basename(n) for n in crd_fields.MANIFESTS)
    assert names == ["mpijob-resnet50-elastic.yaml", "mpijob-resnet50.yaml"]


@pytest.mark.parametrize("name", crd_fields.MANIFESTS, ids=os.path.basename)
def test_every_field_is_in_the_operators_crd(name):
    job = _load(name)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    assert check(job, _fields()) == []
    assert set(job["spec"]["mpiReplicaSpecs"]) == REPLICA_TYPES


def test_the_checker_finds_a_misspelt_or_mistyped_field():
    job = _load(crd_fields.MANIFESTS[0])
    job["spec"]["slotPerWorker"] = 4
    job["spec"]["mpiImplementation"] = "OpenMPI5"
    job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] = "2"
    del job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"]
    assert sorted(check(job, _fields())) == [
        "spec.mpiImplementation: 'OpenMPI5' is not one of ['OpenMPI', 'Intel', 'MPICH']",
        "spec.mpiReplicaSpecs.*.replicas: '2' is not integer",
        "spec.mpiReplicaSpecs.*.template.spec.containers[]: 'name' is required",
        "spec.slotPerWorker: no such field in the MPIJob CRD"]


def _launcher_args(job):
    container = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["mgpu-train"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [os.path.join(root, arg[len(IN_IMAGE):]) if arg.startswith(IN_IMAGE) else arg
            for arg in container["args"]]


def test_the_launcher_starts_one_rank_per_worker_gpu(tmp_path, monkeypatch):
    """The operator's hostfile (v0.8.2's format) for this MPIJob gives mgpu-train its hosts."""
    job = _load(os.path.join(os.path.dirname(crd_fields.MANIFESTS[0]), "mpijob-resnet50.yaml"))
    spec, name = job["spec"], job["metadata"]["name"]
    workers = spec["mpiReplicaSpecs"]["Worker"]
    gpus = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert spec["slotsPerWorker"] == gpus
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{name}-worker-{i}.{name}.default.svc slots={gpus}\n"
                                for i in range(workers["replicas"])))
    monkeypatch.setenv("OMPI_MCA_orte_default_hostfile", str(hostfile))
    config = cli.parse_args(_launcher_args(job))
    assert config.np == workers["replicas"] * gpus == config.placement.total
    assert config.hostfile == str(hostfile)
    assert config.target.endswith("examples/keras_resnet50_synthetic.py")


def test_the_elastic_launcher_uses_the_operators_discovery_script():
    job = _load(os.path.join(os.path.dirname(crd_fields.MANIFESTS[0]),
                             "mpijob-resnet50-elastic.yaml"))
    options = cli.get_parser().parse_args(cli.split_argv(cli.get_parser(),
                                                         _launcher_args(job))[0])
    assert options.host_discovery_script == "/etc/mpi/discover_hosts.sh"
    slots, replicas = job["spec"]["slotsPerWorker"], job["spec"]["mpiReplicaSpecs"]["Worker"][
        "replicas"]
    assert int(options.min_np) <= int(options.np) == slots * replicas <= int(options.max_np)
    assert int(options.min_np) % slots == 0 and int(options.max_np) % slots == 0


@pytest.mark.parametrize("name", crd_fields.MANIFESTS, ids=os.path.basename)
def test_workers_run_sshd_as_the_images_user_with_the_operators_key_layout(name):
    job = _load(name)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "Dockerfile")) as dockerfile:
        text = dockerfile.read()
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert worker["containers"][0]["command"] == ["/usr/sbin/sshd"]
    config = worker["containers"][0]["args"][-1]
    assert job["spec"]["sshAuthMountPath"] == "/home/mgpu/.ssh"
    assert config == "/home/mgpu/.sshd_config" and config in text and "openssh-server" in text
    assert worker["securityContext"]["runAsUser"] == 10001 and "--uid 10001" in text
