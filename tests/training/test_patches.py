"""The patches of Keras internals and the accessors of the others (keras_internals): each
checks what it relies on, against the installed Keras.

The checks run against the real Keras classes: a patch whose attribute is missing or has other
parameters must fail with the Keras version and the attribute in the message. An accessor's
error path is shown on a stand-in object that lacks the internal (as a future Keras would).
"""

import pytest

keras = pytest.importorskip("keras")

from mgpu_launch import backends, keras_internals  # noqa: E402
from mgpu_launch.training import patches  # noqa: E402
from mgpu_launch.training.patches import PATCHES, KerasInternalsError, Patch  # noqa: E402

BACKEND = keras.backend.backend()
# The other backends' trainer modules import their framework: only this backend's patch set
# (its engine's) is checked here (the suite runs once per backend).
OWN = {r.name: r.patch
       for r in backends.get_engine_or_default(BACKEND).keras_patches(patches.hooks()).all()}
MINE = dict(OWN, **PATCHES)


@pytest.mark.backend
@pytest.mark.parametrize("name", sorted(MINE))
def test_every_patch_of_this_backend_matches_the_installed_keras(name):
    original = MINE[name].check()
    assert original is not None or MINE[name].optional


def test_a_missing_attribute_names_the_keras_version_and_the_attribute():
    with pytest.raises(KerasInternalsError) as error:
        Patch("keras.src.models.model:Model", "fit_v9", ("self",)).check()
    message = str(error.value)
    assert f"Keras {keras.__version__}" in message
    assert "keras.src.models.model.Model.fit_v9" in message and "does not exist" in message


def test_other_parameters_are_refused_with_both_lists():
    with pytest.raises(KerasInternalsError) as error:
        Patch("keras.src.models.model:Model", "fit", ("self", "dataset")).check()
    assert "('self', 'dataset')" in str(error.value) and "'x'" in str(error.value)


def test_a_missing_module_is_a_clear_error():
    with pytest.raises(KerasInternalsError, match="keras.src.no_such_module:Thing cannot be "
                                                   "imported"):
        Patch("keras.src.no_such_module:Thing", "run", ("self",)).check()


def test_an_owner_may_name_where_another_keras_keeps_the_class():
    moved = Patch("keras.src.no_such_module:Model|keras.src.models.model:Model", "fit",
                  ("self", "x"))
    assert moved.check() is keras.Model.fit
    with pytest.raises(KerasInternalsError, match="cannot be imported"):
        Patch("keras.src.models.model:NoModel|keras.src.no_such_module:Model", "fit",
              ("self",)).check()


def test_an_optional_attribute_may_be_absent_but_not_reshaped():
    assert Patch("keras.src.models.model:Model", "_absent_in_this_keras", ("self",),
                 optional=True).check() is None
    with pytest.raises(KerasInternalsError):
        Patch("keras.src.models.model:Model", "fit", ("self", "data"), optional=True).check()


def test_each_backend_declares_its_patches_in_its_own_folder():
    assert BACKEND in backends.BACKENDS and OWN, "the engine returns a patch set"
    assert all(name.startswith(("torch", "jax", "tf")) for name in OWN)
    assert not set(OWN) & set(PATCHES), "a backend's patch shadows a shared one"


@pytest.mark.backend
def test_install_wraps_once_and_only_its_backends_attributes():
    first = patches.install()
    assert patches.install() is first is patches.installed()  # once: the same context
    installed = [r.patch for r in first.patch_set.every_model + first.patch_set.kernels]
    for patch in installed + [PATCHES["fit"], PATCHES["compile_config"]]:
        current = getattr(patch.owner_class(), patch.attribute, None)
        if current is None:
            assert patch.optional
            continue
        assert getattr(current, "_mgpu", False), patch
        assert not getattr(current.__wrapped__, "_mgpu", False), f"{patch} wrapped twice"
    # the patched attribute still checks: the check looks through our wrapper
    assert PATCHES["fit"].check() is keras.Model.fit


