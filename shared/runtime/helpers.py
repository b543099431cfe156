"""Helper processes that answer a line for each line, within a bound: the work a request brings that may cost without
bound and holds the GIL (the edge's schema and pattern checks, the worker's grammar compiles), kept off the event
loop and stopped when it costs too much.

A `Helpers` pool starts its processes on first use (`python -m <module> <progress fd> [args]`, niced, with
`greeting` written first). Each answers one line at a time. A line may take `cpu_s` of CPU time (over all the
process's threads; the kernel ends the process past it, RLIMIT_CPU, in whole seconds), so that what a line costs
decides, not how busy the host is; the wall-time deadline then only bounds the wait (Busy: the host gave the process
too little CPU). Without `cpu_s` the deadline alone decides. Past either, or when it ended, the process is replaced
before its turn is given back (the request that took too long waits for that, not the next one). Tenants take turns:
at most one line of each tenant waits for a process, in arrival order, so a tenant's flood of slow lines holds
another's back by one line at most with one process, and not at all with two. A process may show how far it got
(`Progress.mark`), read only when it took too long."""

from __future__ import annotations

import asyncio
import contextlib
import math
import mmap
import os
import resource
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

NICENESS = 10
"""A helper yields the CPU to the event loops and the engine when both want it."""
ROOT = str(Path(__file__).resolve().parents[2])
"""Where the `services` and `shared` packages are (installed or not): a helper imports its module from there."""
READY = b"ready\n"
ENDING_S = 1.0
"""How long a process whose output closed is given to end by itself before it is killed."""
CPU_ENV = "TOKENBUS_HELPER_CPU_S"
"""How a process learns the CPU time each line may take (see Helpers)."""


class HelperError(Exception):
    """A line a helper did not answer: `progress` is what it marked last (0 if nothing)."""

    def __init__(self, progress: int) -> None:
        super().__init__(progress)
        self.progress = progress


class TookTooLong(HelperError):
    """The line cost the helper more than its CPU time (or, without one, the deadline); it was replaced."""


class Busy(HelperError):
    """The helper did not answer within the deadline while still within its CPU time: the host gave it too little
    CPU, whatever the line costs; it was replaced."""


class Ended(HelperError):
    """The helper ended (killed, out of memory) before it answered; it was replaced."""


class NotStarted(Exception):
    """No helper could be started."""


