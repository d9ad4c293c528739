"""Compute backends behind the op interface of backends/base.py."""
