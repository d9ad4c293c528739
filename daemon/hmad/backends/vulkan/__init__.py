"""Vulkan compute backend. ``backend.py`` is the facade; docs/architecture.md maps the other modules (device,
memory plan, kernel registry and variants, command recorder, op modules). The forward pass is recorded once
per batch-size bucket and replayed."""
