"""The models mgpu-bench measures: input shape, classes, default batch and how to build them.

Imports no framework at module level (the driver reads the table without Keras).
"""

from typing import Callable, Dict, NamedTuple, Tuple


class BenchModel(NamedTuple):
    input_shape: Tuple[int, ...]
    classes: int
    batch_per_gpu: int
    build: Callable  # build(keras) -> keras.Model
    about: str


def _resnet50(keras):
    return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)


def _inceptionv3(keras):
    return keras.applications.InceptionV3(weights=None, input_shape=(299, 299, 3), classes=1000)


def _cifar_cnn(keras):
    layers = keras.layers
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(), layers.Dropout(0.25),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, activation="relu"),
        layers.MaxPooling2D(), layers.Dropout(0.25),
        layers.Flatten(), layers.Dense(512, activation="relu"), layers.Dropout(0.5),
        layers.Dense(10, activation="softmax")], name="cifar_cnn")


def _mlp(width: int, inputs: int, depth: int, name: str):
    def build(keras):
        hidden = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        return keras.Sequential([keras.Input((inputs,)), *hidden,
                                 keras.layers.Dense(10, activation="softmax")], name=name)
    return build


MODELS: Dict[str, BenchModel] = {
    "resnet50": BenchModel((224, 224, 3), 1000, 128, _resnet50,
                           "keras.applications.ResNet50, 25.6M parameters"),
    "inceptionv3": BenchModel((299, 299, 3), 1000, 64, _inceptionv3,
                              "keras.applications.InceptionV3, 23.9M parameters"),
    "cifar-cnn": BenchModel((32, 32, 3), 10, 128, _cifar_cnn,
                            "the Keras CIFAR-10 CNN example, 1.25M parameters"),
    "mlp": BenchModel((1024,), 10, 128, _mlp(4096, 1024, 2, "mlp"),
                      "1024-4096-4096-10 MLP, 21.0M parameters (the seed's large MLP)"),
    "mlp-tiny": BenchModel((32,), 10, 16, _mlp(64, 32, 1, "mlp_tiny"),
                           "32-64-10 MLP for CPU smoke runs"),
}
