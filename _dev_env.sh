python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/plugins/cuda_sm100:$PWD/plugins/samplers
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile -e plugins/cuda_sm100 >/dev/null 2>&1 || echo "cuda plugin install failed"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
