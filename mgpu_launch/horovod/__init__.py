"""The Horovod layer: what exists only so that a Horovod script runs with its import line changed.

``import mgpu_launch.keras as hvd`` (Horovod's ``horovod.tensorflow.keras``) and
``import mgpu_launch.tensorflow as hvd`` (``horovod.tensorflow``) are the public paths; the
names behind them live here, each a thin layer over the runtime, the engines and the training
glue below. docs/horovod-migration.md lists every difference. Its modules:

    support          what both namespaces share: the build queries, the reduction ops, the
                     process sets, and HorovodNotSupported for what is not provided
    keras_api        the ``horovod.tensorflow.keras`` names
    keras_values     their collectives on values (host, or in-graph in a ``tf.function``)
    keras_callbacks  Horovod's callback names and arguments over ``mgpu_launch.callbacks``
    tensorflow_api   the ``horovod.tensorflow`` names
    tensorflow_ops   in-graph TensorFlow collectives (inside a ``tf.function``)
    tensorflow_tape  DistributedGradientTape for custom TensorFlow loops
    elastic_state    what every ``hvd.elastic`` state shares: declared attributes read back
                     as data, reset callbacks, ``run``
    elastic_store    the commit files of a state without a Keras model
    object_state     ``ObjectState``: plain values, no model
    elastic          ``hvd.elastic`` for Keras: KerasState and its callbacks, over mgpu's
                     restart-based elastic training
    tensorflow_elastic  ``hvd.elastic`` for custom loops: TensorFlowKerasState, TensorFlowState

Nothing below this layer imports it.
"""
