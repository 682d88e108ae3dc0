"""The tensorflow backend: everything mgpu needs of it, in one folder (this file imports no
framework: the launcher reads :data:`FACTS`)."""

from mgpu_launch.backends.facts import BackendFacts

FACTS = BackendFacts(name="tensorflow",
                     engine="mgpu_launch.backends.tensorflow.engine:TensorFlowEngine",
                     pins_by_visible_devices=True, packages=("tensorflow", "tensorflow-cpu"),
                     keras_synchronizes_batch_norm=True)
