"""The deployment files under deploy/: they parse, the Kubernetes manifests pass the
schemas of the Kubernetes API (kubernetes-validate), and what they tell ssmserve (flags,
environment, probes, the drain hook) is what ssmserve accepts. Nothing here starts a
container: docker and a cluster are not on the test machine."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ssmserve.client import cli
from ssmserve.client.routing import SESSION_HEADER
from ssmserve.server import main as server_main
from ssmserve.server.worker import LIVENESS_SERVICE

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.30.0"  # the oldest release still supported upstream when written
WORKER_LABELS = {"app.kubernetes.io/name": "ssmserve", "app.kubernetes.io/component": "worker"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> manifest, for every file the kustomization applies."""
    kustomization = documents(KUBERNETES / "kustomization.yaml")[0]
    out = {}
    for resource in kustomization["resources"]:
        for doc in documents(KUBERNETES / resource):
            out[doc["kind"], doc["metadata"]["name"]] = doc
    return out


@pytest.mark.parametrize(
    "path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_every_deployment_file_parses(path: Path) -> None:
    assert documents(path)


@pytest.mark.parametrize(
    "resource", sorted(documents(KUBERNETES / "kustomization.yaml")[0]["resources"])
)
def test_each_manifest_passes_the_kubernetes_schemas(resource: str) -> None:
    for doc in documents(KUBERNETES / resource):
        # strict: a field the API does not know (a typo) fails too
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_misspelt_field_is_caught_by_the_schema_check() -> None:
    """The check above can fail: a probe with a field the API does not have."""
    deployment = manifests()["Deployment", "ssmserve-worker"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _worker_container() -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = manifests()["Deployment", "ssmserve-worker"]
    return deployment, deployment["spec"]["template"]["spec"]["containers"][0]


def test_the_worker_takes_its_flags_and_environment(monkeypatch) -> None:
    found = manifests()
    _, container = _worker_container()
    config = found["ConfigMap", "ssmserve-config"]["data"]
    refs = {r["configMapRef"]["name"] for r in container["envFrom"]}
    assert refs == {"ssmserve-config"}
    for key, value in config.items():
        assert key.startswith("SSMSERVE_"), key
        monkeypatch.setenv(key, value)
    # the Secret's redis-url, as a deployment on Sentinel would have it
    monkeypatch.setenv("SSMSERVE_REDIS_URL", "redis+sentinel://sentinel-0:26379/ssmserve")
    args = [a.replace("$(POD_IP)", "10.1.2.3") for a in container["args"]]
    assert args[0] == "ssmserve-server"
    parser = server_main.build_parser()
    parsed = parser.parse_args(args[1:])
    assert parsed.advertise == "10.1.2.3:50051"
    assert parsed.redis_wait_replicas is None and parsed.log_format == "json"  # auto
    assert parsed.rebalance_every == 10
    assert parsed.memory_budget == int(config["SSMSERVE_MEMORY_BUDGET"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for flag in ("--auth-tokens", "--cluster-secret"):
        path = Path(args[args.index(flag) + 1])
        assert path.parent == Path(mounts["secrets"])
        assert path.name in _secret_files()
    # every file the settings read is there; the flags and environment pass its checks
    settings = server_main.settings_from_args(parsed)
    assert settings.advertise == "10.1.2.3:50051"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    keys = {
        e["valueFrom"]["secretKeyRef"]["key"]
        for e in env.values()
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert keys <= _secret_files()


def _secret_files() -> set[str]:
    kustomization = documents(KUBERNETES / "kustomization.yaml")[0]
    (generator,) = kustomization["secretGenerator"]
    assert generator["name"] == "ssmserve-secrets"
    return {Path(f).name for f in generator["files"]}


def test_probes_drain_and_grace_period_fit_together() -> None:
    deployment, container = _worker_container()
    pod = deployment["spec"]["template"]["spec"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    listen = manifests()["ConfigMap", "ssmserve-config"]["data"]["SSMSERVE_LISTEN"]
    assert listen.endswith(f":{port}")
    ready, live = container["readinessProbe"]["grpc"], container["livenessProbe"]["grpc"]
    assert ready["port"] == live["port"] == port
    assert ready.get("service", "") == ""  # NOT_SERVING while draining: no new calls
    assert live["service"] == LIVENESS_SERVICE  # SERVING while draining: not killed
    assert container["startupProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    # the preStop hook is the ssmserve CLI's drain of this worker, over loopback
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "ssmserve"
    parsed = cli.build_parser().parse_args(command[1:])
    assert parsed.server == f"127.0.0.1:{port}" and parsed.command == "drain"
    env = {e["name"] for e in container["env"]}
    assert "SSMSERVE_TOKEN" in env  # the drain's operator token
    # the drain must finish before SIGKILL: well above a lease TTL and a hand-off per
    # session (README: a few seconds per 1,000 sessions)
    assert pod["terminationGracePeriodSeconds"] >= 60
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0  # a drained worker's sessions need a peer


def test_services_and_budget_select_the_workers() -> None:
    found = manifests()
    deployment, _ = _worker_container()
    assert deployment["spec"]["selector"]["matchLabels"] == WORKER_LABELS
    assert WORKER_LABELS.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    budget = found["PodDisruptionBudget", "ssmserve-worker"]
    assert budget["spec"]["selector"]["matchLabels"] == WORKER_LABELS
    assert budget["spec"]["maxUnavailable"] == 1
    for name in ("ssmserve", "ssmserve-workers-headless"):
        service = found["Service", name]
        assert service["spec"]["selector"] == WORKER_LABELS
        assert any(p["targetPort"] == "grpc" for p in service["spec"]["ports"])


def test_the_affinity_fronts_hash_the_header_the_client_sends() -> None:
    istio = documents(KUBERNETES / "optional" / "istio-session-affinity.yaml")[0]
    policy = istio["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]
    assert policy["httpHeaderName"] == SESSION_HEADER
    envoy = documents(KUBERNETES / "optional" / "envoy-session-affinity.yaml")[0]
    (listener,) = envoy["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (route,) = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["hash_policy"] == [{"header": {"header_name": SESSION_HEADER}}]
    (cluster,) = envoy["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "RING_HASH"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert ("Service", endpoint["address"]["socket_address"]["address"]) in manifests()


def test_compose_runs_two_draining_workers_and_the_demo() -> None:
    compose = documents(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    assert set(services) == {"redis", "worker-a", "worker-b", "demo"}
    assert services["redis"]["healthcheck"]["test"][-1] == "ping"
    parser = server_main.build_parser()
    for name in ("worker-a", "worker-b"):
        worker = services[name]
        assert worker["depends_on"] == {"redis": {"condition": "service_healthy"}}
        assert worker["stop_signal"] == "SIGTERM" and worker["stop_grace_period"] == "60s"
        assert "healthcheck" in worker
        assert worker["command"][0] == "ssmserve-server"
        parsed = parser.parse_args(worker["command"][1:])
        assert parsed.demo and parsed.advertise == f"{name}:50051"
        assert worker["environment"]["SSMSERVE_REDIS_URL"] == "redis://redis:6379/0"
    demo = services["demo"]
    assert {d: c["condition"] for d, c in demo["depends_on"].items()} == {
        "worker-a": "service_healthy",
        "worker-b": "service_healthy",
    }
    command = demo["command"]
    assert command[:3] == ["python", "-m", "ssmserve.client.demo"]
    assert command[command.index("--server") + 1] == "worker-a:50051,worker-b:50051"
    assert shlex.join(command)  # plain strings all


def test_compose_says_which_redis_fsyncs_every_write() -> None:
    """The shared store fsyncs every write; the comment over it names the embedded
    Redis's own policy, which is not that one."""
    from ssmserve.server.embedded_redis import EmbeddedRedisSettings

    text = (DEPLOY / "compose.yaml").read_text()
    command = documents(DEPLOY / "compose.yaml")[0]["services"]["redis"]["command"]
    policy = command[command.index("--appendfsync") + 1]
    assert policy == "always"
    comment = " ".join(
        line.strip().lstrip("#").strip()
        for line in text[: text.index('    command: ["redis-server"')].splitlines()[-8:]
        if line.strip().startswith("#")
    )
    assert comment.startswith(f"appendfsync {policy}:")
    embedded = re.search(r"embedded Redis[^.]*?appendfsync (\w+)", comment)
    assert embedded is not None, comment
    assert embedded.group(1) == EmbeddedRedisSettings(data_dir=Path("x")).appendfsync


# ------------------------------------------------------------------------------ Docker

DOCKERFILE = DEPLOY.parent / "Dockerfile"
#: docker run's options that take a value (the others are flags such as --rm or -d).
DOCKER_RUN_VALUED = {"-p", "--publish", "-v", "--volume", "-e", "--env", "--env-file",
                     "--name", "-u", "--user", "--network", "--mount", "-w", "--workdir",
                     "--entrypoint"}  # fmt: skip


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments), continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def instruction(name: str) -> str:
    (args,) = [a for word, a in dockerfile_instructions() if word == name]
    return args


def image_env() -> dict[str, str]:
    env = {}
    for word, args in dockerfile_instructions():
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def documented_docker_runs() -> list[tuple[str, list[str]]]:
    """Every `docker run` command in the Dockerfile's comments and in the docs' shell
    blocks: (where, argv)."""
    sources = []
    lines = [ln.removeprefix("#").strip() for ln in DOCKERFILE.read_text().splitlines()]
    sources.append(("Dockerfile", lines))
    for path in [DEPLOY.parent / "README.md", *sorted((DEPLOY.parent / "docs").glob("*.md"))]:
        blocks = re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", path.read_text(), re.S)
        sources.append((path.name, [ln.strip() for b in blocks for ln in b.splitlines()]))
    runs = []
    for where, text_lines in sources:
        joined = "\n".join(text_lines).replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.removeprefix("$ ").strip()
            if line.startswith("docker run "):
                runs.append((where, shlex.split(line, comments=True)))
    return runs


def docker_run_parts(argv: list[str]) -> tuple[list[str], list[str], str, list[str]]:
    """(published ports, volumes, image, command) of a `docker run` argv."""
    assert argv[:2] == ["docker", "run"]
    publish: list[str] = []
    volumes: list[str] = []
    i = 2
    while argv[i].startswith("-"):
        option, eq, value = argv[i].partition("=")
        if option in DOCKER_RUN_VALUED:
            if not eq:
                i += 1
                value = argv[i]
            if option in ("-p", "--publish"):
                publish.append(value)
            if option in ("-v", "--volume"):
                volumes.append(value)
        i += 1
    return publish, volumes, argv[i], argv[i + 1 :]


def image_worker_settings(command: list[str], monkeypatch, tmp_path: Path):
    """What ``ssmserve-server`` makes of ``command`` under the image's environment (its
    data dir moved to tmp_path: --demo writes the demo model there)."""
    for key in [k for k in os.environ if k.startswith("SSMSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in image_env().items():
        if key.startswith("SSMSERVE_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("SSMSERVE_DATA_DIR", str(tmp_path / "data"))
    assert command[0] == "ssmserve-server"
    return server_main.settings_from_args(server_main.build_parser().parse_args(command[1:]))


def test_the_image_command_and_its_health_check_agree(monkeypatch, tmp_path) -> None:
    from ssmserve.server.api.auth import OPEN_PREFIXES
    from ssmserve.server.worker import check_exposure

    assert json.loads(instruction("ENTRYPOINT")) == ["/usr/bin/tini", "--"]
    command = json.loads(instruction("CMD"))
    settings = image_worker_settings(command, monkeypatch, tmp_path)
    check_exposure(settings)  # it starts: --insecure, on every interface of the container
    assert settings.insecure and settings.listen == "0.0.0.0:50051"
    port = settings.listen.rsplit(":", 1)[1]
    exposed = instruction("EXPOSE").split()
    assert port in exposed and settings.metrics_listen.rsplit(":", 1)[1] in exposed
    probe = instruction("HEALTHCHECK")
    assert f"grpc.insecure_channel('127.0.0.1:{port}')" in probe
    # readiness (""): NOT_SERVING while draining or while Redis does not answer
    assert "HealthCheckRequest()" in probe and "HealthCheckResponse.SERVING" in probe
    assert "/grpc.health.v1.Health/" in OPEN_PREFIXES  # the probe needs no token


def test_documented_docker_runs_start_and_publish_no_open_worker(monkeypatch, tmp_path) -> None:
    """Each documented `docker run` starts (the worker's exposure check passes), and one
    without tokens publishes on the host's loopback only; files it names are mounted."""
    from ssmserve.server.worker import check_exposure

    runs = documented_docker_runs()
    assert any(where == "Dockerfile" for where, _ in runs)
    default = json.loads(instruction("CMD"))
    for where, argv in runs:
        publish, volumes, image, command = docker_run_parts(argv)
        assert image == "ssmserve", (where, argv)
        settings = image_worker_settings(command or default, monkeypatch, tmp_path)
        check_exposure(settings)
        mounted = [Path(v.split(":")[1]) for v in volumes]
        named = [d for _, d in settings.models if not str(d).startswith(str(tmp_path))]
        if settings.auth_tokens is not None:
            named.append(settings.auth_tokens)
        for path in named:
            assert any(path.is_relative_to(m) for m in mounted), (where, path, volumes)
        if settings.auth_tokens is None:
            assert publish and all(p.startswith("127.0.0.1:") for p in publish), (where, argv)


def test_a_public_worker_without_tokens_is_refused_in_the_image(monkeypatch, tmp_path) -> None:
    """What the check above relies on: the image's worker refuses 0.0.0.0 unauthenticated."""
    from ssmserve.server.worker import ExposedWithoutAuthError, check_exposure

    models = tmp_path / "models"
    settings = image_worker_settings(
        ["ssmserve-server", "--model", f"mamba={models}"], monkeypatch, tmp_path
    )
    with pytest.raises(ExposedWithoutAuthError, match="--auth-tokens"):
        check_exposure(settings)
