G=/root/gpu
export PYTHONPATH=$G/root/site:$PWD PATH=$G/root/redis/bin:$G/root/site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENBUS_CACHE_DIR=$G/cache PYTHONUNBUFFERED=1
# the bench sends no constraints; the grammar gate's helpers (xgrammar 0.2.3 there, untried) are left out so that
# nothing new can stop the worker from starting in the few device minutes a task has
export TOKENBUS_GRAMMAR_COMPILE_S=0
