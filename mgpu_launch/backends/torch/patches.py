"""The torch backend's Keras patch set (``TorchEngine.keras_patches`` returns it):

- every model: the prefetched epoch iterator; on Keras >= 3.16 no DDP and per-rank metrics once
  mgpu owns the process group; the train step wrapped by the engine (compiled,
  ``compiled.py``, and CUDA-graph capture); ``jit_compile="auto"`` resolved by
  ``MGPU_TORCH_COMPILE`` and never Keras's own ``torch.compile`` for a DistributedOptimizer
  model;
- once a step is wrapped (compiled or captured): SGD's update with the rate as a device
  tensor, Python numbers made on the device while a step is warmed up or captured;
- torch's own kernels for BatchNormalization and channels-last convolutions (``kernels.py``),
  unless ``MGPU_TORCH_KERNELS=0``.
"""

from mgpu_launch import backends, runtime
from mgpu_launch.backends.torch import kernels as torch_kernels
from mgpu_launch.config import settings
from mgpu_launch.keras_patching import (BATCH_NORM, TRAINER, Hooks, Patch, PatchSet,
                                        Replacement, apply)

# Keras 3.15-3.16 names, then keras-team's HEAD's (TorchTrainer -> Trainer, core -> ops.core)
_TRAINER = ("keras.src.backend.torch.trainer:TorchTrainer"
            "|keras.src.backend.torch.trainer:Trainer")
_CORE = "keras.src.backend.torch:core|keras.src.backend.torch.ops:core"

#: installed once a train step is wrapped for capture (a frame each otherwise, many per step)
ON_CAPTURE = (
    Replacement("torch_sgd_update",
                Patch("keras.src.backend.torch.optimizers.torch_sgd:SGD", "_parallel_update_step",
                      ("self", "grads", "variables", "learning_rate")),
                lambda original: sgd_update(original),
                "with capture on: the learning rate as a device tensor"),
    Replacement("torch_scalars", Patch(_CORE, "convert_to_tensor", ("x", "dtype"),
                                       everywhere=True),
                lambda original: scalars(original),
                "while a step is warmed up or captured: Python numbers made on the device"),
)
#: torch's own kernels for Keras's torch lowering, any model
KERNELS = (
    Replacement("torch_batch_norm", Patch(BATCH_NORM, "call",
                                          ("self", "inputs", "training", "mask")),
                lambda original: torch_kernels.batch_norm(
                    original, Patch(BATCH_NORM, "_moments", ()).owner_class()._moments),
                "BatchNormalization on torch.nn.functional.batch_norm"),
    Replacement("torch_conv", Patch("keras.src.backend.torch:nn", "conv",
                                    ("inputs", "kernel", "strides", "padding", "data_format",
                                     "dilation_rate"), everywhere=True),
                torch_kernels.conv, "channels_last: the input as a channels-first view"),
)


def patch_set(hooks: Hooks) -> PatchSet:
    """The torch patches, their replacements built on `hooks`; the kernels unless
    ``MGPU_TORCH_KERNELS=0``."""
    return PatchSet(
        every_model=(
            Replacement("torch_iterator",
                        Patch("keras.src.backend.torch.trainer:TorchEpochIterator",
                              "_get_iterator", ("self",)),
                        hooks.epoch_iterator, "feed batches from the device prefetcher"),
            Replacement("torch_ddp", Patch(_TRAINER, "_initialize_ddp", ("self",),
                                           optional=True),
                        lambda original: ddp(original, hooks),
                        "Keras >= 3.16: no DDP once mgpu owns the process group"),
            Replacement("torch_metrics", Patch(_TRAINER, "get_metrics_result", ("self",)),
                        lambda original: metrics(
                            original, Patch(TRAINER, "get_metrics_result", ("self",)).check()),
                        "Keras >= 3.16: metrics stay per rank"),
            Replacement("torch_train_function", Patch(_TRAINER, "make_train_function",
                                                      ("self", "force")),
                        lambda original: train_function(original, hooks),
                        "let the engine wrap the step (compiled, CUDA-graph capture)"),
            Replacement("torch_auto_jit", Patch(TRAINER, "_resolve_auto_jit_compile",
                                                ("self",)),
                        lambda original: auto_jit(original, hooks),
                        "jit_compile='auto': the compiled step where MGPU_TORCH_COMPILE says"),
            Replacement("torch_keras_compile", Patch(_TRAINER, "_should_torch_compile",
                                                     ("self",), optional=True),
                        lambda original: keras_compile(original, hooks),
                        "never Keras's own torch.compile of a DistributedOptimizer model's "
                        "step functions"),
        ),
        on_capture=ON_CAPTURE,
        kernels=KERNELS if settings.flag("MGPU_TORCH_KERNELS") else ())


