"""The Redis that `tokenbus run` and the tests start for themselves: one that never answers is an error in time
and is stopped, never a process left behind (a busy machine's slow PING is waited for, not raised)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.supervisor import REDIS_ARGS, _wait_for_redis, free_port


def test_a_redis_server_that_never_answers_is_stopped_with_a_clear_error(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", *REDIS_ARGS,
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        _wait_for_redis(f"redis://127.0.0.1:{port}", server)
        os.kill(server.pid, signal.SIGSTOP)  # it accepts connections (the kernel does) and answers nothing
        started = time.monotonic()
        with pytest.raises(SystemExit, match="did not start"):
            _wait_for_redis(f"redis://127.0.0.1:{port}", server, {"socket_timeout": 0.2}, timeout_s=1)
        assert time.monotonic() - started < 5
        assert server.poll() is not None, "the server that never answered is still running"
    finally:
        server.kill()
        server.wait(timeout=10)
