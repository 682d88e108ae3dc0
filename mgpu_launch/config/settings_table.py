"""The declarations of every ``MGPU_*`` environment variable (read through mgpu_launch.config.settings).

To add a variable: declare it in :data:`SETTINGS` (name, type, default, reader, one line of
help), read it with ``settings.<type>(name)``, and regenerate docs/settings.md
(``python -m mgpu_launch.config.settings --markdown > docs/settings.md``).
"""

import dataclasses
import ipaddress
import math
import re
from typing import Any, Dict, Optional, Tuple

#: seconds mgpu-train waits for the same stderr line from other ranks (mgpu_launcher.merge)
MERGE_WINDOW = 3.0


#: who reads a variable
LAUNCHER = "mgpu-train"
RANKS = "every rank"
INTERNAL = "internal"  # set by mgpu-train for its ranks; declared, not a knob
TOOLING = "tests and scripts"  # the test suite and scripts/*.sh; the library never reads them

PREFIX = "MGPU_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:\-]+\]?:(\d+)$")


class SettingError(ValueError):
    """An ``MGPU_*`` variable has a value that does not parse; the message names the variable,
    the value received, what is expected and an example."""

    __module__ = "mgpu_launch.config.settings"  # where users import it from (tracebacks say so)


class SettingWarning(UserWarning):
    """An ``MGPU_*`` variable that no part of mgpu-launch reads (a typo?)."""

    __module__ = "mgpu_launch.config.settings"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable.

    Args:
        name: the variable, ``MGPU_...``.
        kind: ``integer``, ``number``, ``seconds``, ``flag``, ``choice``, ``text``,
            ``address`` (host:port) or ``ipv4`` (an IPv4 address).
        default: the value when unset (already parsed); None: unset / off.
        reader: :data:`LAUNCHER`, :data:`RANKS`, :data:`INTERNAL` or :data:`TOOLING`.
        help: one line of help.
        expected: what a value must be, in words, for the error (default: from kind/bounds).
        example: a good value, for the error and the docs.
        low, high: inclusive bounds (numbers); ``low_open``: the low bound is exclusive.
        choices: the accepted words (``choice``).
        off: ``seconds``: ``off`` / ``none`` mean None (never).
        shown_default: the default in words, where the reader computes it.
    """

    name: str
    kind: str
    default: Any
    reader: str
    help: str
    expected: str = ""
    example: str = ""
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    choices: Tuple[str, ...] = ()
    off: bool = False
    shown_default: str = ""

    def expectation(self) -> str:
        """What a value must be, in words (the error message)."""
        return self.expected or self.values()

    def values(self) -> str:
        """The accepted values, in short (the docs' table)."""
        if self.kind == "flag":
            return f"a flag: {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}"
        if self.kind == "choice":
            return f"one of {', '.join(self.choices)}"
        if self.kind == "address":
            return "HOST:PORT"
        if self.kind == "ipv4":
            return "an IPv4 address"
        if self.kind == "text":
            return "text"
        what = {"integer": "a whole number", "number": "a number",
                "seconds": "a number of seconds"}[self.kind]
        bounds = [f"{'>' if self.low_open else '>='} {self.low:g}"] if self.low is not None else []
        bounds += [f"<= {self.high:g}"] if self.high is not None else []
        return f"{what} {' and '.join(bounds)}".strip() + (" (or 'off')" if self.off else "")

    def error(self, raw: str) -> SettingError:
        example = self.example or self.shown(not self.default if self.kind == "flag"
                                             else self.default)
        return SettingError(f"{self.name}={raw!r}: expected {self.expectation()}, e.g. "
                            f"{self.name}={example}")

    def parse(self, raw: str) -> Any:
        """The value of `raw` (stripped, not empty), checked.

        Raises:
            SettingError: it is not such a value.
        """
        if self.kind in ("flag", "choice", "seconds"):
            word = raw.lower()
            if self.kind == "flag" and word in TRUE_WORDS + FALSE_WORDS:
                return word in TRUE_WORDS
            if self.kind == "choice" and word in self.choices:
                return word
            if self.off and word in ("off", "none"):
                return None
            if self.kind != "seconds":
                raise self.error(raw)
        if self.kind == "address":
            match = _ADDRESS.match(raw)
            if not match or not 1 <= int(match.group(1)) <= 65535:
                raise self.error(raw)
            return raw
        if self.kind == "ipv4":
            return self._ipv4(raw)
        if self.kind == "text":
            return raw
        try:
            value = int(raw) if self.kind == "integer" else float(raw)
        except ValueError:
            raise self.error(raw) from None
        if not math.isfinite(value) or (self.low is not None and (
                value < self.low or (self.low_open and value == self.low))) or (
                self.high is not None and value > self.high):
            raise self.error(raw)
        return value

    def _ipv4(self, raw: str) -> str:
        try:
            return str(ipaddress.IPv4Address(raw))
        except ValueError:
            pass
        try:
            ipaddress.IPv6Address(raw.strip("[]"))
        except ValueError:
            raise self.error(raw) from None
        # Said here, at the start, not as a failure to listen on every rank later: the job's
        # listeners are dialled at rank 0's IPv4 host address, so they are IPv4 sockets.
        raise SettingError(
            f"{self.name}={raw!r}: an IPv6 address; the job's listeners (stall inspector, JAX "
            f"coordinator, torch TCPStore) are dialled at rank 0's IPv4 address and bind IPv4 "
            f"only. Expected an IPv4 address of rank 0's host, e.g. {self.name}=10.0.0.1 "
            f"(0.0.0.0: every IPv4 interface)")

    def shown(self, value: Any) -> str:
        """`value` as a user would write it."""
        if value is None:
            return "off" if self.off else "unset"
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, float):
            return f"{value:g}"
        return str(value)


