"""hmad: a resident Gemma 3 inference daemon (numpy reference, Vulkan GPU, XRT NPU backends)."""

__version__ = "0.1.0"
