"""The small classifier the resume test workers train (imported from their folder)."""


def compiled(keras, mgpu):
    """Dense(5 -> 4 tanh -> 3) from seed 1, SGD(0.1, momentum 0.9) in a DistributedOptimizer."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
