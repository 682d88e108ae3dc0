"""The patches of Keras internals: each checks what it replaces, against the installed Keras.

The checks run against the real Keras classes: a patch whose attribute is missing or has other
parameters must fail with the Keras version and the attribute in the message.
"""

import pytest

keras = pytest.importorskip("keras")

from mgpu_launch import keras_patches  # noqa: E402
from mgpu_launch.keras_patches import PATCHES, KerasInternalsError, Patch  # noqa: E402

BACKEND = keras.backend.backend()
# The other backends' trainer modules import their framework: only this backend's are checked
# here (the suite runs once per backend).
MINE = sorted(set(keras_patches.BY_BACKEND[BACKEND]) | {"compile", "resume_iterator"}
              | (set(keras_patches.FOR_CUDA_GRAPHS) if BACKEND == "torch" else set()))


@pytest.mark.backend
@pytest.mark.parametrize("name", MINE)
def test_every_patch_of_this_backend_matches_the_installed_keras(name):
    original = PATCHES[name].check()
    assert original is not None or PATCHES[name].optional


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


def test_an_optional_attribute_may_be_absent_but_not_reshaped():
    assert Patch("keras.src.models.model:Model", "_absent_in_this_keras", ("self",),
                 optional=True).check() is None
    with pytest.raises(KerasInternalsError):
        Patch("keras.src.models.model:Model", "fit", ("self", "data"), optional=True).check()


@pytest.mark.backend
def test_install_wraps_once_and_only_its_backends_attributes():
    class Marker:
        pass

    keras_patches.install(Marker)
    keras_patches.install(Marker)
    for name in keras_patches.BY_BACKEND[BACKEND]:
        patch = PATCHES[name]
        current = getattr(patch.owner_class(), patch.attribute, None)
        if current is None:
            assert patch.optional
            continue
        assert getattr(current, "_mgpu", False), name
        assert not getattr(current.__wrapped__, "_mgpu", False), f"{name} wrapped twice"
    # the patched attribute still checks: the check looks through our wrapper
    assert PATCHES["fit"].check() is keras.Model.fit


@pytest.mark.backend
def test_a_model_without_the_distributed_optimizer_trains_through_the_patches_unchanged():
    import numpy as np

    class Marker:
        pass

    keras_patches.install(Marker)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    assert not keras_patches.uses_distributed_optimizer(model)
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
