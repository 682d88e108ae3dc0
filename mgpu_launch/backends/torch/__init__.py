"""The torch backend: everything mgpu needs of it, in one folder (this file imports no
framework: the launcher reads :data:`FACTS`)."""

from mgpu_launch.backends.facts import BackendFacts

FACTS = BackendFacts(name="torch", engine="mgpu_launch.backends.torch.engine:TorchEngine",
                     pins_by_visible_devices=True, packages=("torch",))
