"""The `tokenbus` command: `run` (everything), `edge` and `worker`; `keys`, `adapters` and `usage` for operators."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shared.runtime import logs
from shared.runtime import settings as settings_module

REDIS_SETTINGS = ["redis_url", "redis_cluster", "redis_username", "redis_password_file", "redis_tls_ca_file",
                  "redis_tls_cert_file", "redis_tls_key_file"]
"""How a process reaches Redis and logs in (services.admin takes the same flags)."""
EDGE_SETTINGS = [*REDIS_SETTINGS, "model", "host", "port", "request_timeout_s", "response_ttl_s", "storage_bytes",
                 "storage_items", "redis_pool_size", "max_tenant_calls_in_flight",
                 "max_body_bytes", "max_stop_sequences", "keepalive_interval_s", "log_level", "log_format",
                 "resume_window_s",
                 "replay_ttl_s", "background_ttl_s",
                 "shutdown_grace_s", "redis_down_after_s", "max_buffered_events", "max_tenant_behind_bytes",
                 "heartbeat_interval_s",
                 "heartbeat_ttl_s", "read_timeout_s", "ready_models", "auth", "key_cache_s", "lease_ttl_s",
                 "admission_when_redis_down", "metrics_max_tenants", "scheduler", "max_queued_jobs",
                 "max_queued_per_tenant", "max_queued_bytes_per_tenant", "queue_timeout_s", "fair_input_weight",
                 "fair_output_weight", "metrics_port", "metrics_host", "write_stall_s", "dispatch", "affinity_wait_ms",
                 "prompt_cache",
                 "batch_window", "batch_max_open", "batch_lease_ttl_s", "event_loop"]
WORKER_SETTINGS = [*REDIS_SETTINGS, "model", "model_dir", "task", "enable_lora", "lora", "max_loras", "max_lora_rank",
                   "engine", "sim_ttft_ms", "sim_itl_ms",
                   "sim_prefill_us_per_token",
                   "max_model_len", "max_num_seqs", "stream_interval", "kv_cache_gib", "redis_pool_size",
                   "dtype", "gpu_memory_utilization", "enforce_eager", "heartbeat_interval_s", "heartbeat_ttl_s",
                   "metrics_port", "metrics_host", "host", "log_level", "log_format", "resume_window_s", "replay_ttl_s",
                   "replay_max_events",
                   "max_reclaims", "worker_grace_s", "metrics_max_tenants", "scheduler", "queue_timeout_s",
                   "fair_input_weight", "fair_output_weight", "fair_headroom", "tool_parser", "reasoning_parser",
                   "grammar_compile_s", "prefix_summary_size", "sim_prefix_cache_blocks", "sim_dies_after_tokens",
                   "dispatch", "event_loop"]
RUN_SETTINGS = list(dict.fromkeys(EDGE_SETTINGS + WORKER_SETTINGS + ["embedding_model", "embedding_model_dir"]))


def _asked_for(argv: list[str] | None, command: str) -> bool:
    """Whether the command line names `command` (None: any command may be asked for)."""
    return argv is None or command in argv


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; given the words it will parse (`argv`), one that imports only what they need."""
    top = argparse.ArgumentParser(prog="tokenbus", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    for name, names, help_text in (
        ("run", RUN_SETTINGS, "serve with a private Redis (unless --redis-url), one worker and one edge"),
        ("edge", EDGE_SETTINGS, "run one HTTP edge process"),
        ("worker", WORKER_SETTINGS, "run one engine worker process"),
    ):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        settings_module.add_arguments(sub, names)
    bench = commands.add_parser("bench", help="benchmarks: load any server, compare with vllm serve")
    if _asked_for(argv, "bench"):  # its tools (httpx, ...) are not in the edge's image: only `bench` needs them
        from services.bench.cli import add_arguments as bench_arguments

        bench_arguments(bench)
    from services.admin import add_arguments as admin_arguments

    admin_arguments(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser(argv).parse_args(argv)
    if args.command == "bench":
        from services.bench.cli import run as run_bench

        logging.basicConfig(level="WARNING")
        return run_bench(args)
    if args.command in ("keys", "adapters", "usage"):
        from services.admin import run as run_admin

        return run_admin(args)
    if args.command == "run" and args.auth is None:  # the README's first curl works without a key
        args.auth = os.environ.get(settings_module.ENV_PREFIX + "AUTH", "none")
    settings = settings_module.load(args)
    logs.configure(args.command, settings.log_level, settings.log_format)
    if args.command == "edge":
        from services.edge.main import run_edge

        run_edge(settings)
    elif args.command == "worker":
        from services.worker.main import run_worker

        run_worker(settings)
    else:
        from services import supervisor

        return supervisor.run(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
