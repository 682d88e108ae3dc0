"""The TensorFlow backend's Keras patch set: the prefetched epoch iterator (which also takes
Keras's train function off its tf.data path) and ``jit_compile="auto"`` without XLA where the
engine's collectives cannot be compiled (``TensorFlowEngine.keras_patches`` returns it)."""

from mgpu_launch import backends, runtime
from mgpu_launch.keras_patching import TRAINER, Hooks, Patch, PatchSet, Replacement


def patch_set(hooks: Hooks) -> PatchSet:
    """The TensorFlow patches, their replacements built on `hooks`."""
    return PatchSet(every_model=(
        Replacement("tf_auto_jit", Patch(TRAINER, "_resolve_auto_jit_compile", ("self",)),
                    lambda original: auto_jit(original, hooks),
                    "jit_compile='auto': no XLA where the collectives cannot be compiled"),
        Replacement("tf_iterator",
                    Patch("keras.src.backend.tensorflow.trainer:TFEpochIterator",
                          "_get_iterator", ("self",)),
                    hooks.epoch_iterator, "feed batches from the device prefetcher"),
    ))


def auto_jit(original, hooks: Hooks):
    # Keras resolves "auto" to XLA on any machine with a GPU; a step whose collectives XLA
    # cannot compile (the host ring) would then fail at its first trace.
    def _resolve_auto_jit_compile(self):
        if (hooks.uses_distributed_optimizer(self) and runtime.is_multi_process()
                and not backends.graph_collectives("jit_compile='auto'").compiles_collectives()):
            return False
        return original(self)
    return _resolve_auto_jit_compile
