"""The models mgpu-bench measures: input shape, classes, default batch and how to build them.

Imports no framework at module level (the driver reads the table without Keras). Builders
take the input shape in the data format the worker set (``keras.config.image_data_format()``):
``spec.shape(data_format)``.
"""

from typing import Callable, Dict, NamedTuple, Tuple


class BenchModel(NamedTuple):
    input_shape: Tuple[int, ...]  # channels_last
    classes: int
    batch_per_gpu: int
    build: Callable  # build(keras, shape) -> keras.Model, shape = self.shape(data_format)
    about: str

    def shape(self, data_format: str = "channels_last") -> Tuple[int, ...]:
        """The input shape in `data_format`: an image's channels move first for channels_first;
        a vector input has none to move."""
        if data_format == "channels_first" and len(self.input_shape) == 3:
            return (self.input_shape[-1],) + self.input_shape[:-1]
        return self.input_shape


def _resnet50(keras, shape):
    return keras.applications.ResNet50(weights=None, input_shape=shape, classes=1000)


def _inceptionv3(keras, shape):
    return keras.applications.InceptionV3(weights=None, input_shape=shape, classes=1000)


def _cifar_cnn(keras, shape):
    layers = keras.layers
    return keras.Sequential([
        keras.Input(shape),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(), layers.Dropout(0.25),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, activation="relu"),
        layers.MaxPooling2D(), layers.Dropout(0.25),
        layers.Flatten(), layers.Dense(512, activation="relu"), layers.Dropout(0.5),
        layers.Dense(10, activation="softmax")], name="cifar_cnn")


def _mlp(width: int, depth: int, name: str):
    def build(keras, shape):
        hidden = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        return keras.Sequential([keras.Input(shape), *hidden,
                                 keras.layers.Dense(10, activation="softmax")], name=name)
    return build


MODELS: Dict[str, BenchModel] = {
    "resnet50": BenchModel((224, 224, 3), 1000, 128, _resnet50,
                           "keras.applications.ResNet50, 25.6M parameters"),
    "inceptionv3": BenchModel((299, 299, 3), 1000, 64, _inceptionv3,
                              "keras.applications.InceptionV3, 23.9M parameters"),
    "cifar-cnn": BenchModel((32, 32, 3), 10, 128, _cifar_cnn,
                            "the Keras CIFAR-10 CNN example, 1.25M parameters"),
    "mlp": BenchModel((1024,), 10, 128, _mlp(4096, 2, "mlp"),
                      "1024-4096-4096-10 MLP, 21.0M parameters (the seed's large MLP)"),
    "mlp-tiny": BenchModel((32,), 10, 16, _mlp(64, 1, "mlp_tiny"),
                           "32-64-10 MLP for CPU smoke runs"),
}
