"""Talks: the OpenAI-compatible HTTP API process."""
