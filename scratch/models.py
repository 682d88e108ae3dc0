import numpy as np
import keras

def gpt2(layers=2, heads=2, hidden=64, ff=256, vocab=512, seq=64):
    import keras_hub
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=layers, num_heads=heads,
        hidden_dim=hidden, intermediate_dim=ff, dropout=0.0, max_sequence_length=seq)
    return keras.Model(backbone.input, backbone.token_embedding(backbone.output, reverse=True))

def gpt2_data(n=64, seq=64, vocab=512, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(n, seq + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((n, seq), bool)}
    return x, ids[:, 1:]

def convnet():
    return keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])

def conv_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16, 16, 3)).astype("float32"), rng.integers(0, 10, size=n)
