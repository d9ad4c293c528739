"""Which GGUF a quant names, the default quant, the projector, and the references (hmad.store.select,
refs): pure functions over file lists, no hub."""

from __future__ import annotations

import pytest

from hmad.store.errors import StoreError
from hmad.store.refs import ModelRef, parse_ref
from hmad.store.select import RemoteFile, available, choose, quant_label


def files(*names: str, sizes: dict[str, int] | None = None) -> list[RemoteFile]:
    return [RemoteFile(n, (sizes or {}).get(n, 100)) for n in names]


GEMMA = files(
    "gemma-3-4b-it-Q4_K_M.gguf",
    "gemma-3-4b-it-Q4_K_S.gguf",
    "gemma-3-4b-it-Q8_0.gguf",
    "gemma-3-4b-it-IQ4_XS.gguf",
    "mmproj-model-f32.gguf",
    "mmproj-model-f16.gguf",
    "README.md",
)


def test_parse_ref_forms():
    assert parse_ref("ggml-org/gemma-3-4b-it-GGUF") == ModelRef("ggml-org/gemma-3-4b-it-GGUF", None)
    assert parse_ref("hf:o/r:q8_0") == ModelRef("o/r", "q8_0")
    assert parse_ref("hf.co/o/r:UD-Q4_K_XL") == ModelRef("o/r", "UD-Q4_K_XL")
    for bad in ("gemma", "o/r/x", "/abs/path:Q8_0", "o/model.gguf", "o/r:", "../r"):
        with pytest.raises(StoreError, match="REPO\\[:QUANT\\]"):
            parse_ref(bad)


def test_quant_matched_case_insensitively_and_whole():
    assert choose("o/r", GEMMA, "q8_0").model.name == "gemma-3-4b-it-Q8_0.gguf"
    assert choose("o/r", GEMMA, "Q4_K_M").quant == "Q4_K_M"
    assert choose("o/r", GEMMA, "iq4_xs").model.name == "gemma-3-4b-it-IQ4_XS.gguf"
    with pytest.raises(StoreError) as e:  # Q4_K is a prefix of two quants, the name of none
        choose("o/r", GEMMA, "Q4_K")
    assert "IQ4_XS, Q4_K_M, Q4_K_S, Q8_0" in str(e.value)


def test_default_quant_and_projector():
    c = choose("o/r", GEMMA, None)
    assert (c.quant, c.mmproj.name) == ("Q4_K_M", "mmproj-model-f16.gguf")
    qat = files("gemma-3-4b-it-q4_0.gguf", "mmproj-model-f16-4B.gguf")
    assert choose("o/r", qat, None).model.name == "gemma-3-4b-it-q4_0.gguf"
    sizes = {"m-Q5_K_M.gguf": 50, "m-IQ4_NL.gguf": 80, "m-Q6_K.gguf": 20, "m-Q8_1-x.gguf": 200}
    assert choose("o/r", files(*sizes, sizes=sizes), None).model.name == "m-IQ4_NL.gguf"
    assert choose("o/r", files("only-bf16.gguf"), None).mmproj is None
    with pytest.raises(StoreError, match="none is a default quant: pick one of BF16, F16"):
        choose("o/r", files("m-F16.gguf", "m-BF16.gguf"), None)


def test_refusals():
    with pytest.raises(StoreError, match="has no GGUF"):
        choose("o/r", files("model.safetensors", "mmproj-f16.gguf"), None)
    split = files("m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf")
    assert available(split) == ["Q4_K_M"]
    with pytest.raises(StoreError, match="split in 2 files"):
        choose("o/r", split, "Q4_K_M")


def test_quant_labels():
    assert quant_label("Qwen3-VL-8B-Instruct-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert quant_label("gemma-3-270m-it-bf16.gguf") == "bf16"
    assert quant_label("tinyllama-1.1b-chat-v1.0.Q4_0.gguf") == "Q4_0"
    assert quant_label("weird.gguf") == "weird"
