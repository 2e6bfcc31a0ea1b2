#!/usr/bin/env bash
# The GPU checks of issue 12 in one run on an offline GPU machine (../shared/device/README.md):
#   prepare here:  ../shared/device/prepare-wheels.sh .whl && mkdir -p .gpu && cp -r ../shared/models/stories260k .gpu/
#                  (and /.gpu/ in .git/info/exclude)
#   then: device run  command="bash bench/gpu_check.sh"  carry=[".whl", ".gpu"]  timeout_s=600
# Writes under $OUT: pytest-gpu.log, gpu_ring.json (bench/gpu_ring.py), stories.json (stories260k
# 3-stage ring on the GPU vs CPU stages on the same machine), env.txt. Each step has its own time
# limit so a slow one cannot eat the others.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"; } \
  > "$OUT/env.txt" 2>&1
timeout 120 python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/pytest-gpu.log" | tail -5
timeout 330 python3 bench/gpu_ring.py --tokens 96 --prompts 8 --spec-tokens 40 --rounds 2 --out "$OUT/gpu_ring.json" \
  2> "$OUT/gpu_ring.err" | tail -1
stories() {  # $1: label; runs swarm demo on stories260k with 3 stages, prints tokens_per_s
  timeout 60 python3 -m swarm demo --model .gpu/stories260k --stages 3 --no-chat --max-new-tokens 96 \
    --prompt "Once upon a time" --json --no-receipt 2>/dev/null | tail -1 |
    python3 -c "import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({'$1': d['tokens_per_s'], '${1}_ids': d['output_ids']}))"
}
{ stories gpu; CUDA_VISIBLE_DEVICES= stories cpu; } > "$OUT/stories.json" 2>&1
cat "$OUT/stories.json"
