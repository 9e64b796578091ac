#!/usr/bin/env bash
# Download, into .whl/, the wheels scripts/accelerator_check.sh installs on an accelerator
# machine that has JAX but no network: jaxserve's runtime dependencies (and pytest) with
# theirs, for CPython 3.12 on x86-64 Linux, less JAX, numpy and CUDA libraries, which that
# machine has. Run it here, where pip reaches PyPI; .whl/ is git-ignored. The device tool
# carries at most 64 MiB: the script prints the total.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl flax orbax-checkpoint transformers tokenizers safetensors gguf aiohttp pydantic \
  prometheus_client jinja2 pyyaml tqdm pytest
rm -f .whl/jax-* .whl/jaxlib-* .whl/jax_* .whl/numpy-* .whl/nvidia_* .whl/torch-*
echo "wheels in .whl/: $(ls .whl | wc -l), $(du -sh .whl | cut -f1)"
