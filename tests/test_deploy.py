"""The deployment files, checked offline (no Docker engine, no cluster runs here): the compose file against
the Compose Specification's schema and what production needs of it, the Prometheus rules with promtool
(including their unit tests), the dashboard's expressions, the Kubernetes manifests against their schemas and
how their pods are hardened; checkov over the rendered manifests, the Dockerfiles and the compose file, and
bandit over the code (each finding left is skipped where it is, with its reason)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.supervisor import REDIS_ARGS
from shared.runtime.settings import Settings
from tests.processes import ROOT

COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tokenbus.json"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """promtool comes with Debian's prometheus package, which deploy/install.sh installs."""
    assert shutil.which("promtool"), "promtool is missing: run `bash deploy/install.sh dev`"
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def test_the_compose_file_follows_the_compose_specification() -> None:
    checked = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                              str(COMPOSE)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_redis_tokenbus_starts_runs_as_the_manifests_say(redis_client: redis.Redis) -> None:
    """`tokenbus run`, the tests and the benchmarks run the Redis the compose file and k8s run."""
    config = redis_client.config_get("*")
    flags = dict(zip(REDIS_ARGS[::2], REDIS_ARGS[1::2], strict=True))
    assert {name: config[name.removeprefix("--")] for name in flags} == flags


def test_the_compose_stack_is_ready_for_production() -> None:
    services = compose()["services"]
    assert services["redis"]["command"] == ["redis-server", *REDIS_ARGS]  # durable, and run as the tests run it
    assert services["edge"]["deploy"]["replicas"] >= 2
    assert "/ready" in " ".join(services["edge"]["healthcheck"]["test"])
    grace = int(services["edge"]["environment"]["TOKENBUS_SHUTDOWN_GRACE_S"])
    assert int(services["edge"]["stop_grace_period"].rstrip("s")) > grace  # the drain fits in the grace
    gpu = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["worker-gpu"]["profiles"] == ["gpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    assert "COMPOSE_PROFILES=gpu" in (ROOT / ".env").read_text()  # plain `docker compose up` is the GPU stack
    for name in ("worker-gpu", "worker-cpu", "embedder"):
        assert services[name]["environment"]["TOKENBUS_REDIS_URL"] == "redis://redis:6379/0"
    for name, service in services.items():  # tokenbus's images are built here, never pulled from Docker Hub
        if service.get("image", "").startswith("tokenbus/"):
            assert service["pull_policy"] == ("build" if "build" in service else "never"), name
    mounted = {volume.split(":")[0] for name in ("prometheus", "grafana", "redis")
               for volume in services[name]["volumes"]}
    for path in (p for p in mounted if p.startswith("./")):
        assert (ROOT / path).exists(), path


REDIS_ACL = ROOT / "deploy" / "redis" / "users.acl"
SERVICE_USERS = {"edge": "tokenbus-edge", "worker-gpu": "tokenbus-worker", "worker-cpu": "tokenbus-worker",
                 "embedder": "tokenbus-worker", "admin": "tokenbus-admin"}


def acl_users() -> dict[str, str]:
    """Each user of deploy/redis/users.acl and its rules."""
    lines = [line.split(" ", 2) for line in REDIS_ACL.read_text().splitlines() if line.startswith("user ")]
    return {name: rules for _user, name, rules in lines}


def test_the_redis_users_have_no_password_and_nobody_logs_in_as_default() -> None:
    users = acl_users()
    assert users["default"].split()[0] == "off"  # its permissions are the append-only file's replay
    assert users["tokenbus-health"].split()[-2:] == ["-@all", "+ping"]
    assert set(SERVICE_USERS.values()) <= set(users)
    for name, rules in users.items():
        assert not any(rule.startswith((">", "#")) for rule in rules.split()), name  # start.sh adds them
        if name not in ("default", "tokenbus-health"):
            assert "-@dangerous" in rules and "+@all" not in rules and "~*" not in rules.split(), name
    assert "~tokenbus:apikeys" in users["tokenbus-admin"].split()
    assert not any("~tokenbus:apikeys" in rule and not rule.startswith("%R~")
                   for name in ("tokenbus-edge", "tokenbus-worker") for rule in users[name].split())


def test_every_compose_service_logs_in_to_redis_as_its_own_user() -> None:
    loaded = compose()
    services = loaded["services"]
    redis_service = services["redis"]
    assert redis_service["entrypoint"][:2] == ["sh", "/etc/tokenbus/redis/start.sh"]
    assert "./deploy/redis/users.acl:/etc/tokenbus/redis/users.acl:ro" in redis_service["volumes"]
    assert "--requirepass" not in redis_service["command"]
    assert set(redis_service["secrets"]) == set(SERVICE_USERS.values())
    for name, user in SERVICE_USERS.items():
        env = services[name]["environment"]
        assert env["TOKENBUS_REDIS_USERNAME"] == user and services[name]["secrets"] == [user], name
        assert env["TOKENBUS_REDIS_PASSWORD_FILE"] == f"/run/secrets/{user}", name
        assert "@" not in env["TOKENBUS_REDIS_URL"], name  # no password in a URL
    for user in SERVICE_USERS.values():  # made by the operator, never committed
        secret = loaded["secrets"][user]["file"]
        assert subprocess.run(["git", "check-ignore", "-q", secret], cwd=ROOT, timeout=10).returncode == 0, secret


def test_the_compose_monitoring_is_private() -> None:
    """The metrics name tenants: only the proxy is published on every interface, Prometheus and Grafana on
    loopback, Grafana with a password from a secret file (not in git) and no anonymous viewers."""
    loaded = compose()
    services = loaded["services"]
    published = {name: service.get("ports", []) for name, service in services.items()}
    assert published.pop("proxy") == ["8000:8000"]
    assert published.pop("prometheus") == ["127.0.0.1:9090:9090"]
    assert published.pop("grafana") == ["127.0.0.1:3000:3000"]
    assert not any(published.values()), published  # edges, workers, Redis: the compose network only
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_SECURITY_ADMIN_PASSWORD" not in grafana
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    secret = Path(loaded["secrets"]["grafana_admin_password"]["file"])
    ignored = subprocess.run(["git", "check-ignore", "-q", str(secret)], cwd=ROOT, timeout=10)
    assert ignored.returncode == 0, f"{secret} must stay out of git"
    scraped = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]
    ports = {job["job_name"]: job["dns_sd_configs"][0]["port"] if "dns_sd_configs" in job else
             {int(target.split(":")[1]) for target in job["static_configs"][0]["targets"]} for job in scraped}
    assert ports == {"tokenbus-edge": 9400, "tokenbus-worker": 9400}
    assert services["edge"]["environment"]["TOKENBUS_METRICS_PORT"] == "9400"
    assert "/metrics" in (ROOT / "deploy" / "compose" / "nginx.conf").read_text()  # refused, not routed


