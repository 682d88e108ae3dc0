"""The JAX backend's Keras patch set: the prefetched epoch iterator, the train step under the
engine's ``shard_map``, process-local state handed back to Keras (``JaxEngine.keras_patches``
returns it; ``mgpu_launch.training.patches`` installs it with the shared ones)."""

from mgpu_launch import backends
from mgpu_launch.keras_patching import Hooks, Patch, PatchSet, Replacement

# Keras 3.15-3.16 name, then keras-team's HEAD's (JAXTrainer -> Trainer)
_TRAINER = "keras.src.backend.jax.trainer:JAXTrainer|keras.src.backend.jax.trainer:Trainer"


def patch_set(hooks: Hooks) -> PatchSet:
    """The JAX patches, their replacements built on `hooks` (values from the training layer)."""
    return PatchSet(every_model=(
        Replacement("jax_iterator",
                    Patch("keras.src.backend.jax.trainer:JAXEpochIterator", "_get_iterator",
                          ("self",)),
                    hooks.epoch_iterator, "feed batches from the device prefetcher"),
        Replacement("jax_train_function", Patch(_TRAINER, "make_train_function",
                                                ("self", "force")),
                    lambda original: train_function(original, hooks),
                    "run the train step under the engine's shard_map (gradients psum-ed)"),
        Replacement("jax_state_sync", Patch(_TRAINER, "jax_state_sync", ("self",)),
                    state_sync, "give Keras process-local arrays back"),
    ))


def train_function(original, hooks: Hooks):
    def make_train_function(self, force=False):
        engine = backends.get_engine()
        if not (hooks.uses_distributed_optimizer(self) and engine.owns_train_step()):
            return original(self, force)
        if self.train_function is not None and not force:
            return
        self.train_function = self._make_function(engine.train_function(self))
    return make_train_function


def state_sync(original):
    def jax_state_sync(self):
        if getattr(self, "_jax_state", None) and not self._jax_state_synced:
            # Keras keeps these as TrackedLists, which jax.tree treats as leaves.
            localize = backends.get_engine().localize
            self._jax_state = {key: [localize(v) for v in values]
                               for key, values in self._jax_state.items()}
        original(self)
    return jax_state_sync
