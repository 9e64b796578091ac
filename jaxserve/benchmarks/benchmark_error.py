"""The one exception the serving benchmark stops on.

Where it sits: raised anywhere along the flow (reading the flags, loading the tokenizer, listing
the server's models, writing the result or the plot) and caught only by ``serving.main``, which
prints it as one line and exits with its code. A failed request is not one of these: it is a
result to report, and the run goes on.
"""

from __future__ import annotations


class BenchmarkError(Exception):
    """A one-line reason to stop. exit_code 2: bad arguments; 1: the server cannot be benchmarked."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