COMPOSE_PODS = {"edge": "tokenbus-edge", "worker-gpu": "tokenbus-worker", "worker-cpu": "tokenbus-worker",
                "embedder": "tokenbus-embedder"}
"""Each compose service of tokenbus's and the Deployment that runs it on Kubernetes (the admin's is admin.yaml)."""


def test_every_compose_service_runs_hardened_as_its_pod() -> None:
    """tokenbus's containers as deploy/k8s/base/hardening.yaml runs its pods: its user and group, no capabilities,
    no privilege escalation, a read-only root filesystem; a tmpfs wherever the pod has an emptyDir (exec for the
    workers: Triton and torch.compile load the kernels they build in their caches) and the same HOME and cache
    folders. Redis runs as its image's user, writing only its data volume."""
    services = compose()["services"]
    patches = yaml.safe_load((K8S / "base" / "hardening.yaml").read_text())
    pod_security = next(p["value"] for p in patches if p["path"] == "/spec/template/spec/securityContext")
    user = f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}"
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for overlay in ("gpu", "cpu")
            for d in rendered(overlay) if d["kind"] in POD_KINDS}
    pods["tokenbus-admin"] = yaml.safe_load((K8S / "admin.yaml").read_text())["spec"]
    hardened = [name for name, service in services.items() if service.get("image", "").startswith("tokenbus/")]
    assert set(hardened) == {*COMPOSE_PODS, "admin"}
    for name in [*hardened, "redis"]:
        service = services[name]
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"] and service["security_opt"] == ["no-new-privileges:true"], name
        assert int(service["user"].split(":")[0]) != 0, name
    assert services["redis"]["user"] == "999:1000"  # redis:alpine's redis user, who owns the image's /data
    assert "redis-data:/data" in services["redis"]["volumes"] and "tmpfs" not in services["redis"]
    for name in hardened:
        service = services[name]
        pod = pods[COMPOSE_PODS.get(name, "tokenbus-admin")]
        assert service["user"] == user, name
        tmpfs = {entry.split(":")[0]: entry.split(":")[1].split(",") for entry in service["tmpfs"]}
        written = {mount["mountPath"] for mount in pod["containers"][0]["volumeMounts"]
                   if any(v["name"] == mount["name"] and "emptyDir" in v for v in pod["volumes"])}
        assert set(tmpfs) == written - {"/dev/shm"}, name  # /dev/shm: shm_size
        assert all("mode=1777" in options for options in tmpfs.values()), name  # writable by the user
        if name in ("worker-gpu", "worker-cpu", "embedder"):
            assert service["shm_size"] == "2gb", name
            assert all("exec" in options for options in tmpfs.values()), name
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            for variable in ("HOME", "XDG_CACHE_HOME"):
                assert service["environment"][variable] == env[variable] and env[variable] in tmpfs, (name, variable)