def owns_torch_process_group() -> bool:
    """Whether mgpu.init() started this process's torch.distributed (TorchEngine.setup refuses
    one started before it): then Keras's own collectives (DDP, metric sums) are not ours to run."""
    return runtime.is_multi_process() and backends.get_engine().reduces_in_step()


def ddp(original, hooks: Hooks):
    # Keras >= 3.16 wraps every model in DDP once torch.distributed is up. A DistributedOptimizer
    # model: mgpu reduces its gradients already. Any other model (a reference trained on one
    # rank, a rank-0 evaluation): it is local, and DDP's constructor is a collective the other
    # ranks never join (a deadlock).
    def _initialize_ddp(self):
        if hooks.uses_distributed_optimizer(self) or owns_torch_process_group():
            return
        original(self)
    return _initialize_ddp


def metrics(original, base):
    # Keras >= 3.16 all-reduces every metric variable in get_metrics_result (each train and
    # test step): extra blocking collectives per step, and a hang when one rank alone runs
    # fit/evaluate. Under mgpu metrics stay per rank (MetricAverageCallback averages them).
    def get_metrics_result(self):
        if owns_torch_process_group():
            return base(self)
        return original(self)
    return get_metrics_result


def train_function(original, hooks: Hooks):
    # the DistributedOptimizer's step options are handed to the engine as a value; a step
    # wrapped for capture needs the ON_CAPTURE patches
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force)
        if hooks.uses_distributed_optimizer(self):
            wrapped = backends.get_engine().wrap_train_function(
                self, self.train_function, hooks.step_options(self))
            if wrapped is not self.train_function:  # compiled or captured
                for replacement in ON_CAPTURE:
                    apply(replacement)
            self.train_function = wrapped
        return self.train_function
    return make_train_function


def auto_jit(original, hooks: Hooks):
    # Keras resolves "auto" to eager on torch. A DistributedOptimizer model gets mgpu's compiled
    # step (backends/torch/compiled.py) where MGPU_TORCH_COMPILE says (default: on a GPU);
    # compile(jit_compile=False) still means eager, jit_compile=True compiled.
    from mgpu_launch.backends.torch import compiled

    def _resolve_auto_jit_compile(self):
        if hooks.uses_distributed_optimizer(self):
            return compiled.default_on()
        return original(self)
    return _resolve_auto_jit_compile


def keras_compile(original, hooks: Hooks):
    # Keras's jit_compile=True on torch is torch.compile of its step functions: dynamo traces
    # Keras's Python, hits the recompile limit and falls back (docs/torch-compile.md). For a
    # DistributedOptimizer model the train step is mgpu's compiled one (the engine wraps it);
    # evaluate and predict stay eager, as with jit_compile=False.
    def _should_torch_compile(self):
        if hooks.uses_distributed_optimizer(self):
            return False
        return original(self)
    return _should_torch_compile


def sgd_update(original):
    # Keras passes the rate as alpha= of _foreach_add_, a host read (.item()) every step,
    # which a CUDA graph cannot contain. The same update with the rate as a device tensor:
    # v <- m*v - lr*g; w <- w + v (nesterov: w <- w - lr*g + m*v). Only for the optimizers of
    # steps wrapped for capture; the result may differ from Keras's in the last bit (lr*g is
    # rounded before the add instead of fused into it).
    from mgpu_launch.backends.torch import graph as torch_graph

    def _parallel_update_step(self, grads, variables, learning_rate):
        if not torch_graph.uses_device_learning_rate(self):
            return original(self, grads, variables, learning_rate)
        import torch

        rate = getattr(learning_rate, "value", learning_rate)
        step = torch._foreach_mul(list(grads), -rate)
        params = [v.value for v in variables]
        if self.momentum == 0:
            torch._foreach_add_(params, step)
            return
        velocities = [self.momentums[self._get_variable_index(v)].value for v in variables]
        torch._foreach_mul_(velocities, self.momentum)
        torch._foreach_add_(velocities, step)
        if self.nesterov:
            torch._foreach_add_(params, step)
            torch._foreach_add_(params, velocities, alpha=self.momentum)
        else:
            torch._foreach_add_(params, velocities)
    return _parallel_update_step


def scalars(original):
    # Keras makes a tensor of every Python number or shape tuple an op meets
    # (torch.as_tensor(x, device=...)): a CPU tensor and a synchronous copy, which a CUDA graph
    # cannot contain. While the engine warms up or captures a step, fill kernels make the same
    # small constant on the device instead (same dtype rule as Keras's); at any other time,
    # and for anything larger, Keras's own conversion runs.
    from mgpu_launch.backends.torch import graph as torch_graph

    def convert_to_tensor(x, dtype=None, sparse=None, ragged=None):
        if torch_graph.scalars_on_device() and not (sparse or ragged):
            made = torch_graph.device_constant(x, dtype)
            if made is not None:
                return made
        return original(x, dtype=dtype, sparse=sparse, ragged=ragged)
    return convert_to_tensor
