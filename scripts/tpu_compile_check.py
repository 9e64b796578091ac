"""Check a model and serving flags against a TPU slice before renting one: every step program the
server would compile there, compiled by libtpu on this host, checked to fit the chip's memory, with
a roofline projection. The same as `jaxserve tpu-compile-check`; needs `pip install -e '.[tpu]'`.

    python scripts/tpu_compile_check.py [--model PATH] --topology v6e-1 [--tensor-parallel-size N]
        [any serve flag] [--programs all|default|plain|quick] [--json OUT]

Exit 0 when every program compiled and fits; otherwise one line per failure and exit 1.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs on a device; libtpu only compiles
    from jaxserve.cli import main

    sys.exit(main(["tpu-compile-check", *sys.argv[1:]]))