@pytest.mark.parametrize("image", ["edge", "worker-cpu", "worker-gpu"])
def test_each_dockerfile_passes_hadolint(image: str) -> None:
    """hadolint's rules, with the two exceptions deploy/docker/.hadolint.yaml gives its reasons for."""
    docker = ROOT / "deploy" / "docker"
    linted = subprocess.run([str(Path(sys.executable).parent / "hadolint"), "--config", str(docker / ".hadolint.yaml"),
                             "--no-color", str(docker / f"{image}.Dockerfile")], capture_output=True, text=True,
                            timeout=60)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_the_edge_image_has_no_engine() -> None:
    edge = (ROOT / "deploy" / "docker" / "edge.Dockerfile").read_text().lower()
    assert "vllm" not in edge.replace("no vllm", "") and "torch" not in edge.replace("no torch", "")
    dependencies = " ".join(__import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]
                            ["dependencies"]).lower()
    assert "vllm" not in dependencies and "torch" not in dependencies


def test_the_prometheus_config_and_rules_pass_promtool_and_their_unit_tests() -> None:
    for args in (["check", "config", "--syntax-only", "prometheus.yml"], ["check", "rules", "rules.yml"],
                 ["test", "rules", "rules.test.yml"]):
        checked = promtool(*args, cwd=PROMETHEUS)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:panel_{i}", "expr": target["expr"]}
        for i, panel in enumerate(panels) for target in panel["targets"]]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    checked = promtool("check", "rules", "dashboard.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert len(panels) >= 8


# Kubernetes


K8S = ROOT / "deploy" / "k8s"
POD_KINDS = ("Deployment", "StatefulSet")
CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.keda.sh.yaml",
                ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.monitoring.coreos.com.yaml",
                ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.monitoring.coreos.com.yaml"}


def rendered(overlay: str, *components: str, patches: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The overlay as `kubectl apply -k` would send it (kustomize works offline), with deploy/k8s/components' given
    and the patches given added as an operator adds them to it (kustomize takes only relative paths)."""
    assert shutil.which("kubectl"), "kubectl renders the kustomizations"
    with tempfile.TemporaryDirectory() as folder:
        root = K8S / "overlays" / overlay
        if components or patches:
            relative = Path(os.path.relpath(K8S, folder))
            (Path(folder) / "kustomization.yaml").write_text(yaml.safe_dump({
                "resources": [str(relative / "overlays" / overlay)],
                "components": [str(relative / "components" / name) for name in components],
                "patches": patches or []}))
            root = Path(folder)
        out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.mark.parametrize("overlay", ["gpu", "cpu"])
def test_the_kubernetes_manifests_validate(overlay: str, tmp_path: Path) -> None:
    from jsonschema import Draft202012Validator

    docs = [*rendered(overlay), yaml.safe_load((K8S / "admin.yaml").read_text())]
    core = [d for d in docs if (d["apiVersion"], d["kind"]) not in CUSTOM_KINDS]
    (tmp_path / "core.yaml").write_text(yaml.safe_dump_all(core))
    checked = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", "1.32.0",
                              str(tmp_path / "core.yaml")], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    custom = [d for d in docs if (d["apiVersion"], d["kind"]) in CUSTOM_KINDS]
    assert {d["kind"] for d in custom} == {"ScaledObject", "ServiceMonitor", "PrometheusRule"}
    for doc in custom:
        schema = yaml.safe_load((K8S / "schemas" / CUSTOM_KINDS[(doc["apiVersion"], doc["kind"])]).read_text())
        errors = [e.message for e in Draft202012Validator(schema).iter_errors(doc)]
        assert not errors, (doc["kind"], errors)


@pytest.mark.parametrize("overlay", ["gpu", "cpu"])
def test_the_kubernetes_deployment_is_ready_for_production(overlay: str) -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered(overlay)}
    edge = docs[("Deployment", "tokenbus-edge")]["spec"]["template"]["spec"]
    container = edge["containers"][0]
    grace = int(next(e["value"] for e in container["env"] if e["name"] == "TOKENBUS_SHUTDOWN_GRACE_S"))
    assert edge["terminationGracePeriodSeconds"] > grace + container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"PodDisruptionBudget"} <= {kind for kind, _name in docs}
    assert ("HorizontalPodAutoscaler", "tokenbus-edge") in docs and ("ScaledObject", "tokenbus-worker") in docs
    scaled = {d["spec"]["scaleTargetRef"]["name"] for (kind, _), d in docs.items()
              if kind in ("HorizontalPodAutoscaler", "ScaledObject")}
    for name in scaled:  # the autoscaler owns the count: `kubectl apply` must not reset it
        assert "replicas" not in docs[("Deployment", name)]["spec"], name
    worker = docs[("Deployment", "tokenbus-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert ("nvidia.com/gpu" in worker["resources"]["limits"]) == (overlay == "gpu")
    if overlay == "gpu":  # a rollout needs no spare GPU
        rolling = docs[("Deployment", "tokenbus-worker")]["spec"]["strategy"]["rollingUpdate"]
        assert rolling == {"maxSurge": 0, "maxUnavailable": 1}
    redis_pod = docs[("StatefulSet", "tokenbus-redis")]["spec"]["template"]["spec"]
    redis_container = redis_pod["containers"][0]
    assert redis_container["args"] == ["redis-server", *REDIS_ARGS]
    memory = redis_container["resources"]["requests"]["memory"]
    assert memory == redis_container["resources"]["limits"]["memory"] and memory.endswith("Gi")
    maxmemory = int(REDIS_ARGS[REDIS_ARGS.index("--maxmemory") + 1])
    assert 0.5 <= maxmemory / (int(memory.removesuffix("Gi")) << 30) <= 0.75  # room above maxmemory: no OOM kill
    assert_redis_requires_its_users(docs, redis_pod)
    assert_only_tokenbus_reaches_redis(docs)


def test_the_optional_ingress_fits_the_edges(tmp_path: Path) -> None:
    """deploy/k8s/components/ingress: ingress-nginx in front of the edges' Service, its limits the edges' own (and
    the compose proxy's): bodies up to --max-body-bytes, no buffering either way for the streams, read and send
    timeouts above --request-timeout-s. The overlays alone have no Ingress."""
    assert not any(doc["kind"] == "Ingress" for overlay in ("gpu", "cpu") for doc in rendered(overlay))
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered("gpu", "ingress")}
    ingress = docs[("Ingress", "tokenbus")]
    (tmp_path / "ingress.yaml").write_text(yaml.safe_dump(ingress))
    checked = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", "1.32.0",
                              str(tmp_path / "ingress.yaml")], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    settings, prefix = Settings(), "nginx.ingress.kubernetes.io/"
    nginx = {k.removeprefix(prefix): v for k, v in ingress["metadata"]["annotations"].items() if k.startswith(prefix)}
    compose_proxy = (ROOT / "deploy" / "compose" / "nginx.conf").read_text()
    assert settings.max_body_bytes % (1 << 20) == 0 and nginx["proxy-body-size"] == f"{settings.max_body_bytes >> 20}m"
    assert f"client_max_body_size {nginx['proxy-body-size']};" in compose_proxy
    assert nginx["proxy-buffering"] == nginx["proxy-request-buffering"] == "off"
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(nginx[timeout]) > settings.request_timeout_s, timeout  # the longest request, and its last event
        assert f"{timeout.replace('-', '_')} {nginx[timeout]}s;" in compose_proxy, timeout
    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    hosts = [rule["host"] for rule in spec["rules"]]
    assert [host for tls in spec["tls"] for host in tls["hosts"]] == hosts
    assert all(tls["secretName"] for tls in spec["tls"])  # a placeholder, the operator's certificate
    backends = [path["backend"]["service"] for rule in spec["rules"] for path in rule["http"]["paths"]]
    assert backends == [{"name": "tokenbus", "port": {"name": "http"}}]
    assert [p["name"] for p in docs[("Service", "tokenbus")]["spec"]["ports"]] == ["http"]
    allowed = docs[("NetworkPolicy", "tokenbus-edge")]["spec"]["ingress"]  # the controller reaches the edges
    controller = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    assert controller in allowed[0]["from"] and allowed[0]["ports"] == [{"protocol": "TCP", "port": "http"}]
    assert ingress["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tokenbus"


def secret_items(pod: dict[str, Any]) -> list[dict[str, str]]:
    """The keys of the Redis users' Secret that a pod mounts."""
    return [item for volume in pod.get("volumes", []) if volume.get("secret", {}).get("secretName")
            == "tokenbus-redis-users" for item in volume["secret"].get("items", [{"key": "*", "path": "*"}])]


def assert_redis_requires_its_users(docs: dict[tuple[str, str], Any], redis_pod: dict[str, Any]) -> None:
    """Redis starts with deploy/redis's users (a ConfigMap of them) and their passwords from a Secret; each
    process logs in as its own user and mounts only its own password."""
    container = redis_pod["containers"][0]
    assert container["command"][:2] == ["sh", "/etc/tokenbus/redis/start.sh"]
    assert "--requirepass" not in container["args"]
    acl = next(v["configMap"]["name"] for v in redis_pod["volumes"] if "configMap" in v)
    config_map = docs[("ConfigMap", acl)]["data"]
    assert config_map["users.acl"] == REDIS_ACL.read_text() and "start.sh" in config_map
    assert secret_items(redis_pod) == [{"key": "*", "path": "*"}]  # every user's, to hash them
    expected = {"tokenbus-edge": "tokenbus-edge", "tokenbus-worker": "tokenbus-worker",
                "tokenbus-embedder": "tokenbus-worker"}
    for name, user in expected.items():
        pod = docs[("Deployment", name)]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["TOKENBUS_REDIS_USERNAME"] == user, name
        assert secret_items(pod) == [{"key": user, "path": user}], name
        assert env["TOKENBUS_REDIS_PASSWORD_FILE"].endswith("/" + user), name
    urls = [d["data"]["TOKENBUS_REDIS_URL"] for (kind, _), d in docs.items()
            if kind == "ConfigMap" and "TOKENBUS_REDIS_URL" in d["data"]]
    assert urls and not any("@" in url for url in urls)  # no password in a URL


def assert_only_tokenbus_reaches_redis(docs: dict[tuple[str, str], Any]) -> None:
    policy = docs[("NetworkPolicy", "tokenbus-redis")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "tokenbus-redis"}
    assert policy["policyTypes"] == ["Ingress"] and len(policy["ingress"]) == 1
    allowed = policy["ingress"][0]
    assert allowed["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tokenbus-edge"}}} in allowed["from"]
    assert all(source.keys() <= {"podSelector", "namespaceSelector"} for source in allowed["from"])
    assert ("NetworkPolicy", "tokenbus-edge") in docs and ("NetworkPolicy", "tokenbus-worker") in docs


def test_the_operator_rules_are_the_prometheus_rules() -> None:
    operator = yaml.safe_load((K8S / "base" / "prometheusrule.yaml").read_text())
    assert operator["spec"]["groups"] == yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]


