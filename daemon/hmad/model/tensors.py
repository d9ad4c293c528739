"""WeightTensor: one named weight as it lies in its file (quantized blocks or plain floats), memory-mapped."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QType = GGMLQuantizationType

#: Types whose rows are stored as plain numbers rather than quant blocks.
PLAIN_TYPES = {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}


@dataclass(frozen=True)
class WeightTensor:
    """A weight as stored: ``data`` is a view of the file (no copy), ``shape`` the logical numpy shape.

    - plain types: ``data`` has dtype float32/float16 (bf16 as uint16) and ``shape``;
    - quantized types: ``data`` is uint8 of shape ``(*shape[:-1], row_bytes)``; a row of ``shape[-1]``
      weights is ``shape[-1] // block_elems`` consecutive blocks.
    """

    name: str
    qtype: QType
    shape: tuple[int, ...]  # numpy order: (out_features, in_features) for a matrix
    data: np.ndarray
    source: str = ""  # file the bytes live in, for error messages

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def dequantize(self) -> np.ndarray:
        """float32 array of ``shape`` (a new array; the file stays untouched)."""
        from hmad.model.quants import dequantize

        return dequantize(self.data, self.qtype, self.shape)


def block_layout(qtype: QType) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type; plain types are blocks of one element."""
    return GGML_QUANT_SIZES[qtype]
