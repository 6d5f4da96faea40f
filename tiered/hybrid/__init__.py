"""Computes: the model and its forward modes (hybrid prefilling)."""