def test_every_pod_is_hardened_and_every_image_pinned() -> None:
    """What deploy/k8s/base/hardening.yaml gives every pod, checked on what both overlays render and on the admin
    pod; every image, compose's too, tagged with a whole version (tokenbus's own: the project's)."""
    version = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    admin = yaml.safe_load((K8S / "admin.yaml").read_text())
    pods = [(admin["spec"], "tokenbus-admin")]
    for overlay in ("gpu", "cpu"):
        pods += [(d["spec"]["template"]["spec"], d["metadata"]["name"]) for d in rendered(overlay)
                 if d["kind"] in POD_KINDS]
    images = [service["image"] for service in compose()["services"].values() if "image" in service]
    built_here = len(images)
    for pod, name in pods:
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] >= 10000, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"], name
            assert security["capabilities"] == {"drop": ["ALL"]}, name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), name
            mounted = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounted or name == "tokenbus-redis", name  # Redis writes only its /data
            images.append(container["image"])
    moving = [image for image in images if not re.search(r":v?\d+\.\d+\.\d+(-[a-z]+)?$", image)]
    assert not moving, moving  # no `latest`, no bare minor: nothing moves under a deployment
    ours = {image.rsplit(":", 1)[1] for image in images if re.match(r"([^/]+/)?tokenbus/", image)}
    assert ours == {version}, ours
    pulled = [image for image in images[built_here:] if image.startswith("tokenbus/")]
    assert not pulled, pulled  # the pods' from the operator's registry, never Docker Hub's tokenbus/ namespace


