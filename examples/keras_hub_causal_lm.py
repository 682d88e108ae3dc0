"""Fine-tune a keras-hub causal language model (GPT-2 architecture) on N processes.

    mgpu-train -np 2 examples/keras_hub_causal_lm.py                      # tiny, CPU is fine
    mgpu-train -np 2 examples/keras_hub_causal_lm.py --size small --precision mixed_bfloat16
    mgpu-train -np 2 examples/keras_hub_causal_lm.py --tokens ids.npy     # your own token ids

The model is built from a config with random weights (nothing is downloaded; with a preset you
have on disk, use ``keras_hub.models.GPT2CausalLM.from_preset(path, preprocessor=None)``
instead). The data are token ids: by default synthetic sequences that follow a rule the model
can learn (each sequence counts up from a random start in a random stride, modulo the
vocabulary), so the loss falls; ``--tokens`` takes a ``.npy`` of shape (sequences,
length + 1) of your own tokenizer's ids (0 is padding). Each rank takes its part of the
sequences through ``mgpu.data.shard`` of a ``tf.data.Dataset`` (keras-hub's ``Task.fit`` takes
tf.data, not a PyDataset), the learning rate is scaled by the number of processes with a
warm-up, and rank 0 prints the throughput in tokens per second, summed over the ranks.
"""

import argparse

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402 - after init, as the README asks
import keras_hub  # noqa: E402
import tensorflow as tf  # noqa: E402 - tf.data, which keras-hub's Task.fit takes

SIZES = {  # GPT-2 configurations: (layers, heads, hidden, feed-forward, vocabulary)
    "tiny": (2, 2, 64, 256, 512),
    "small": (6, 8, 512, 2048, 8192),
    "gpt2-base": (12, 12, 768, 3072, 50257),
}

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, per process")
parser.add_argument("--sequences", type=int, default=2048, help="synthetic sequences in all")
parser.add_argument("--tokens", help=".npy of token ids, shape (sequences, seq_len + 1)")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--base-lr", type=float, default=1e-3, help="for one process")
parser.add_argument("--warmup-epochs", type=int, default=1)
parser.add_argument("--dropout", type=float, default=0.1, help="GPT-2's dropout rate")
parser.add_argument("--precision", default="float32",
                    choices=["float32", "mixed_bfloat16", "mixed_float16"])
args = parser.parse_args()
keras.mixed_precision.set_global_policy(args.precision)
layers, heads, hidden, feed_forward, vocabulary = SIZES[args.size]


def synthetic_tokens(count: int, length: int) -> np.ndarray:
    """Sequences that count from a random start in a random stride (1-3), modulo the
    vocabulary (ids 1 .. vocabulary - 1; 0 is padding): the same on every rank (seeded)."""
    rng = np.random.default_rng(0)
    start = rng.integers(1, vocabulary, size=(count, 1))
    stride = rng.integers(1, 4, size=(count, 1))
    return 1 + (start + stride * np.arange(length)[None, :]) % (vocabulary - 1)


if args.tokens:
    ids = np.load(args.tokens)
    if ids.ndim != 2 or ids.shape[1] < 2 or ids.min() < 0 or ids.max() >= vocabulary:
        raise SystemExit(f"--tokens {args.tokens}: expected token ids of shape (sequences, "
                         f"length + 1) in [0, {vocabulary}) for --size {args.size}; got shape "
                         f"{ids.shape}, ids {ids.min()} .. {ids.max()}")
    args.seq_len = ids.shape[1] - 1
else:
    ids = synthetic_tokens(args.sequences, args.seq_len + 1)
ids = ids.astype("int32")
mask = ids != 0
features = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
dataset = tf.data.Dataset.from_tensor_slices((features, ids[:, 1:], mask[:, 1:].astype("float32")))
train = mgpu.data.shard(dataset, batch_size=args.batch_size, shuffle=True, seed=1)

keras.utils.set_random_seed(42)
backbone = keras_hub.models.GPT2Backbone(
    vocabulary_size=vocabulary, num_layers=layers, num_heads=heads, hidden_dim=hidden,
    intermediate_dim=feed_forward, max_sequence_length=args.seq_len, dropout=args.dropout)
causal_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
lr = mgpu.scale_lr(args.base_lr)
causal_lm.compile(
    optimizer=mgpu.DistributedOptimizer(keras.optimizers.AdamW(lr, weight_decay=0.01)),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    weighted_metrics=["accuracy"])
throughput = mgpu.callbacks.ThroughputCallback(args.batch_size, verbose=0)
callbacks = [mgpu.callbacks.BroadcastGlobalVariablesCallback(0),
             mgpu.callbacks.MetricAverageCallback(), throughput]
if mgpu.size() > 1:
    callbacks.append(mgpu.callbacks.LearningRateWarmupCallback(
        lr, warmup_epochs=args.warmup_epochs))
history = causal_lm.fit(train, epochs=args.epochs, callbacks=callbacks,
                        verbose=2 if mgpu.is_chief() else 0)
if mgpu.is_chief():
    rates = history.history.get("samples_per_sec", [])
    tokens = max(rates) * args.seq_len if rates else float("nan")
    print(f"GPT-2 {args.size} ({backbone.count_params() / 1e6:.1f}M parameters), "
          f"{args.precision}, {mgpu.size()} process(es) x {args.batch_size} sequences of "
          f"{args.seq_len} tokens: {tokens:.0f} tokens/s (best epoch's median step, all ranks); "
          f"final loss {history.history['loss'][-1]:.3f}, "
          f"accuracy {history.history['accuracy'][-1]:.3f}")