def _declare(*settings: Setting) -> Dict[str, Setting]:
    table: Dict[str, Setting] = {}
    for setting in settings:
        if setting.name in table or not setting.name.startswith(PREFIX):
            raise ValueError(f"{setting.name}: declared twice, or not an {PREFIX}* name")
        table[setting.name] = setting
    return table


_ = Setting
_HOST_PORT = dict(example="10.0.0.1:29500", shown_default="rank 0's host, a free port")

#: name -> declaration, in the order of the docs' tables
SETTINGS: Dict[str, Setting] = _declare(
    # -- read by mgpu-train itself (standalone mode) ------------------------------------------
    _("MGPU_MAX_RESTARTS", "integer", 0, LAUNCHER,
      "restarts after a failure, as `--max-restarts` (the flag wins)", low=0,
      expected="a whole number of restarts >= 0", example="3", shown_default="0 (elastic: 10)"),
    _("MGPU_MERGE_SECONDS", "seconds", MERGE_WINDOW, LAUNCHER,
      "how long a stderr line waits for the other ranks' copies, to be shown once (0: never "
      "merge)", low=0, expected="a number of seconds >= 0 (0 turns merging off)", example="3"),
    _("MGPU_STARTUP_NOISE", "flag", False, LAUNCHER,
      "show the frameworks' start-up chatter that mgpu-train drops (absl's `All log messages "
      "before absl::InitializeLog()`, TF's per-rank `Started server with target`, JAX's "
      "`[Gloo] Rank N is connected`, and TF's `failed call to cuInit` error when no rank has "
      "a GPU) or shows once a job (TF's oneDNN / CPU / CUDA notices, which it prints twice a "
      "process); `--all-ranks-output` shows them too"),
    _("MGPU_SLOTS_PER_HOST", "integer", None, LAUNCHER,
      "processes per host named without slots (a bare name in a hostfile or discovery "
      "output), as `--slots-per-host`", low=1, expected="a whole number of processes per "
      "host >= 1 (its GPUs)", example="4",
      shown_default="$OMPI_MCA_orte_set_default_slots (MPI Operator), else 1"),
    _("MGPU_HOST_DISCOVERY_SCRIPT", "text", None, LAUNCHER,
      "as `--host-discovery-script`: an executable printing HOST:SLOTS lines; elastic mode",
      example="./discover.sh", shown_default="off"),
    _("MGPU_MIN_NP", "integer", None, LAUNCHER, "elastic: fewest processes, as `--min-np`",
      low=1, example="2", shown_default="`-np`"),
    _("MGPU_MAX_NP", "integer", None, LAUNCHER, "elastic: most processes, as `--max-np`",
      low=1, example="8", shown_default="every discovered slot"),
    _("MGPU_ELASTIC_TIMEOUT", "seconds", 600.0, LAUNCHER,
      "elastic: seconds to wait for `--min-np` slots, as `--elastic-timeout`", low=0,
      example="600"),
    _("MGPU_BLACKLIST_COOLDOWN", "seconds", 60.0, LAUNCHER,
      "elastic: seconds a failed host stays unused (doubling), as `--blacklist-cooldown`",
      low=0, example="60"),
    _("MGPU_DISCOVERY_INTERVAL", "seconds", 2.0, LAUNCHER,
      "elastic: seconds between discovery runs (at least 0.2)", low=0, example="2"),
    _("MGPU_STOP_REPEATED_FAILURE", "flag", True, LAUNCHER,
      "elastic: stop restarting when an attempt fails as the one before it did (the same "
      "error, the same last backup point); 0: use every restart", example="0"),
    # -- read in every rank -------------------------------------------------------------------
    _("MGPU_ENGINE", "choice", "keras", RANKS,
      "`none`: no engine, host collectives only, Keras never imported (also skips "
      "mgpu-train's KERAS_BACKEND check)", choices=("keras", "none"), example="none"),
    _("MGPU_DYNAMIC_PROCESS_SETS", "flag", False, RANKS,
      "allow `add_process_set` / `remove_process_set` after `init()` (as "
      "`init(process_sets=\"dynamic\")`; Horovod's `HOROVOD_DYNAMIC_PROCESS_SETS`)"),
    _("MGPU_FUSION_MB", "number", None, RANKS,
      "MiB per fused gradient allreduce buffer (JAX: 0 = one psum of the list, fused by XLA)",
      low=0, expected="a number of MiB >= 0", example="64", shown_default="64 (JAX), 25 (torch)"),
    _("MGPU_PREFETCH", "integer", None, RANKS,
      "batches copied to the device ahead of the step by a background thread (0: off)", low=0,
      expected="the number of batches to copy to the device ahead of the step (a whole "
               "number >= 0; 0 turns device prefetch off)", example="2",
      shown_default="2 on GPU, 0 on CPU"),
    _("MGPU_STALL_INSPECTOR", "flag", True, RANKS,
      "the stall inspector (0: no thread, no port); set it alike on every rank"),
    _("MGPU_STALL_WARNING_S", "seconds", 60.0, RANKS,
      "seconds without progress, ranks at different places, before the stall warning",
      low=0, low_open=True, off=True, example="60"),
    _("MGPU_STALL_SHUTDOWN_S", "seconds", None, RANKS,
      "seconds after which a stall ends the job (a number turns it on)", low=0, low_open=True,
      off=True, example="600"),
    _("MGPU_STALL_PORT", "integer", 0, RANKS,
      "the TCP port rank 0's stall inspector listens on, for a firewall rule", low=0,
      high=65535, expected="a TCP port number 1-65535 that the other hosts may reach (0: any "
                           "free port)", example="29400", shown_default="0 (any free port)"),
    _("MGPU_BIND_ADDRESS", "ipv4", None, RANKS,
      "the IPv4 address rank 0's listeners bind (stall inspector, JAX coordinator, torch "
      "TCPStore); `0.0.0.0`: every interface, where the address the others dial is not one of "
      "the host's own (NAT, a service name); one address is also where the ranks dial them (a "
      "loopback one is refused for a job on several hosts)", example="0.0.0.0",
      shown_default="the address they are dialled at (`127.0.0.1` on one host)"),
    _("MGPU_TIMELINE", "text", None, RANKS,
      "a Chrome/Perfetto trace of every rank's step phases and host collectives, written by "
      "rank 0 at the end (as `mgpu-train --timeline FILE`)", example="timeline.json",
      shown_default="off"),
    _("MGPU_EFFICIENCY_REPORT", "flag", True, RANKS,
      "the efficiency report rank 0 prints at the end of `fit` (verbose >= 1): samples/s and "
      "where the lost time goes (a fit of 22+ steps ends with 6 gradient allreduces timed "
      "alone, on every rank); set it alike on every rank"),
    _("MGPU_PROFILE_SKIP_ALLREDUCE", "flag", False, RANKS,
      "JAX and TensorFlow, profiling only: skip the gradient allreduce (the gradients are "
      "then wrong)"),
    _("MGPU_COORDINATOR", "address", None, RANKS,
      "rank 0's address for scripts that start their own communication: the first of "
      "`KERAS_DISTRIBUTION_JOB_ADDRESSES`, and `MASTER_ADDR`:`MASTER_PORT` "
      "(docs/starting-processes.md); mgpu-train -np N sets it on one host",
      example="10.0.0.1:29500", shown_default="rank 0's host, a free port (agreed over MPI)"),
    _("MGPU_JOIN_TIMEOUT", "seconds", 120.0, RANKS,
      "a job not started by MPI (torchrun, JAX's variables): seconds every rank waits for the "
      "others to join the control plane's store before it names the missing ranks", low=1,
      example="120"),
    _("MGPU_JAX_COORDINATOR", "address", None, RANKS,
      "JAX: the coordinator's address (rank 0's host)", **_HOST_PORT),
    _("MGPU_JAX_INIT_TIMEOUT", "seconds", 60.0, RANKS,
      "JAX: seconds to wait for every process to join the coordinator", low=1, example="60"),
    _("MGPU_TORCH_ADDRESS", "address", None, RANKS,
      "torch: the TCPStore's address (rank 0's host)", **_HOST_PORT),
    _("MGPU_TORCH_TIMEOUT", "seconds", 1800.0, RANKS,
      "torch: seconds a collective may wait (torch.distributed's timeout); also the host "
      "collectives' wait over torchrun's and JAX's control planes", low=0,
      low_open=True, example="1800"),
    _("MGPU_TORCH_OVERLAP", "flag", True, RANKS,
      "torch: reduce gradient buckets during backward (0: one fused allreduce in `apply`)"),
    _("MGPU_TORCH_CUDA_GRAPH", "flag", False, RANKS,
      "torch: capture the train step in a CUDA graph (DistributedOptimizer(cuda_graph=) wins)"),
    _("MGPU_TORCH_COMPILE", "choice", "auto", RANKS,
      "torch: trace and compile a DistributedOptimizer model's whole train step (auto: on with "
      "a CUDA device, off on CPU; compile(jit_compile=) wins; docs/torch-compile.md)",
      choices=("auto", "1", "0"), example="1"),
    _("MGPU_TORCH_KERNELS", "flag", True, RANKS,
      "torch: BatchNormalization and channels_last convolutions on torch's own kernels "
      "(0: Keras's torch lowering; mgpu_launch/backends/torch/kernels.py)"),
    _("MGPU_TORCH_CUDA_GRAPH_WARMUP", "integer", 3, RANKS,
      "torch: eager steps per batch shape before it is captured", low=1,
      expected="an integer >= 1 (eager steps per batch shape before capture)", example="3"),
    _("MGPU_TF_TRANSPORT", "choice", "collective", RANKS,
      "TensorFlow: in-graph collectives, or `mpi` (CPU: each buffer leaves the graph for MPI)",
      choices=("collective", "mpi"), example="mpi"),
    _("MGPU_TF_COLLECTIVE", "choice", "auto", RANKS,
      "TensorFlow: the in-graph collective (`ring` for ranks that share a GPU; auto picks it)",
      choices=("auto", "nccl", "ring"), example="ring"),
    _("MGPU_TF_SPARSE_GATHER", "choice", "auto", RANKS,
      "TensorFlow: how sparse gradients are gathered: `static` (fixed-size buffers, compiles "
      "under XLA), `dynamic` (exact row counts; not under XLA); auto: static under XLA",
      choices=("auto", "dynamic", "static"), example="static"),
    _("MGPU_TF_HOST", "text", None, RANKS,
      "TensorFlow: the address the other ranks reach this one at", example="10.0.0.2",
      shown_default="the job's host address"),
    _("MGPU_TF_WIDEN_INT32", "flag", True, RANKS,
      "TensorFlow on GPU: the prefetch thread makes int32 batch tensors int64 on the GPU "
      "(int32 stays in host memory, and the step would wait for the one before to copy it)"),
    _("MGPU_COLLECTIVE_TIMEOUT", "seconds", 0.0, RANKS,
      "TensorFlow: seconds an in-graph collective may wait (0: no limit)", low=0, example="600"),
    _("MGPU_ELASTIC_STATE_DIR", "text", None, RANKS,
      "hvd.elastic: the folder of `KerasState`'s commits (yours alone: docs/security.md)",
      example="/scratch/job-42/state",
      shown_default="`.mgpu-elastic-state`"),
    # -- set by mgpu-train for its ranks --------------------------------------------------------
    _("MGPU_RANK", "integer", None, INTERNAL, "global rank", low=0, example="0"),
    _("MGPU_SIZE", "integer", None, INTERNAL, "number of processes", low=1, example="4"),
    _("MGPU_LOCAL_RANK", "integer", None, INTERNAL, "rank on this host", low=0, example="0"),
    _("MGPU_LOCAL_SIZE", "integer", None, INTERNAL, "processes on this host", low=1,
      example="4"),
    _("MGPU_ENVIRONMENT", "text", None, INTERNAL,
      "the launcher detected (openmpi, mpich, slurm, torchrun, jax-variables, single)",
      example="openmpi"),
    _("MGPU_GPU", "text", None, INTERNAL, "the GPU pinned to this process (only with GPUs)",
      example="0"),
    _("MGPU_LOCAL_DEVICE", "integer", None, INTERNAL,
      "its index among the host's visible GPUs (only with GPUs)", low=0, example="0"),
    _("MGPU_RESTART_COUNT", "integer", None, INTERNAL,
      "0 for the first attempt, 1 after the first restart, ... (`--max-restarts`)", low=0,
      example="0"),
    _("MGPU_PROGRESS_MARKER", "flag", False, INTERNAL,
      "rank 0 prints a marker after its first step (a later failure is worth a restart)"),
    _("MGPU_MARKER_KEY", "text", None, INTERNAL,
      "mgpu-train: the job's key in front of the lines a rank prints for the launcher",
      example="0f1e"),
    _("MGPU_ELASTIC", "flag", False, INTERNAL,
      "elastic mode: the rank notes SIGUSR1, a stop at the next backup point"),
    _("MGPU_RUN_KEY", "text", None, INTERNAL,
      "`mgpu_launch.run`: the call's key (hex) for its signed files", example="0f1e"),
    # -- tests and scripts ----------------------------------------------------------------------
    _("MGPU_TEST_BACKENDS", "text", None, TOOLING,
      "scripts/test.sh: the Keras backends to test", example="jax torch",
      shown_default="tensorflow jax torch"),
    _("MGPU_TEST_EVERY_BACKEND", "flag", False, TOOLING,
      "scripts/test.sh: also run the tests marked `first_backend` under every backend"),
    _("MGPU_TEST_WORKERS", "text", None, TOOLING,
      "scripts/test.sh: test files run at once (pytest-xdist); 0: one at a time",
      example="0", shown_default="2"),
    _("MGPU_TEST_LAUNCH_ARGS", "text", None, TOOLING,
      "tests: mgpu-train options for every test job", example="--no-pin"),
    _("MGPU_KERAS_MASTER", "text", None, TOOLING,
      "tests/test_foreign_scripts.py: a copy of Keras master's source (its torch DataParallel); "
      "unset: that test is skipped", example="/tmp/kmaster", shown_default="unset (skipped)"),
    _("MGPU_TEST_LEAN_RANKS", "flag", True, TOOLING,
      "tests: ranks skip matplotlib, IPython, (off JAX) jax, and scikit-learn for Keras's "
      "wrappers (tests/lean_ranks)"),
    _("MGPU_FAULT_TRIALS", "text", None, TOOLING, "tests/test_fault_injection.py: trials",
      example="20", shown_default="8"),
    _("MGPU_FAULT_SEED", "text", None, TOOLING, "tests/test_fault_injection.py: random seed",
      example="17", shown_default="17"),
    _("MGPU_CLUSTER_NAME", "text", None, TOOLING, "scripts/cluster.sh: container names",
      example="mgpu1", shown_default="mgpu + process id"),
    _("MGPU_CLUSTER_EXPOSE", "text", None, TOOLING,
      "scripts/cluster.sh up DIR mpi-operator: more paths (joined by ':') the pods' non-root "
      "user must reach (this Python's prefix)", example="/opt/python3.11",
      shown_default="the checkout only"),
    _("MGPU_CLUSTER_ROOTFS", "text", None, TOOLING,
      "scripts/cluster.sh up DIR mpi-operator: run the pods in this image file system "
      "(scripts/build_cpu_image.sh)", example="/var/lib/containers/.../merged",
      shown_default="none: this machine's"),
    _("MGPU_CLUSTER_IMAGE_ENV", "text", None, TOOLING,
      "scripts/cluster.sh, with MGPU_CLUSTER_ROOTFS: a file of the image's ENV, NAME=VALUE a "
      "line", example="/tmp/image.env", shown_default="none"),
    _("MGPU_SLURM_PORT", "text", None, TOOLING, "scripts/slurm.sh: slurmctld's port",
      example="16817", shown_default="16817"),
)
