#!/usr/bin/env bash
# Prepare in .whl/ what scripts/accelerator_check.sh needs on the lent GPU machine, which has no
# network and receives at most 64 MiB: the wheels it installs, and the default model's shape
# (config and tokenizer, no weights: scripts/export_model_shape.py) for its serving comparison.
# The machine's image already holds JAX, flax, aiohttp, orbax, transformers, prometheus-client,
# pytest, tqdm and pyyaml; of jaxserve's runtime dependencies it lacks pydantic (with its own)
# and gguf: wheels for CPython 3.12, x86-64 Linux. Run it here, where pip reaches PyPI and the
# venv holds jaxserve (PYTHON= another interpreter); .whl/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf
${PYTHON:-.venv/bin/python} scripts/export_model_shape.py .whl/smollm2-135m-shape
echo "wheels in .whl/: $(ls .whl | wc -l), $(du -sh .whl | cut -f1)"