def test_the_metrics_are_scraped_off_the_api_port() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered("gpu")}
    api = docs[("Service", "tokenbus")]["spec"]["ports"]
    assert [p["targetPort"] for p in api] == ["http"]
    monitor = docs[("ServiceMonitor", "tokenbus")]["spec"]
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]
    scraped = {name for (kind, name), d in docs.items()
               if kind == "Service" and d["metadata"].get("labels", {}).get("tokenbus.io/metrics") == "true"}
    assert scraped == {"tokenbus-edge", "tokenbus-worker"}  # the job names the alerting rules use
    for name in ("tokenbus-edge", "tokenbus-worker", "tokenbus-embedder"):
        container = docs[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TOKENBUS_METRICS_PORT"] == "9400", name
        assert {"name": "metrics", "containerPort": 9400} in container["ports"], name


def test_kube_prometheus_stack_selects_the_monitor_and_the_rules() -> None:
    """Its Prometheus loads only the ServiceMonitors and PrometheusRules labelled with its Helm release: both carry
    the README's (kube-prometheus-stack), and the README's patch gives both another."""
    readme = (ROOT / "README.md").read_text()
    for overlay in ("gpu", "cpu"):
        labelled = {d["kind"]: d["metadata"]["labels"].get("release") for d in rendered(overlay)
                    if "release" in d["metadata"].get("labels", {})}
        assert labelled == {"ServiceMonitor": "kube-prometheus-stack", "PrometheusRule": "kube-prometheus-stack"}
    assert "`release: kube-prometheus-stack`" in readme
    documented = re.findall(r"```yaml\n(patches:.*?)```", readme, re.DOTALL)
    patches = [patch for block in documented for patch in yaml.safe_load(block)["patches"]
               if patch["target"].get("group") == "monitoring.coreos.com"]
    assert len(patches) == 1, documented
    release = yaml.safe_load(patches[0]["patch"])[0]["value"]
    relabelled = {d["kind"]: d["metadata"]["labels"].get("release") for d in rendered("gpu", patches=patches)
                  if "release" in d["metadata"].get("labels", {})}
    assert relabelled == {"ServiceMonitor": release, "PrometheusRule": release} and release != "kube-prometheus-stack"


def tool(env: str, *candidates: Path) -> Path:
    """A checker installed beside the project (its path in `env`, or the first candidate that exists). `make
    install` (and `make unit`'s install) provides each: one missing fails the test, naming the step."""
    import os

    for path in ([Path(os.environ[env])] if env in os.environ else []) + list(candidates):
        if path.is_file():
            return path
    pytest.fail(f"{candidates[0].name} is not installed: run `bash deploy/install.sh dev` (or set {env})")


CHECKOV = ("TOKENBUS_CHECKOV", ROOT / ".venv-checkov" / "bin" / "checkov")
"""checkov pins its own dependencies, which conflict with tokenbus's: it has a virtual environment of its own."""


def checkov(*args: str) -> subprocess.CompletedProcess[str]:
    """checkov offline: no external checks or modules downloaded, nothing uploaded."""
    return subprocess.run([str(tool(*CHECKOV)), *args, "--compact", "--quiet", "--skip-download"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_checkov_passes_the_manifests_the_dockerfiles_and_the_compose_file(tmp_path: Path) -> None:
    """The manifests as both overlays render them and the optional Ingress, the Dockerfiles, and (checkov has no
    Compose checks) the compose file and deploy/ for secrets. A check that does not apply is skipped in the file,
    with its reason: `# checkov:skip=CKV_...: reason`, or the manifests' `checkov.io/skipN: CKV_...=reason`
    annotations."""
    for overlay in ("gpu", "cpu"):
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(rendered(overlay)))
    optional = [doc for doc in rendered("gpu", "ingress") if doc["kind"] == "Ingress"]  # deploy/k8s/components'
    (tmp_path / "ingress.yaml").write_text(yaml.safe_dump_all(optional))
    for args in (["-d", str(tmp_path), "-d", "deploy/docker", "--framework", "kubernetes,dockerfile"],
                 ["-d", "deploy", "-f", "docker-compose.yml", "--framework", "secrets"]):
        checked = checkov(*args)
        assert checked.returncode == 0, checked.stdout[-6000:] + checked.stderr[-2000:]
    skips = [value for overlay in ("gpu", "cpu") for doc in rendered(overlay)
             for key, value in doc["metadata"].get("annotations", {}).items() if key.startswith("checkov.io/skip")]
    assert skips and all(len(value.split("=")) == 2 and value.split("=")[1].strip() for value in skips), skips


def test_bandit_passes_the_code() -> None:
    """bandit over shared/ and services/; each finding left is a `# nosec BXXX: reason` on its line."""
    bandit = tool("TOKENBUS_BANDIT", Path(sys.executable).parent / "bandit")
    checked = subprocess.run([str(bandit), "-q", "-r", "shared", "services"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
    assert checked.returncode == 0, checked.stdout[-6000:]
    for path in [*(ROOT / "shared").rglob("*.py"), *(ROOT / "services").rglob("*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "# nosec" in line:
                assert re.search(r"# nosec B\d{3}(, B\d{3})*: \S", line), f"{path}:{number}: a skip needs its reason"


def test_make_secrets_makes_every_secret_the_compose_file_needs_once(tmp_path: Path) -> None:
    """An operator's first `docker compose up` finds every secret file, readable by the services' users; a second
    run of the script keeps them."""
    (tmp_path / "deploy" / "compose" / "secrets").mkdir(parents=True)
    script = tmp_path / "deploy" / "compose" / "make-secrets.sh"
    shutil.copy(ROOT / "deploy" / "compose" / "make-secrets.sh", script)
    subprocess.run(["sh", str(script)], check=True, capture_output=True, timeout=30)
    made = {name: (tmp_path / spec["file"]).read_text() for name, spec in compose()["secrets"].items()}
    assert all(len(password) >= 32 for password in made.values()), made.keys()
    assert len(set(made.values())) == len(made)  # each its own
    assert all((tmp_path / spec["file"]).stat().st_mode & 0o044 == 0o044 for spec in compose()["secrets"].values())
    subprocess.run(["sh", str(script)], check=True, capture_output=True, timeout=30)
    assert {name: (tmp_path / spec["file"]).read_text() for name, spec in compose()["secrets"].items()} == made

