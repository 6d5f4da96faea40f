"""Decides: which waiting request runs next."""
