"""The MPIJob fields examples/kubernetes/*.yaml use, as the MPI Operator's CRD declares them.

Not the CRD (8947 lines): only the paths our manifests need, with their type, enum and the
required keys of each object, taken from kubeflow/mpi-operator's
manifests/base/kubeflow.org_mpijobs.yaml (version v2beta1, openAPIV3Schema) at commit
caa3c47fc42eb762635f78045ec0fcd1a89eb038 ("Prepare v0.8.2", controller-gen v0.20.1).
Regenerate after changing a manifest, from a copy of that file:

    python3 tests/kubernetes/crd_fields.py kubeflow.org_mpijobs.yaml > /tmp/fields.txt

and paste it into FIELDS (a path not in the CRD makes that command fail, naming it).
Paths: keys joined by '.', '[]' for a list's items, '*' for a map's values
(additionalProperties); 'metadata' is Kubernetes' ObjectMeta, not in the CRD's schema.
"""

import glob
import os
import sys

FIELDS = """\
apiVersion string
kind string
metadata object
spec object required=mpiReplicaSpecs
spec.mpiImplementation string enum=OpenMPI|Intel|MPICH
spec.mpiReplicaSpecs object
spec.mpiReplicaSpecs.* object
spec.mpiReplicaSpecs.*.replicas integer
spec.mpiReplicaSpecs.*.template object
spec.mpiReplicaSpecs.*.template.spec object required=containers
spec.mpiReplicaSpecs.*.template.spec.containers array
spec.mpiReplicaSpecs.*.template.spec.containers[] object required=name
spec.mpiReplicaSpecs.*.template.spec.containers[].args array
spec.mpiReplicaSpecs.*.template.spec.containers[].args[] string
spec.mpiReplicaSpecs.*.template.spec.containers[].command array
spec.mpiReplicaSpecs.*.template.spec.containers[].command[] string
spec.mpiReplicaSpecs.*.template.spec.containers[].image string
spec.mpiReplicaSpecs.*.template.spec.containers[].name string
spec.mpiReplicaSpecs.*.template.spec.containers[].resources object
spec.mpiReplicaSpecs.*.template.spec.containers[].resources.limits object
spec.mpiReplicaSpecs.*.template.spec.containers[].resources.limits.* int-or-string
spec.mpiReplicaSpecs.*.template.spec.containers[].volumeMounts array
spec.mpiReplicaSpecs.*.template.spec.containers[].volumeMounts[] object required=mountPath,name
spec.mpiReplicaSpecs.*.template.spec.containers[].volumeMounts[].mountPath string
spec.mpiReplicaSpecs.*.template.spec.containers[].volumeMounts[].name string
spec.mpiReplicaSpecs.*.template.spec.securityContext object
spec.mpiReplicaSpecs.*.template.spec.securityContext.runAsGroup integer
spec.mpiReplicaSpecs.*.template.spec.securityContext.runAsUser integer
spec.mpiReplicaSpecs.*.template.spec.volumes array
spec.mpiReplicaSpecs.*.template.spec.volumes[] object required=name
spec.mpiReplicaSpecs.*.template.spec.volumes[].emptyDir object
spec.mpiReplicaSpecs.*.template.spec.volumes[].emptyDir.medium string
spec.mpiReplicaSpecs.*.template.spec.volumes[].name string
spec.runPolicy object
spec.runPolicy.backoffLimit integer
spec.runPolicy.cleanPodPolicy string
spec.slotsPerWorker integer
spec.sshAuthMountPath string
"""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFESTS = sorted(glob.glob(os.path.join(ROOT, "examples", "kubernetes", "*.yaml")))
#: ObjectMeta fields the manifests use (the CRD leaves metadata to the API server)
OBJECT_META = ("metadata.name",)


def walk(schema: dict, value, path: str = ""):
    """Yield ``(path, schema node)`` for `value` and everything in it; (path, None) when the
    schema has no such field."""
    yield path, schema
    if schema is None:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else key
            if key in schema.get("properties", {}):
                yield from walk(schema["properties"][key], item, child)
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from walk(schema["additionalProperties"], item,
                                f"{path}.*" if path else "*")
            elif child in OBJECT_META:
                continue
            else:
                yield child, None
    elif isinstance(value, list):
        for item in value:
            yield from walk(schema.get("items"), item, f"{path}[]")


def describe(schema: dict) -> str:
    """``type[ enum=a|b][ required=x,y]`` of one schema node."""
    kind = "int-or-string" if schema.get("x-kubernetes-int-or-string") else \
        schema.get("type", "any")
    text = kind
    if "enum" in schema:
        text += " enum=" + "|".join(str(e) for e in schema["enum"])
    if schema.get("required"):
        text += " required=" + ",".join(schema["required"])
    return text


def main(argv) -> int:
    import yaml  # the tooling's: only this regeneration reads the CRD
    with open(argv[1]) as crd:
        document = yaml.safe_load(crd)
    version = next(v for v in document["spec"]["versions"] if v["name"] == "v2beta1")
    schema = version["schema"]["openAPIV3Schema"]
    rows, missing = {}, []
    for name in MANIFESTS:
        with open(name) as manifest:
            for path, node in walk(schema, yaml.safe_load(manifest)):
                if node is None:
                    missing.append(f"{os.path.basename(name)}: {path}")
                elif path:
                    rows[path] = describe(node)
    if missing:
        print("not in the CRD:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    print("\n".join(f"{path} {rows[path]}" for path in sorted(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
