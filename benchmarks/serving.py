"""Online serving benchmark against a running OpenAI-compatible server, after vLLM's
benchmark_serving.py (the same flags, report and result JSON); see jaxserve/benchmarks/serving.py.

    jaxserve serve &   # or any OpenAI-compatible server
    python benchmarks/serving.py --backend openai --num-prompts 200 --request-rate 1 4 16 inf \
        --random-input-len 256 --random-output-len 64 --save-result --plot sweep.png
"""

from __future__ import annotations

import argparse
import sys

from jaxserve.benchmarks.serving import add_cli_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="benchmarks/serving.py",
        description="Serving benchmark: TTFT, TPOT, ITL and throughput of an OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