@dataclass
class _Line:
    """A tenant's lines waiting for a helper, one at a time."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@dataclass(frozen=True)
class _Process:
    process: asyncio.subprocess.Process
    at: mmap.mmap
    """Shared with the process: what it marked last (see Progress)."""

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    @property
    def progress(self) -> int:
        return int.from_bytes(self.at[:4], "little")


@dataclass
class _Slot:
    running: _Process | None = None


class Helpers:
    """`size` processes of `module`, shared by the tenants in turns (see the module's docstring)."""

    def __init__(self, module: str, *, deadline_s: float, start_timeout_s: float, size: int = 1,
                 args: Sequence[str] = (), greeting: bytes = b"", read_limit: int = 1 << 16,
                 env: Mapping[str, str] | None = None, cpu_s: float = 0.0) -> None:
        self.module = module
        self.deadline_s = deadline_s
        self.cpu_s = cpu_s
        self.start_timeout_s = start_timeout_s
        self.args = list(args)
        self.greeting = greeting
        self.read_limit = read_limit
        self.env = dict(env or {})
        self._slots = [_Slot() for _ in range(size)]
        self._idle: asyncio.Queue[_Slot] = asyncio.Queue()
        for slot in self._slots:
            self._idle.put_nowait(slot)
        self._lines: dict[str, _Line] = {}

    async def ask(self, line: bytes, tenant: str) -> bytes:
        """The answer to one line (without its newline), in the tenant's turn; TookTooLong or Ended if none came,
        NotStarted if no process could start."""
        async with self._turn(tenant) as slot:
            running = await self._started(slot)
            return await self._exchange(slot, running, line)

    async def start(self) -> None:
        """Starts every process now rather than on first use."""
        await asyncio.gather(*(self._started(slot) for slot in self._slots))

    @contextlib.asynccontextmanager
    async def _turn(self, tenant: str) -> AsyncIterator[_Slot]:
        line = self._lines.setdefault(tenant, _Line())
        line.users += 1
        try:
            async with line.lock:
                slot = await self._idle.get()
                try:
                    yield slot
                finally:
                    self._idle.put_nowait(slot)
        finally:
            line.users -= 1
            if not line.users:
                del self._lines[tenant]

    async def _exchange(self, slot: _Slot, running: _Process, line: bytes) -> bytes:
        stdin, stdout = running.process.stdin, running.process.stdout
        assert stdin is not None and stdout is not None  # nosec B101: an invariant (tokenbus never runs with -O)
        running.at[:4] = bytes(4)
        answer = b""
        failure: type[HelperError] = Ended
        try:
            stdin.write(line + b"\n")
            async with asyncio.timeout(self.deadline_s):
                await stdin.drain()
                answer = await stdout.readline()
        except TimeoutError:
            failure = Busy if self.cpu_s else TookTooLong
        except ConnectionError:  # it is gone
            pass
        finally:
            if not answer:
                progress = running.progress
                await self._replace(slot, ENDING_S if failure is Ended else 0.0)
        if not answer:
            if failure is Ended and running.process.returncode == -signal.SIGXCPU:
                failure = TookTooLong
            raise failure(progress)
        return answer.rstrip(b"\n")

    async def _replace(self, slot: _Slot, ending_s: float = 0.0) -> None:
        """Ends the slot's process (after `ending_s` for it to end by itself) and starts the next one now (if it
        cannot, the next turn tries again)."""
        running, slot.running = slot.running, None
        if running is not None:
            await _ended(running.process, ending_s)
        with contextlib.suppress(NotStarted):
            await self._started(slot)

    async def _started(self, slot: _Slot) -> _Process:
        if slot.running is not None and slot.running.alive:
            return slot.running
        env = dict(os.environ, **self.env, **{CPU_ENV: f"{self.cpu_s:g}"},
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        with tempfile.TemporaryFile() as shared:  # unnamed; the two mappings keep it
            shared.truncate(4)
            at = mmap.mmap(shared.fileno(), 4)
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module, str(shared.fileno()), *self.args,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                env=env, limit=self.read_limit, pass_fds=(shared.fileno(),))
        with contextlib.suppress(OSError):  # it has gone already
            os.setpriority(os.PRIO_PROCESS, process.pid, NICENESS)
        assert process.stdin is not None and process.stdout is not None  # nosec B101: an invariant
        ready = b""
        try:
            async with asyncio.timeout(self.start_timeout_s):
                if self.greeting:
                    process.stdin.write(self.greeting)
                    await process.stdin.drain()
                ready = await process.stdout.readline()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            if ready != READY:  # it failed, or the request was cancelled while it started
                await _ended(process)
        if ready != READY:
            raise NotStarted(self.module)
        slot.running = _Process(process, at)
        return slot.running

    async def close(self) -> None:
        for slot in self._slots:
            running, slot.running = slot.running, None
            if running is None or not running.alive:
                continue
            assert running.process.stdin is not None  # nosec B101: an invariant (tokenbus never runs with -O)
            running.process.stdin.close()  # it exits at the end of its input
            try:
                async with asyncio.timeout(2):
                    await running.process.wait()
            except TimeoutError:
                await _ended(running.process)


async def _ended(process: asyncio.subprocess.Process, ending_s: float = 0.0) -> None:
    """Kills the process, unless it ends by itself within `ending_s`: killing one that has just ended would reap it
    before asyncio does (Popen.send_signal polls first), and lose how it ended."""
    if ending_s:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ending_s):
                await process.wait()
    with contextlib.suppress(ProcessLookupError):  # it may have exited already
        process.kill()
    await process.wait()


class Progress:
    """A helper's side of the shared mark: what it is working on, for the pool to read if it takes too long."""

    def __init__(self, fd: int) -> None:
        self._at = mmap.mmap(fd, 4)

    def mark(self, index: int) -> None:
        self._at[:4] = index.to_bytes(4, "little")


def _limit_cpu(seconds: float) -> None:
    """The next line may take `seconds` of CPU time from now (rounded up to whole seconds); past them the kernel
    ends the process (SIGXCPU, whose default action ends it; no core file: RLIMIT_CORE is 0)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    limit = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    resource.setrlimit(resource.RLIMIT_CPU, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def serve(answer: Callable[[bytes, Progress], bytes]) -> None:
    """A helper's main loop (after whatever greeting it reads from stdin): ready, then one answer line for each
    line in, each within the pool's CPU time, until its input ends."""
    progress = Progress(int(sys.argv[1]))
    cpu_s = float(os.environ.get(CPU_ENV) or 0)
    if cpu_s:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)
    out = sys.stdout.buffer
    out.write(READY)
    out.flush()
    for line in sys.stdin.buffer:
        if cpu_s:
            _limit_cpu(cpu_s)
        out.write(answer(line, progress) + b"\n")
        out.flush()
