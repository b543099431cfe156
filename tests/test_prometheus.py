"""The monitoring as an operator runs it: a real Prometheus (Debian's package) scrapes a stack of real
processes on loopback (two edges with keys, a `--engine sim` worker, a redis-server) with the project's
rules loaded, while clients stream, send a bad request and run into a rate limit. Then every recording rule
and every dashboard expression returns data, every alerting rule evaluates without error over series that
exist, and the edge's and the worker's metrics stay apart, with no `_created` series. Each process's metrics
are on a port of its own, never the API's."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from services.supervisor import free_port
from tests.stack import Stack
from tests.test_faults import stream_text
from tests.test_tenancy import bearer, chat, create_key

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tokenbus.json"

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is installed by make test")


def start_prometheus(root: Path, edges: list[str], workers: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "tokenbus-edge", "static_configs": [{"targets": edges}]},
            {"job_name": "tokenbus-worker", "static_configs": [{"targets": workers}]},
        ],
    }
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    with (root / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}"


def host_port(url: str) -> str:
    return url.removeprefix("http://").split("/")[0]


async def query(http: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    answer = (await http.get("/api/v1/query", params={"query": expr})).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


async def test_prometheus_scrapes_the_stack_and_every_rule_and_panel_has_data(stack: Stack, tmp_path: Path) -> None:
    edges = [stack.edge(auth="keys"), stack.edge(auth="keys")]
    worker = stack.worker()
    free, limited = create_key(stack, "--tenant", "free"), create_key(stack, "--tenant", "tight", "--rpm", "2")
    prometheus, url = start_prometheus(tmp_path, [host_port(e.metrics_url) for e in edges],
                                       [host_port(worker.metrics_url)])
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            deadline = time.monotonic() + 30
            while not await scraping(http, 3):
                assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
                await asyncio.sleep(0.5)
            await drive(stack, [e.url for e in edges], free, limited)
            await asyncio.sleep(4)  # a few scrapes and rule evaluations after the load
            await check_everything(http)
            # the metrics name tenants: the API's port, which clients reach, does not serve them
            assert (await http.get(edges[0].url + "/metrics")).status_code == 404
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=20)


async def scraping(http: httpx.AsyncClient, targets: int) -> bool:
    try:
        return len(await query(http, "up == 1")) == targets
    except (httpx.HTTPError, ValueError):  # not listening, or not ready (a plain-text 503), yet
        return False


async def drive(stack: Stack, edges: list[str], free: dict[str, Any], limited: dict[str, Any]) -> None:
    """Streams through both edges for a few seconds, one bad request, and a tenant past its rate limit."""
    key = free["key"]
    for _round in range(4):
        results = await asyncio.gather(*(stream_text(url, stack.model, 30, extra_headers={"Authorization":
                                                                                          f"Bearer {key}"})
                                         for url in edges for _ in range(4)))
        assert all(usage == 30 for _text, usage in results)
        await asyncio.sleep(1)
    async with httpx.AsyncClient(timeout=10) as http:
        bad = await http.post(edges[0] + "/v1/chat/completions", json={"model": stack.model}, headers=bearer(free))
        assert bad.status_code == 400
        codes = [(await http.post(edges[1] + "/v1/chat/completions", json=chat(stack.model),
                                  headers=bearer(limited))).status_code for _ in range(4)]
        assert 429 in codes


async def check_everything(http: httpx.AsyncClient) -> None:
    groups = (await http.get("/api/v1/rules")).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    for rule in rules:
        assert rule["health"] == "ok", rule
        if rule["type"] == "recording":
            assert await query(http, rule["query"]), f"no data for recording rule {rule['name']}"
        else:  # an alert that does not fire has no result: the series it reads must exist
            for name in set(re.findall(r"[a-z_:]*tokenbus_[a-z0-9_:]+|\bup\b", rule["query"])):
                assert await query(http, name), f"alert {rule['name']} reads {name}, which has no data"
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert await query(http, target["expr"]), f"panel {panel['title']!r}: no data for {target['expr']}"
    edge_names = {s["metric"]["__name__"] for s in await query(http, '{job="tokenbus-edge"}')}
    worker_names = {s["metric"]["__name__"] for s in await query(http, '{job="tokenbus-worker"}')}
    assert not any(name.startswith("tokenbus_worker_") for name in edge_names)
    assert not any(name.startswith("tokenbus_edge_") for name in worker_names)
    assert not any(name.endswith("_created") for name in edge_names | worker_names)
