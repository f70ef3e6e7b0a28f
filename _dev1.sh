source _dev_env.sh
set -x
nvidia-smi --query-gpu=name,memory.used --format=csv
[ -f /tmp/m/config.json ] || python3 -c "import sys,torch; sys.path.insert(0,'benchmarks'); import _gpu_model as gm; from pathlib import Path; gm.write_checkpoint(Path('/tmp/m'), gm.flash_config(4, 64), 0, torch.device('cuda'), torch.bfloat16)" 2>&1 | tail -3
timeout 420 python3 benchmarks/speculative.py --model /tmp/m --backend cuda_sm100 --keep-quantized on --drafter ngram --batch-sizes 1,16,64 --repeats 3 --max-tokens 128 --requests-per-slot 2 --out $OUT/spec_ngram.json 2>&1 | grep -v Warning | tail -25
