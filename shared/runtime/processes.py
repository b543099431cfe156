"""The one way tokenbus starts and stops its own processes (`tokenbus run`'s children, the benchmarks' stacks, the
tests' edges and workers): `python -m services.cli <role>` with its settings as TOKENBUS_ variables, stopped with
SIGTERM and, past a deadline, SIGKILL of its whole process group (a worker's engine runs in processes of its own)."""

from __future__ import annotations

import os
import signal
import subprocess  # nosec B404: runs our own programs, never a shell
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path

from shared.runtime.settings import ENV_PREFIX

STOP_TIMEOUT_S = 30.0
"""How long a stopping process gets to drain before it is killed."""


def settings_env(settings: Mapping[str, object], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment by default) with each setting as its TOKENBUS_ variable."""
    env = dict(os.environ if base is None else base)
    env.update({ENV_PREFIX + name.upper(): str(value) for name, value in settings.items()})
    return env


def spawn(role: str, env: Mapping[str, str], log: Path | None = None, own_session: bool = True,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """`tokenbus <role>` (see `launch`)."""
    return launch([sys.executable, "-m", "services.cli", role], env, log, own_session, cwd)


def launch(command: list[str], env: Mapping[str, str], log: Path | None = None, own_session: bool = True,
           cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """A program of ours with this environment, its output appended to `log` (else this process's). In a session
    of its own (`own_session`), its process group, engine included, can be killed at once; `tokenbus run` keeps
    its children in its own, so that a terminal's Ctrl-C reaches them too."""
    if log is None:
        return subprocess.Popen(command, env=dict(env), cwd=cwd, start_new_session=own_session)  # nosec B603: our own argv, no shell
    with log.open("ab") as out:
        return subprocess.Popen(command, env=dict(env), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,  # nosec B603: our own argv, no shell
                                start_new_session=own_session)


def stop(*processes: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to each at once, then a wait within one deadline for all; one still running is killed, with its
    process group where it leads one. A group's stragglers (engine processes) are killed either way."""
    leaders = {process.pid for process in processes if _leads_group(process)}
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        if process.pid in leaders:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        elif process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def _leads_group(process: subprocess.Popen[bytes]) -> bool:
    """Whether it leads a process group (started in a session of its own); a process already reaped is taken to
    have led one, so that what it left behind goes too (a group that is gone is no error)."""
    try:
        return os.getpgid(process.pid) == process.pid
    except ProcessLookupError:
        return process.returncode is not None
