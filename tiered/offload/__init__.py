"""Keeps KV: the device tier and the LMCache host tier."""
