"""What lets one edge hold many streams: its open-files limit (docs/capacity.md)."""

from __future__ import annotations

import resource
import subprocess
import sys

from tests.processes import ROOT


def test_an_edge_raises_its_open_files_limit_to_the_hard_one() -> None:
    """A process started with a soft limit of 256 (systemd's default is 1024) leaves run_edge's helper with the
    hard limit, so that an edge is not capped at a few hundred connections."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = ("import resource; from services.edge.main import raise_open_files_limit; "
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    raised = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert raised.returncode == 0, raised.stderr
    expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert raised.stdout.split() == [str(expected), str(expected)]
