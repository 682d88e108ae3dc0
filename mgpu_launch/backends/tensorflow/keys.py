"""The TensorFlow collectives' instance keys and ordering token, owned by one object.

Every in-graph collective of the TensorFlow engine (``engine.py``: the sums; ``collectives.py``:
gathers, broadcasts, reductions) takes its instance key and ordering token from the engine's
one :class:`CollectiveKeys`, which both modules receive (as ``engine.keys``): no module
reaches into another's private tables. Why the keys are derived as they are: the engine's
module docstring ("Instance keys").

Key ranges, disjoint: keys derived from a collective's signature in [1, ``FIXED_KEYS``]; the
counters for buffers of unknown shape count up from ``FIXED_KEYS``; padded gathers use blocks
of ``BLOCK`` keys in [``BUCKET_REGION``, 2**31) (a counter would need 2**29 executions to get
there).
"""

import weakref
import zlib

__all__ = ["CollectiveKeys", "FIXED_KEYS", "BUCKET_REGION", "BLOCK"]

FIXED_KEYS = 2 ** 30
BUCKET_REGION = 3 * 2 ** 29
BLOCK = 1024
_BLOCKS = (2 ** 31 - BUCKET_REGION) // BLOCK


class CollectiveKeys:
    """The instance keys of one engine's collectives, the same on every rank.

    :meth:`create` makes the TensorFlow variables (the ordering token, the fresh-key counter)
    once the collective ops are enabled; before it, :attr:`ordering_token` is None.
    """

    def __init__(self):
        self.counter = None  # fresh keys for buffers of unknown shape (the global set's)
        self.ordering_token = None  # keeps every collective of a step in program order
        self._signatures = {}  # fixed instance key -> the signature it was derived from
        self._set_counters = {}  # TF group key of a process set -> its fresh-key counter
        # graph being traced -> {signature: collectives of that signature traced so far}
        self._positions = weakref.WeakKeyDictionary()
        self._bucket_blocks = {}  # block of padded-gather keys -> the signature that owns it

    def create(self) -> None:
        """Make the counter and the ordering token (outside any traced function)."""
        import tensorflow as tf
        with tf.init_scope():
            self.counter = tf.Variable(FIXED_KEYS, dtype=tf.int32, trainable=False,
                                       name="mgpu_collective_instance_key")
            self.ordering_token = tf.Variable(0.0, trainable=False,
                                              name="mgpu_collective_ordering_token")

    def position(self, base) -> int:
        """How many collectives of signature `base` the graph being traced issued before this
        one (0 eagerly): part of a collective's key, so every rank derives the same keys."""
        import tensorflow as tf
        from tensorflow.python.framework import ops

        if tf.executing_eagerly():
            return 0
        seen = self._positions.setdefault(ops.get_default_graph(), {})
        seen[base] = seen.get(base, -1) + 1
        return seen[base]

    def for_collective(self, flat, kind: str = "reduce", group=None):
        """The same key on every rank and in every execution of this collective; a fresh one
        per execution when the buffer's shape is not static. `kind` keeps collectives of other
        types (gathers, broadcasts) off a sum's keys; `group` (a process set's
        ``collectives.Members``) tags the signature with its set and counts fresh keys on a
        counter of its own (its members alone execute them)."""
        tag = group.tag if group is not None else ""
        if not flat.shape.is_fully_defined():
            return self._counter(group).assign_add(1)
        kind = f"{tag}{kind}"
        position = self.position((kind, flat.dtype.name, tuple(flat.shape.as_list())))
        signature = f"{flat.dtype.name}:{flat.shape.as_list()}:{position}"
        signature = signature if kind == "reduce" else f"{kind}:{signature}"  # (global sums)
        key = 1 + zlib.crc32(signature.encode()) % FIXED_KEYS
        _claim(self._signatures, key, signature, "collectives", f"instance key {key}",
               "one buffer's shape or dtype")
        return key

    def bucket_base(self, signature: str) -> int:
        """The first key of the block of padded-gather keys that `signature` owns."""
        block = zlib.crc32(signature.encode()) % _BLOCKS
        _claim(self._bucket_blocks, block, signature, "gathers", f"key block {block}",
               "one tensor's trailing shape or dtype")
        return BUCKET_REGION + block * BLOCK

    def _counter(self, group):
        """The variable fresh instance keys are counted on: one per TensorFlow group."""
        import tensorflow as tf
        if group is None or group.process_set_id == 0:
            return self.counter
        if group.key not in self._set_counters:
            with tf.init_scope():  # also when first asked for inside a traced function
                self._set_counters[group.key] = tf.Variable(
                    FIXED_KEYS, dtype=tf.int32, trainable=False,
                    name=f"mgpu_collective_instance_key_set{group.process_set_id}")
        return self._set_counters[group.key]


def _claim(table: dict, slot: int, signature: str, what: str, where: str, change: str) -> None:
    """Give `slot` of `table` to `signature`; two signatures on one slot (a hash collision of
    their CRC-32) would make two TensorFlow collectives meet as one, so that raises."""
    known = table.setdefault(slot, signature)
    if known != signature:
        raise RuntimeError(
            f"mgpu: two different TensorFlow {what} ({known} and {signature}) map to {where}. "
            f"This is a hash collision, not a mistake of yours; report it, and meanwhile "
            f"change {change}.")

