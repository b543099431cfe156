G=/root/gpu
export PYTHONPATH=$G/root/site:$PWD PATH=$G/root/redis/bin:$G/root/site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENBUS_CACHE_DIR=$G/cache PYTHONUNBUFFERED=1
