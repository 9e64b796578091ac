"""The OpenAI-compatible HTTP server (being written)."""

from __future__ import annotations


def run_server(engine_args, server_args) -> int:
    """Build the engine, serve until SIGINT/SIGTERM, return the exit code."""
    raise NotImplementedError
