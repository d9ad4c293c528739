"""Vulkan compute backend: device (device.py), memory plan and upload (memory.py), pipelines and recorded
command buffers (pipelines.py). The forward pass will be recorded once per batch-size bucket and replayed."""