@pytest.mark.backend
def test_a_script_without_init_gets_the_context_from_its_first_distributed_optimizer(
        monkeypatch):
    import mgpu_launch as mgpu
    monkeypatch.setattr(patches, "_context", None)
    optimizer = mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1))
    context = patches.installed()
    assert context is not None and context.patch_set is not None
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse")
    assert patches.uses_distributed_optimizer(model)
    mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert patches.installed() is context  # installed once


def test_keras_2_names_are_checked():
    with pytest.raises(ValueError, match=r"\['fit'\] are not Keras 2 patches"):
        patches.install(("fit",), models=False)


@pytest.mark.backend
def test_a_model_without_the_distributed_optimizer_trains_through_the_patches_unchanged():
    import numpy as np

    patches.install()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    assert not patches.uses_distributed_optimizer(model)
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


# -- keras_internals: the accessors of the internals read or written outside the patches ------
class _NotQuiteKeras:
    """A stand-in for a Keras object of a release that renamed its internals."""


def test_an_accessor_names_the_version_the_internal_and_its_use():
    with pytest.raises(KerasInternalsError) as error:
        keras_internals.raw_learning_rate(_NotQuiteKeras())
    message = str(error.value)
    assert f"Keras {keras.__version__}" in message and "_NotQuiteKeras._learning_rate" in message
    assert "does not exist" in message and "LearningRateSchedule" in message  # why mgpu needs it
    assert "pip install 'keras>=3.15,<3.17'" in message


def test_a_setter_does_not_create_an_internal_keras_would_not_read():
    stand_in = _NotQuiteKeras()
    with pytest.raises(KerasInternalsError, match="_initial_epoch"):
        keras_internals.set_initial_epoch(stand_in, 3)
    assert not hasattr(stand_in, "_initial_epoch")


def test_an_internal_module_that_is_gone_is_a_clear_error():
    with pytest.raises(KerasInternalsError, match="keras.src.no_such_module .*cannot be imported"):
        keras_internals._function("keras.src.no_such_module", "run", "a test")


def test_the_accessors_reach_the_installed_keras():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    assert keras_internals.raw_learning_rate(optimizer) is schedule
    other = keras.optimizers.schedules.ExponentialDecay(0.2, 10, 0.5)
    assert keras_internals.swap_learning_rate(optimizer, other) is schedule
    assert keras_internals.raw_learning_rate(optimizer) is other
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer.build(model.trainable_variables)
    assert [id(v) for v in keras_internals.built_variables(optimizer)] == [
        id(v) for v in model.trainable_variables]
    assert keras_internals.own_variables(optimizer)
    assert len(keras_internals.momentum_slots(optimizer)) == len(model.trainable_variables)
    assert keras_internals.momentum_slots(keras.optimizers.SGD(0.1)) is None
    assert keras_internals.initial_epoch(model) is None
    keras_internals.set_initial_epoch(model, 2)
    assert keras_internals.initial_epoch(model) == 2
    assert keras_internals.in_stateless_scope() is False
    with keras.StatelessScope():
        assert keras_internals.in_stateless_scope() is True
    assert keras_internals.in_symbolic_scope() is False


def test_model_checkpoint_checks_the_private_methods_it_overrides():
    keras_internals.check_model_checkpoint()  # the installed Keras has them all

    class OldCheckpoint:
        def _should_save_on_batch(self, batch):
            pass

    with pytest.raises(KerasInternalsError, match=r"OldCheckpoint\._save_model .*does not exist"):
        keras_internals.check_methods(OldCheckpoint, keras_internals.CHECKPOINT_METHODS, "a test")

    class Reshaped(keras.callbacks.ModelCheckpoint):
        def _get_file_path(self, epoch, logs):
            pass

    with pytest.raises(KerasInternalsError, match="_get_file_path.*'epoch', 'logs'"):
        keras_internals.check_methods(Reshaped, keras_internals.CHECKPOINT_METHODS, "a test")
