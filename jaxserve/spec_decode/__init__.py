"""Speculative decoding: draft-token proposers that run on the host."""
