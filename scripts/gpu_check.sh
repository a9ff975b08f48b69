#!/usr/bin/env bash
# The GPU checks: run on a machine with CUDA (about 3 minutes on one GPU), after the set-up of
# the README. Prints each result; docs/runtime.md ("On a GPU") records the last run's.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
# the B/W split, recompute and a one-GPU NCCL training run, against autograd on the same device
python -m pytest -q -p no:randomly tests/test_devices.py
# with two or more GPUs: the exactness of every schedule over NCCL, one GPU per rank
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    python -m cutpipe train --model examples/models/tiny-dense.yaml --schedule dualpipev \
        --nproc 2 --backend nccl --steps 50 --quiet
fi
# what the B/W split costs on real transformer layers, B + W against one full backward
python benchmarks/bw_split.py --device cuda --reps 20
