"""The models mgpu-bench measures: input, labels, default batch, optimizer and how to build them.

Imports no framework at module level (the driver reads the table without Keras). Builders
take the input shape in the data format the worker set (``keras.config.image_data_format()``):
``spec.shape(data_format)``.

Two families:

- **image and vector models** (``resnet50``, ``inceptionv3``, ``cifar-cnn``, ``mlp``,
  ``mlp-tiny``): float inputs, softmax outputs, ``SGD(momentum=0.9)``; throughput in images
  (samples) per second.
- **transformers** built from keras-hub configs, random weights, nothing downloaded
  (:data:`TRANSFORMERS`): ``gpt2-small-lm`` (the GPT-2-small-shaped causal LM of issue 63:
  ``keras.Model(backbone.input, backbone.token_embedding(backbone.output, reverse=True))`` on a
  ``GPT2Backbone``, next-token loss on every position), ``bert-base-classifier`` (a
  ``BertBackbone`` with a Dense head on its pooled output, 2 classes), and ``gpt2-tiny-lm`` /
  ``bert-tiny`` for CPU runs. Synthetic token ids, every position real (the padding mask all
  ones), ``AdamW``, sparse categorical cross-entropy from logits; throughput in tokens per second
  (sequences per second x tokens per sequence). Dropout is keras-hub's default (0.1), as the
  native rows' (``native_models.py``).
"""

from typing import Callable, Dict, NamedTuple, Optional, Tuple


class Transformer(NamedTuple):
    """A transformer's shape: keras-hub's arguments, and the native torch model's."""

    kind: str  # "gpt2" (causal LM, pre-LN, tied output) or "bert" (post-LN encoder, classifier)
    layers: int
    heads: int
    hidden: int
    feed_forward: int
    vocabulary: int
    sequence: int  # tokens per sequence
    classes: int = 0  # bert: the classifier's classes (gpt2: the vocabulary is the output)
    dropout: float = 0.1


class BenchModel(NamedTuple):
    input_shape: Tuple[int, ...]  # channels_last; (tokens,) for a transformer
    classes: int
    batch_per_gpu: int
    build: Callable  # build(keras, shape) -> keras.Model, shape = self.shape(data_format)
    about: str
    transformer: Optional[Transformer] = None

    def shape(self, data_format: str = "channels_last") -> Tuple[int, ...]:
        """The input shape in `data_format`: an image's channels move first for channels_first;
        a vector or token input has none to move."""
        if data_format == "channels_first" and len(self.input_shape) == 3:
            return (self.input_shape[-1],) + self.input_shape[:-1]
        return self.input_shape

    @property
    def unit(self) -> str:
        """What the row's ``rate`` counts: ``tokens/s``, ``img/s`` or ``samples/s``."""
        if self.transformer is not None:
            return "tokens/s"
        return "img/s" if len(self.input_shape) == 3 else "samples/s"

    @property
    def tokens_per_sample(self) -> Optional[int]:
        """Tokens per sequence for a transformer (rate = samples/s x this), else None."""
        return self.transformer.sequence if self.transformer is not None else None

    def compile_arguments(self, keras, learning_rate_scale: float = 1.0) -> dict:
        """``optimizer`` (before any DistributedOptimizer) and ``loss`` for ``model.compile``:
        SGD(0.0125 x scale, momentum 0.9) and softmax cross-entropy for the image and vector
        models, AdamW(1e-4 x scale, weight decay 0.01) and cross-entropy from logits for the
        transformers."""
        if self.transformer is None:
            return {"optimizer": keras.optimizers.SGD(0.0125 * learning_rate_scale,
                                                      momentum=0.9),
                    "loss": "sparse_categorical_crossentropy"}
        return {"optimizer": keras.optimizers.AdamW(1e-4 * learning_rate_scale,
                                                    weight_decay=0.01),
                "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}

    def synthetic(self, np, shape, batch: int, rng) -> Tuple[object, object]:
        """One random (x, y) batch of numpy arrays: float32 inputs (`shape`) and int32 class
        labels; for a transformer a dict of int32 ``token_ids``, ``padding_mask`` (all ones)
        and (BERT) ``segment_ids`` (zeros), with next-token labels (GPT-2) or class labels."""
        spec = self.transformer
        if spec is None:
            return (rng.random((batch,) + tuple(shape), dtype=np.float32),
                    rng.integers(0, self.classes, (batch,)).astype("int32"))
        tokens = rng.integers(1, spec.vocabulary, (batch, spec.sequence + 1)).astype("int32")
        x = {"token_ids": tokens[:, :-1],
             "padding_mask": np.ones((batch, spec.sequence), "int32")}
        if spec.kind == "bert":
            x["segment_ids"] = np.zeros((batch, spec.sequence), "int32")
            return x, rng.integers(0, spec.classes, (batch,)).astype("int32")
        return x, tokens[:, 1:]


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


def _keras_hub(spec: Transformer):
    def build(keras, shape):
        import keras_hub
        arguments = dict(vocabulary_size=spec.vocabulary, num_layers=spec.layers,
                         num_heads=spec.heads, hidden_dim=spec.hidden,
                         intermediate_dim=spec.feed_forward, dropout=spec.dropout,
                         max_sequence_length=spec.sequence)
        if spec.kind == "gpt2":  # GPT2CausalLM's graph without its preprocessor (no download)
            backbone = keras_hub.models.GPT2Backbone(**arguments)
            logits = backbone.token_embedding(backbone.output, reverse=True)
            return keras.Model(backbone.input, logits, name="gpt2_lm")
        backbone = keras_hub.models.BertBackbone(**arguments)
        logits = keras.layers.Dense(spec.classes, name="logits")(
            backbone.output["pooled_output"])
        return keras.Model(backbone.input, logits, name="bert_classifier")
    return build


def _transformer(spec: Transformer, batch: int, about: str) -> BenchModel:
    classes = spec.vocabulary if spec.kind == "gpt2" else spec.classes
    return BenchModel((spec.sequence,), classes, batch, _keras_hub(spec), about, spec)


TRANSFORMERS: Dict[str, Transformer] = {
    "gpt2-small-lm": Transformer("gpt2", 6, 8, 512, 2048, 8192, 256),
    "gpt2-tiny-lm": Transformer("gpt2", 2, 2, 64, 256, 512, 32),
    "bert-base-classifier": Transformer("bert", 12, 12, 768, 3072, 30522, 128, classes=2),
    "bert-tiny": Transformer("bert", 2, 2, 64, 256, 1024, 32, classes=2),
}

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
    "gpt2-small-lm": _transformer(
        TRANSFORMERS["gpt2-small-lm"], 32,
        "keras-hub GPT2Backbone as a causal LM: 6 layers, 8 heads, hidden 512, feed-forward "
        "2048, vocabulary 8192, 256 tokens"),
    "gpt2-tiny-lm": _transformer(TRANSFORMERS["gpt2-tiny-lm"], 8,
                                 "the same with 2 layers, 2 heads, hidden 64, vocabulary 512, "
                                 "32 tokens: CPU smoke runs"),
    "bert-base-classifier": _transformer(
        TRANSFORMERS["bert-base-classifier"], 32,
        "keras-hub BertBackbone + Dense(2) on the pooled output: 12 layers, 12 heads, hidden "
        "768, feed-forward 3072, vocabulary 30522, 128 tokens"),
    "bert-tiny": _transformer(TRANSFORMERS["bert-tiny"], 8,
                              "the same with 2 layers, 2 heads, hidden 64, vocabulary 1024, "
                              "32 tokens: CPU smoke runs"),
}
