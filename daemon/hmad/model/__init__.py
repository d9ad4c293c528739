"""Model files (GGUF, safetensors), tokenizers, chat format and architectures."""
