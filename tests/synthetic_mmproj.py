"""A synthetic Gemma 3 projector GGUF (llama.cpp's "mmproj" layout) of any tower shape, random weights.

Used by bench/bench_vision.py (Gemma 3's real tower shape, the speed figures) and by the fixture script
tests/fixtures/make_llamacpp_vision_reference.py and its test (a small tower beside the embedded 270M).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hf_tiny import clip_writer

from hmad.model.vision import VisionConfig, expected_shapes

#: Gemma 3 4B/12B/27B's SigLIP tower (896 px, patch 14: 4096 patches pooled 4 x 4 to 256 soft tokens)
GEMMA3_TOWER = dict(image_size=896, patch_size=14, hidden=1152, n_layers=27, n_heads=16, ffn=4304)


def write_mmproj(path: Path, text_width: int, seed: int = 0, tower: dict | None = None) -> Path:
    """A Gemma 3 projector GGUF of ``tower``'s shape (Gemma 3's real one by default), random weights of sane
    scale: float16 matrices, float32 embeddings and 1-D tensors, as llama.cpp's converter stores them; the
    pooling scale 4 (llama.cpp's default for gemma3), so ``image_size / patch_size / 4`` tokens a side."""
    t = tower or GEMMA3_TOWER
    side = t["image_size"] // t["patch_size"] // 4
    cfg = VisionConfig(**t, eps=1e-6, mm_tokens_per_image=side * side, text_hidden=text_width)
    rng = np.random.default_rng(seed)
    w = clip_writer(path, text_width, t, [0.5] * 3, [0.5] * 3)
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:  # norms' weights around 1 (the projector's RMS norm as 1 + w), biases small
            one = name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight", "soft_emb_norm.weight"))
            w.add_tensor(name, np.float32(one) + np.float32(0.05) * rng.standard_normal(shape, np.float32))
        else:
            a = rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(np.prod(shape[1:])))
            embedding = name.startswith(("v.patch_embd", "v.position_embd"))
            w.add_tensor(name, a if embedding else a.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
