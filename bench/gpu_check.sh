#!/usr/bin/env bash
# The GPU checks of issue 12 in one run on an offline GPU machine (../shared/device/README.md):
#   prepare here:  ../shared/device/prepare-wheels.sh .whl && mkdir -p .gpu && cp -r ../shared/models/stories260k .gpu/
#                  (and /.gpu/ in .git/info/exclude)
#   then: device run  command="bash bench/gpu_check.sh triton"  carry=[".whl", ".gpu"]  timeout_s=300
#   and:  device run  command="bash bench/gpu_check.sh ring"  carry=[".whl", ".gpu"]  timeout_s=600
#   (no argument runs both parts: up to about 13 minutes, more than one command may run)
# Writes under $OUT: env.txt; triton part (issue 26): pytest-triton.log (tests/kernels/test_triton.py's
# gpu tests: the triton kernels' bits on CUDA, every family's block proven in the triton mode),
# triton_kernels.json (bench/triton_kernels.py: triton vs cuBLAS and SDPA times, rows_match); ring
# part: pytest-gpu.log (the other gpu tests), gpu_ring.json (bench/gpu_ring.py), stories.json
# (stories260k 3-stage ring on the GPU vs CPU stages on the same machine). Each step has its own
# time limit so a slow one cannot eat the others.
set -uo pipefail
OUT=${OUT:-/tmp/out}
PART=${1:-all}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, 'triton', triton.__version__)"; } \
  > "$OUT/env.txt" 2>&1
if [ "$PART" = all ] || [ "$PART" = triton ]; then
  unset TRITON_INTERPRET  # compiled kernels on the GPU, not the interpreter
  timeout 180 python3 -m pytest -q -m gpu tests/kernels/test_triton.py 2>&1 | tee "$OUT/pytest-triton.log" | tail -5
  timeout 100 python3 bench/triton_kernels.py --out "$OUT/triton_kernels.json" 2> "$OUT/triton_kernels.err" \
    | tail -c 1500
fi
[ "$PART" = all ] || [ "$PART" = ring ] || exit 0
timeout 120 python3 -m pytest -q -m gpu tests --ignore=tests/kernels/test_triton.py 2>&1 | tee "$OUT/pytest-gpu.log" \
  | tail -5
timeout 330 python3 bench/gpu_ring.py --tokens 96 --prompts 8 --spec-tokens 40 --rounds 2 --out "$OUT/gpu_ring.json" \
  2> "$OUT/gpu_ring.err" | tail -1
stories() {  # $1: label; runs swarm demo on stories260k with 3 stages, prints tokens_per_s
  timeout 60 python3 -m swarm demo --model .gpu/stories260k --stages 3 --no-chat --max-new-tokens 96 \
    --prompt "Once upon a time" --json --no-receipt 2>/dev/null | tail -1 |
    python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({'$1': d['tokens_per_s'], '${1}_ids': d['output_ids']}))"
}
{ stories gpu; CUDA_VISIBLE_DEVICES= stories cpu; } > "$OUT/stories.json" 2>&1
cat "$OUT/stories.json"
