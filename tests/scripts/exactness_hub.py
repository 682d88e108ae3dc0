"""The keras-hub cases of the exactness matrix (issue 48): transformers as people fine-tune them,
built from tiny configs with random weights (nothing downloaded), fed the ways users feed them.

Each model is a keras-hub ``Task`` without a preprocessor, so ``Task.fit`` takes token ids:

- ``gpt2_lm``: a GPT-2 causal LM (token ids and padding mask in, next-token logits out);
- ``bert_classifier``: a BERT text classifier (token ids, segment ids, padding mask);
- ``bert_lora``: the same classifier with LoRA (rank 2) on its backbone, only the adapters and
  the head trainable.

Dropout is 0 everywhere (else the ranks' and the reference's masks differ).

The optimizer is AdamW with ``epsilon=EPSILON`` (1e-3; Keras's default is 1e-7). Adam divides each
update by ``sqrt(v) + epsilon``, so an error ``d`` in a gradient moves its weight by up to
``lr * d / epsilon`` per step: where a gradient is near zero (a transformer's attention key
biases have a zero gradient in exact arithmetic, as softmax ignores a constant added to every
logit of a query; GELU units far in their flat part), float32 rounding of 1e-9 becomes an
arbitrary 1e-4 with the default epsilon, in two single-process runs that only split a batch
differently too. With 1e-3, the same rounding moves a weight by ~1e-8, under the comparison's
rtol of 1e-5, so the comparison sees the reduction's arithmetic, not Adam's amplification.

The feeding ways (``FEEDS``): ``split`` (this rank's arrays to ``Task.fit`` with
``batch_size``: keras-hub makes a ``tf.data`` whose batch dimension is unknown), ``shard``
(``mgpu.data.shard`` of a tf.data of the arrays, as the README tells keras-hub users) and
``tfdata`` (the user's own ``tf.data``, batched without ``drop_remainder``).
"""

import numpy as np

VOCABULARY = 40
EPSILON = 1e-3  # Adam's epsilon (module docstring)
LENGTH = 8
FEEDS = ("split", "shard", "tfdata")


def gpt2_lm():
    import keras_hub
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout=0.0, max_sequence_length=LENGTH)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _bert_backbone():
    import keras_hub
    return keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout=0.0, max_sequence_length=LENGTH)


def bert_classifier():
    import keras_hub
    return keras_hub.models.BertTextClassifier(backbone=_bert_backbone(), num_classes=3,
                                               preprocessor=None, dropout=0.0)


def bert_lora():
    import keras_hub
    backbone = _bert_backbone()
    backbone.enable_lora(rank=2)
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3,
                                               preprocessor=None, dropout=0.0)


MODELS = {"gpt2_lm": gpt2_lm, "bert_classifier": bert_classifier, "bert_lora": bert_lora}


def cases():
    """case name -> (model name, feed), for every model and feeding way."""
    return {f"{model}_{feed}": (model, feed) for model in MODELS for feed in FEEDS}


def data(model: str, samples: int, rng):
    """(x, y, sample_weight) for `samples` sequences: some padded at the end (a shorter
    sequence), as real batches are."""
    ids = rng.integers(1, VOCABULARY, size=(samples, LENGTH)).astype("int32")
    lengths = rng.integers(LENGTH // 2, LENGTH + 1, size=samples)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0).astype("int32")
    if model == "gpt2_lm":  # next-token prediction: the loss ignores padded positions
        x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
        return x, ids[:, 1:], mask[:, 1:].astype("float32")
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    return x, rng.integers(0, 3, size=samples), None


def feed(way: str, x, y, sample_weight, batch: int):
    """What `fit` gets: {"x": ..., "y": ..., "batch_size": ...} for the feeding way."""
    if way == "split":  # arrays: no TensorFlow needed (GPU machines without it run this way)
        return {"x": x, "y": y, "sample_weight": sample_weight, "batch_size": batch}
    import tensorflow as tf

    import mgpu_launch as mgpu
    arrays = (x, y) if sample_weight is None else (x, y, sample_weight)
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if way == "shard":
        return {"x": mgpu.data.shard(dataset, batch_size=batch)}
    return {"x": dataset.batch(batch)}  # no drop_remainder: the batch dimension is unknown
