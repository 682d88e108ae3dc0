"""Gradient compression for the wire: cast floating tensors down before the allreduce, back after.

    mgpu.DistributedOptimizer(opt, compression=mgpu.Compression.fp16)
"""

import keras


class Compressor:
    """Casts floating-point tensors to `wire_dtype` for the collective (None: no cast)."""

    def __init__(self, name: str, wire_dtype=None):
        self.name, self.wire_dtype = name, wire_dtype

    def compress(self, tensor):
        if self.wire_dtype is None or "float" not in keras.backend.standardize_dtype(tensor.dtype):
            return tensor
        return keras.ops.cast(tensor, self.wire_dtype)

    def decompress(self, tensor, dtype):
        return tensor if self.wire_dtype is None else keras.ops.cast(tensor, dtype)

    def __repr__(self):
        return f"Compression.{self.name}"


class Compression:
    """The available codecs (Horovod's names)."""

    none = Compressor("none")
    fp16 = Compressor("fp16", "float16")
    bf16 = Compressor("bf16", "bfloat16")

    @classmethod
    def get(cls, name_or_codec) -> Compressor:
        if isinstance(name_or_codec, Compressor):
            return name_or_codec
        codec = getattr(cls, str(name_or_codec), None)
        if not isinstance(codec, Compressor):
            raise ValueError(f"compression={name_or_codec!r}: expected Compression.none, "
                             f"Compression.fp16 or Compression.bf16")
        return codec
