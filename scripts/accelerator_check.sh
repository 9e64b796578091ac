#!/usr/bin/env bash
# One prepared run on a lent accelerator machine (GPU or TPU, JAX preinstalled, no network):
#   installs jaxserve's dependencies from the wheels carried in .whl/ (scripts/fetch_wheels.sh
#   makes them here, where pip reaches PyPI), if any; then the parts named (default: all):
#   kernels     checks the platform's Pallas kernel against the reference on the device, and runs
#               the attention microbenchmark (kernel and reference) on Llama-3-8B heads;
#   throughput  the offline throughput benchmark on a Llama-3-8B-shaped model with random weights
#               (--load-format dummy) in bfloat16, with the kernel and with the reference, then with
#               the kernel and int8 / fp8 weights (weight-only, --quantization), and int8 / fp8 KV
#               pages (--kv-cache-dtype);
#   serving     serving with synchronous against asynchronous scheduling (benchmarks/serving_async.py)
#               on the default model's shape with random weights (.whl/smollm2-135m-shape), in
#               bfloat16, concurrency 8 and 32, two rounds: both servers share the device.
# Results (JSON and logs) go to $OUT if set (the device tool's folder, which returns at most 8
# files: name fewer parts per run), else benchmarks/results/.
#   scripts/accelerator_check.sh [kernels] [throughput] [serving]
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
PARTS=" ${*:-kernels throughput serving} "

if [[ $PARTS == *" kernels "* ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/attention_kernels/test_on_device.py 2>&1 | tee "$RESULTS/accelerator_kernel_check_$KIND.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1

  for backend in pallas reference; do
    python3 benchmarks/kernels.py --backend $backend --output-json "$RESULTS/kernels_${backend}_$KIND.json" || status=1
  done
fi

if [[ $PARTS == *" throughput "* ]]; then
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
fi

if [[ $PARTS == *" serving "* ]]; then
  # Two servers on one device: each process takes 40% of its memory instead of JAX's 75%.
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.4} python3 benchmarks/serving_async.py \
    --concurrency ${SERVING_CONCURRENCY:-8 32} --rounds ${SERVING_ROUNDS:-2} \
    --output-json "$RESULTS/serving_async_smollm2-135m-shape_$KIND.json" \
    -- .whl/smollm2-135m-shape --load-format dummy --dtype ${SERVING_DTYPE:-bfloat16} --max-model-len 1024 \
    2>&1 | tee "$RESULTS/serving_async_smollm2-135m-shape_$KIND.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
