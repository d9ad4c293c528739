"""GGML quant type names and block sizes: the formats weights are stored in.

A quantized row of ``n`` weights is ``n // elems`` consecutive blocks of ``bytes`` each (``block_layout``);
the decoders beside each layout are in ``hmad.core.quants``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QType = GGMLQuantizationType

#: Types whose rows are stored as plain numbers rather than quant blocks.
PLAIN_TYPES = {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}


def block_layout(qtype: QType) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML type; plain types are blocks of one element."""
    return GGML_QUANT_SIZES[qtype]
