"""Verification tooling for registered gradients (see docs/checking.md)."""
