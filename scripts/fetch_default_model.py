"""Fetch the default model (SmolLM2-135M-Instruct, GGUF Q4_1) into the cache and print its path.

Where it sits: a set-up step run once per machine (or by CI) before serving or the slow tests;
``jaxserve.loader.default_model`` does the work, this only reports it. Exit status 1 with a
one-line message when the download or a hash check fails.
"""

from __future__ import annotations

import sys

from jaxserve.loader.default_model import default_model_path


def main() -> int:
    try:
        print(default_model_path())
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
