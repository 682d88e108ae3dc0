"""The jax backend: everything mgpu needs of it, in one folder (this file imports no
framework: the launcher reads :data:`FACTS`)."""

from mgpu_launch.backends.facts import BackendFacts

# every GPU stays visible: CUDA_VISIBLE_DEVICES hangs jax.distributed's topology exchange, so
# the engine picks MGPU_LOCAL_DEVICE itself (JaxEngine.setup)
FACTS = BackendFacts(name="jax", engine="mgpu_launch.backends.jax.engine:JaxEngine",
                     pins_by_visible_devices=False, packages=("jax", "jaxlib"))
