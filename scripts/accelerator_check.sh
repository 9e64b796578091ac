#!/usr/bin/env bash
# One prepared run on a lent accelerator machine (GPU or TPU, JAX preinstalled, no network):
#   1. installs jaxserve's dependencies from the wheels carried in .whl/ (scripts/fetch_wheels.sh
#      makes them here, where pip reaches PyPI), if any;
#   2. checks the platform's Pallas kernel against the reference on the device;
#   3. runs the attention microbenchmark (kernel and reference) on Llama-3-8B heads;
#   4. runs the offline throughput benchmark on a Llama-3-8B-shaped model with random weights
#      (--load-format dummy) in bfloat16, with the kernel and with the reference, then with the
#      kernel and int8 / fp8 weights (weight-only, --quantization), and int8 / fp8 KV pages
#      (--kv-cache-dtype).
# Results (JSON and logs) go to $OUT if set (the device tool's folder), else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
KIND=$(python3 -c "import jax; d = jax.devices()[0]; print(d.platform + '_' + d.device_kind.replace(' ', '_'))") || exit 1
echo "device: $KIND"
status=0

python3 -m pytest -q -p no:cacheprovider tests/attention_kernels/test_on_device.py 2>&1 | tee "$RESULTS/accelerator_kernel_check_$KIND.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

for backend in pallas reference; do
  python3 benchmarks/kernels.py --backend $backend --output-json "$RESULTS/kernels_${backend}_$KIND.json" || status=1
done

# 64 prompts x 512 tokens in, 128 out; the reference backend is the baseline of the same run.
for backend in pallas reference; do
  python3 benchmarks/throughput.py --model configs/llama3-8b-shape --load-format dummy --dtype bfloat16 \
    --skip-tokenizer-init --no-hf-baseline --attention-backend $backend --max-model-len 2048 \
    --num-prompts 64 --input-len 512 --output-len 128 \
    --output-json "$RESULTS/throughput_llama3-8b-shape_${backend}_$KIND.json" || status=1
done
# The same load with quantized weights; the bfloat16 pallas run above is the baseline.
for quantization in int8 fp8; do
  python3 benchmarks/throughput.py --model configs/llama3-8b-shape --load-format dummy --dtype bfloat16 \
    --skip-tokenizer-init --no-hf-baseline --attention-backend pallas --max-model-len 2048 \
    --num-prompts 64 --input-len 512 --output-len 128 --quantization $quantization \
    --output-json "$RESULTS/throughput_llama3-8b-shape_pallas_${quantization}_$KIND.json" || status=1
done
# And with quantized KV pages (twice bfloat16's tokens in the same memory).
for kv in int8 fp8; do
  python3 benchmarks/throughput.py --model configs/llama3-8b-shape --load-format dummy --dtype bfloat16 \
    --skip-tokenizer-init --no-hf-baseline --attention-backend pallas --max-model-len 2048 \
    --num-prompts 64 --input-len 512 --output-len 128 --kv-cache-dtype $kv \
    --output-json "$RESULTS/throughput_llama3-8b-shape_pallas_kv-${kv}_$KIND.json" || status=1
done
exit $status
