"""WeightTensor: one named weight as it lies in its file (quantized blocks or plain floats), memory-mapped."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hmad.core.qtypes import PLAIN_TYPES, QType, block_layout
from hmad.core.quants import dequantize

__all__ = ["PLAIN_TYPES", "QType", "WeightTensor", "block_layout"]


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
        return dequantize(self.data, self.qtype, self.shape)
