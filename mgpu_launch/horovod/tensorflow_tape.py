"""Horovod's ``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are reduced.

Wraps the tape (as ``DistributedOptimizer`` wraps an optimizer) instead of generating a
subclass of its class at run time as Horovod does; every attribute other than ``gradient``
is the wrapped tape's, and ``with hvd.DistributedGradientTape(tf.GradientTape()) as tape:``
records on it.
"""

from mgpu_launch import backends, runtime
from mgpu_launch.backends.reduction import GradientReduction
from mgpu_launch.horovod import support
from mgpu_launch.horovod.support import ProcessSet, global_process_set
from mgpu_launch.runtime.collectives import Average, Sum
from mgpu_launch.backends.compression import Compression

_NAME = "mgpu_launch.tensorflow"


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged (or summed) over
    the ranks, inside a ``tf.function`` or eagerly.

    Args:
        gradtape: the ``tf.GradientTape`` that recorded the loss.
        device_dense, device_sparse: ignored (one device per process).
        compression: ``Compression.none`` / ``.fp16`` / ``.bf16``: the gradients' wire dtype.
        sparse_as_dense: ``tf.IndexedSlices`` gradients summed as dense tensors (True) or,
            by default, every rank's slices gathered (exact single-process semantics).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with ``Average``: divide by this before the sum and by
            ``size / factor`` after it.
        num_groups, groups: must be 0 / None (gradients are fused per dtype by the engine).
        process_set: ``hvd.global_process_set`` (default) or a registered ``hvd.ProcessSet``:
            the gradients are reduced over its members only; on a rank outside it they stay
            local (Horovod's).
        scale_local_gradients: divide the gradients of sources registered with
            :meth:`register_local_source` by ``size()`` (the set's size; Horovod's default,
            True).

    Raises:
        ValueError: Adasum, Min/Max/Product, a predivide factor without Average, groups, or
            a process set that is no ``hvd.ProcessSet``.

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(labels, model(images, training=True))
        >>> tape = hvd.DistributedGradientTape(tape)
        >>> grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(self, gradtape, device_dense="", device_sparse="",
                 compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=global_process_set, scale_local_gradients=True):
        op = support.check_op(_NAME, op)
        if op not in (Average, Sum):
            support.reject(_NAME, "op", op, "gradients are averaged or summed: pass "
                            "op=hvd.Average or op=hvd.Sum.")
        if gradient_predivide_factor != 1.0 and op is not Average:
            support.reject(_NAME, "gradient_predivide_factor", gradient_predivide_factor,
                            "it splits an average: use it with op=hvd.Average only.")
        if num_groups or groups is not None:
            argument = "num_groups" if num_groups else "groups"
            support.reject(_NAME, argument, num_groups or groups, f"the engine fuses "
                            f"gradients into one buffer per dtype. Remove {argument}.")
        if process_set is not None and not isinstance(process_set, ProcessSet):
            support.reject(_NAME, "process_set", process_set, "pass hvd.global_process_set or "
                           "an hvd.ProcessSet registered with hvd.init(process_sets=[...]) or "
                           "hvd.add_process_set.")
        vars(self).update(_tape=gradtape, _local=set(), op=op, process_set=process_set,
                          compression=Compression.get(compression),
                          sparse_as_dense=bool(sparse_as_dense),
                          gradient_predivide_factor=float(gradient_predivide_factor),
                          scale_local_gradients=bool(scale_local_gradients))

    def __getattr__(self, name):  # watch, stop_recording, reset, jacobian, ...: the tape's
        return getattr(vars(self)["_tape"], name)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._tape.__exit__(*exc_info)

    def register_local_source(self, source) -> None:
        """Keep `source`'s gradient per rank: not reduced (divided by ``size()`` while
        ``scale_local_gradients``)."""
        self._local.add(id(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=None):
        """The tape's gradients of `target`, reduced over the ranks (local sources: not).

        Args:
            target, sources, output_gradients: as ``tf.GradientTape.gradient``; `sources` a
                variable or a flat list / tuple of them.
            use_generic_names: ignored (Horovod's op names).
            unconnected_gradients: passed to the tape when given.

        Returns:
            The gradients, in the order of `sources` (None stays None).
        """
        extra = {} if unconnected_gradients is None else {
            "unconnected_gradients": unconnected_gradients}
        single = not isinstance(sources, (list, tuple))
        sources = [sources] if single else list(sources)
        grads = list(self._tape.gradient(target, sources, output_gradients, **extra))
        if runtime.size() > 1:
            grads = self._reduce(grads, sources)
        return grads[0] if single else grads

    def _reduce(self, grads, sources):
        from keras import ops
        group = support.process_set_group(_NAME, self.process_set, "DistributedGradientTape",
                                          engine_needed=True, member=False)
        size = group.size
        factor = self.gradient_predivide_factor
        shared = [i for i, (g, s) in enumerate(zip(grads, sources))
                  if g is not None and id(s) not in self._local]
        result = list(grads)
        if runtime.rank() in group.ranks:  # outside the tape's set: local gradients (Horovod)
            options = GradientReduction(
                average=self.op is Average, prescale=1.0 / factor, postscale=factor,
                compression=self.compression, sparse_as_dense=self.sparse_as_dense)
            reduced = backends.get_engine().reduce_gradients(
                [grads[i] for i in shared], [sources[i] for i in shared], options, group=group)
            for i, gradient in zip(shared, reduced):
                result[i] = gradient
        if self.scale_local_gradients:
            for i, (g, s) in enumerate(zip(grads, sources)):
                if g is not None and id(s) in self._local:
                    result[i] = _divided(g, size, ops)
        return result

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``(local [(source, grad)], global [(source, grad)])``, Horovod's split."""
        pairs = list(zip(sources, self.gradient(target, list(sources), output_gradients)))
        return ([p for p in pairs if id(p[0]) in self._local],
                [p for p in pairs if id(p[0]) not in self._local])


def _divided(gradient, size: int, ops):
    values = getattr(gradient, "values", None)
    if values is not None and hasattr(gradient, "indices"):  # IndexedSlices stay sparse
        return type(gradient)(values / size, gradient.indices, gradient.dense_shape)
    return ops.divide(gradient, size)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A :class:`DistributedGradientTape` that keeps the gradients of `local_layers`' trainable
    weights per rank (Horovod's). The other arguments are DistributedGradientTape's.

    Example:
        >>> tape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for weight in support.local_layer_weights(local_layers):
        tape.register_local_source(weight)
    return tape
