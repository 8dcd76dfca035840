"""deploy/k8s renders, passes the Kubernetes schemas, and its names all point at something real.

Rendering follows kustomization.yaml (its resources, namespace and labels), plus
submit-job.yaml, which is applied by hand. Every document is validated strictly
(no unknown fields) against the OpenAPI-derived schemas that kubernetes-validate
bundles, for the oldest and newest Kubernetes versions the manifests support.
Then the cross-references: env vars are real settings of the service the pod
runs, peer addresses name a Service and port that reach that peer, Services
select existing pods and target declared ports, probes hit declared ports (gRPC
health for the gRPC fleets; for the HTTP policy endpoint a GET route that its
app answers without the token), ConfigMap, Secret and claim references exist,
the endpoint reads run folders where the coordinator writes them, and only the
sandbox pod gets the Docker socket.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dockyard.config import load_config
from dockyard.experience.data_plane import DataPlaneSettings, redis_host
from dockyard.rpc.auth import AuthSettings
from dockyard.rpc.settings import DEFAULT_PORTS
from services.endpoint.settings import EndpointSettings
from tests.unit.test_docs import settings_variables

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
EXAMPLE = K8S.parents[1] / "examples" / "configs" / "tiny_expr.yaml"
VERSIONS = ("1.30", "1.37")  # grpc probes are GA from 1.27; 1.30 is the oldest the docs promise
WORKLOADS = {"Deployment", "StatefulSet", "Job"}
CLUSTER_SCOPED = {"Namespace"}
SHARED_VARIABLES = {f"DOCKYARD_{name.upper()}" for name in AuthSettings.model_fields} | {
    f"DOCKYARD_DATA_PLANE_{name.upper()}" for name in DataPlaneSettings.model_fields
}
HTTP_PORTS = {"endpoint": EndpointSettings.model_fields["port"].default}  # services serving HTTP, not gRPC
# component label -> (name of its container port, the service's default port)
SERVED = {name: ("grpc", port) for name, port in DEFAULT_PORTS.items()} | {
    name: ("http", port) for name, port in HTTP_PORTS.items()
}
COMPONENT_SERVICE = {name: name for name in SERVED}  # component label -> services/<name>


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render() -> list[dict[str, Any]]:
    """What `kubectl apply -k deploy/k8s` creates, plus the submit Job."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    labels: dict[str, str] = {}
    for entry in kustomization.get("labels", []):
        labels |= entry["pairs"]
    docs = []
    for name in kustomization["resources"]:
        for doc in load(K8S / name):
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = kustomization["namespace"]
            doc["metadata"]["labels"] = {**doc["metadata"].get("labels", {}), **labels}
            docs.append(doc)
    return docs + load(K8S / "submit-job.yaml")


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render()


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment, StatefulSet and Job."""
    return [(d, d["spec"]["template"]) for d in docs if d["kind"] in WORKLOADS]


def container_ports(template: dict[str, Any]) -> dict[str | int, int]:
    """Named and numbered ports the pod declares: name -> number and number -> number."""
    ports: dict[str | int, int] = {}
    for container in template["spec"]["containers"]:
        for port in container.get("ports", []):
            ports[port["containerPort"]] = port["containerPort"]
            if "name" in port:
                ports[port["name"]] = port["containerPort"]
    return ports


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def selected_pods(docs, selector: dict[str, str]) -> list[dict[str, Any]]:
    return [t for _, t in pod_specs(docs) if selector.items() <= t["metadata"]["labels"].items()]


def test_every_file_is_rendered_once() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "submit-job.yaml"}
    assert listed == on_disk, f"kustomization.yaml lists {sorted(listed)}, the folder has {sorted(on_disk)}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_document_passes_the_kubernetes_schema(docs, version: str) -> None:
    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not errors, "\n".join(errors)


def test_a_deployment_per_fleet_and_redis_with_a_volume(docs) -> None:
    templates = [d["spec"]["template"] for d in by_kind(docs, "Deployment").values()]
    components = {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in templates}
    assert components == set(SERVED)
    [redis] = by_kind(docs, "StatefulSet").values()
    [container] = redis["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert "--requirepass" in args
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"] for c in redis["spec"]["volumeClaimTemplates"]}
    assert mounts.keys() <= claims and mounts[next(iter(claims))] == args[args.index("--dir") + 1]


def test_env_vars_are_real_settings_with_working_values(docs) -> None:
    variables = settings_variables()
    services = by_kind(docs, "Service")
    for workload, template in pod_specs(docs):
        component = template["metadata"]["labels"].get("app.kubernetes.io/component")
        for container in template["spec"]["containers"]:
            env = env_of(container)
            where = f"{workload['metadata']['name']}/{container['name']}"
            for name in env:
                if not name.startswith("DOCKYARD_"):
                    continue
                owner = variables.get(name, (None, None))[1]
                assert name in SHARED_VARIABLES or owner == COMPONENT_SERVICE.get(component), (
                    f"{where}: {name} is not a setting of the {component} service"
                )
            # $(VAR) in command or args expands only from this container's env.
            for word in [*container.get("command", []), *container.get("args", [])]:
                for ref in re.findall(r"\$\((\w+)\)", str(word)):
                    assert ref in env, f"{where}: $({ref}) has no env var"
            if component not in SERVED:
                continue
            prefix = f"DOCKYARD_{component.upper()}_"
            port_name, port = SERVED[component]
            assert env[f"{prefix}HOST"] == "0.0.0.0", f"{where} must bind every interface"
            assert int(env[f"{prefix}PORT"]) == port == container_ports(template)[port_name], where
            for name, value in env.items():
                if name == f"{prefix}ADVERTISE_ADDRESS":
                    # Where the coordinator calls this pod back: its own IP (downward API), its own port.
                    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
                    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", where
                    assert value == f"$(POD_IP):{port}", f"{where}: {name}={value}"
                    continue
                if not (name.startswith(prefix) and name.endswith("_ADDRESS")) or name.endswith("WEIGHT_SYNC_ADDRESS"):
                    continue
                peer = name.removeprefix(prefix).removesuffix("_ADDRESS").lower()
                host, _, peer_port = value.partition(":")
                assert host in services, f"{where}: {name}={value} names no Service"
                service = services[host]
                assert int(peer_port) in [p["port"] for p in service["spec"]["ports"]], f"{where}: {name}={value}"
                [pod] = selected_pods(docs, service["spec"]["selector"])
                assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == peer, f"{where}: {name}={value}"


def test_rollouts_reach_the_trainers_weight_sync_store(docs) -> None:
    [coordinator] = [c for _, t in pod_specs(docs) for c in t["spec"]["containers"] if c["name"] == "coordinator"]
    env = env_of(coordinator)
    host, port = env["DOCKYARD_COORDINATOR_WEIGHT_SYNC_ADDRESS"], int(env["DOCKYARD_COORDINATOR_WEIGHT_SYNC_PORT"])
    assert port != 0, "the coordinator cannot pick a free port on the trainer's pod: fix it"
    service = by_kind(docs, "Service")[host]
    [published] = [p for p in service["spec"]["ports"] if p["port"] == port]
    [pod] = selected_pods(docs, service["spec"]["selector"])
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"
    assert container_ports(pod)[published["targetPort"]] == port


def test_services_select_pods_and_target_declared_ports(docs) -> None:
    for name, service in by_kind(docs, "Service").items():
        pods = selected_pods(docs, service["spec"]["selector"])
        assert len(pods) == 1, f"Service {name} selects {len(pods)} pod templates"
        ports = container_ports(pods[0])
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name}: targetPort {port['targetPort']} is not declared"


def test_probes_hit_declared_ports_grpc_health_for_grpc_fleets_and_http_get_for_http_ones(docs) -> None:
    for workload, template in pod_specs(docs):
        ports = container_ports(template)
        component = template["metadata"]["labels"].get("app.kubernetes.io/component")
        for container in template["spec"]["containers"]:
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                target = (probe.get("grpc") or probe.get("tcpSocket") or probe.get("httpGet"))["port"]
                assert target in ports, f"{workload['metadata']['name']}: {kind} port {target} is not declared"
            if component in DEFAULT_PORTS:
                for kind in ("readinessProbe", "livenessProbe"):
                    assert container[kind]["grpc"]["port"] == DEFAULT_PORTS[component]
            if component in HTTP_PORTS:
                for kind in ("readinessProbe", "livenessProbe"):
                    get = container[kind]["httpGet"]  # plain HTTP: uvicorn serves no TLS here
                    assert get.get("scheme", "HTTP") == "HTTP", f"{workload['metadata']['name']}: {kind}"
                    assert ports[get["port"]] == HTTP_PORTS[component], f"{workload['metadata']['name']}: {kind}"


def test_the_endpoint_probe_path_answers_without_the_token(docs) -> None:
    from starlette.testclient import TestClient

    from services.endpoint.app import create_app

    [container] = by_kind(docs, "Deployment")["endpoint"]["spec"]["template"]["spec"]["containers"]
    paths = {container[kind]["httpGet"]["path"] for kind in ("readinessProbe", "livenessProbe")}
    # Built without entering its lifespan: no coordinator channel, only the routes and the token check.
    client = TestClient(create_app(EndpointSettings(), token="probe-test-token"))
    assert client.get("/v1/models").status_code == 401, "the token is required, so the probe's 200 means something"
    for path in paths:
        reply = client.get(path)
        assert reply.status_code == 200, f"the kubelet sends no token: GET {path} gave {reply.status_code}"


def test_volumes_configmaps_secrets_and_claims_exist(docs) -> None:
    config_maps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    claims = set(by_kind(docs, "PersistentVolumeClaim"))
    for workload, template in pod_specs(docs):
        where = workload["metadata"]["name"]
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        volumes |= {c["metadata"]["name"]: {"claim": True} for c in workload["spec"].get("volumeClaimTemplates", [])}
        files: set[str] = set()  # paths of secret and config files in the container
        for container in template["spec"]["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: mount of undeclared volume {mount['name']}"
                volume = volumes[mount["name"]]
                if "configMap" in volume:
                    data = config_maps[volume["configMap"]["name"]]["data"]
                    keys = [item["key"] for item in volume["configMap"].get("items", [])] or list(data)
                    assert set(keys) <= set(data), f"{where}: ConfigMap keys {keys} missing"
                    files |= {f"{mount['mountPath']}/{k}" for k in keys}
                if "secret" in volume:
                    data = secrets[volume["secret"]["secretName"]]["stringData"]
                    keys = [item["key"] for item in volume["secret"].get("items", [])] or list(data)
                    assert set(keys) <= set(data), f"{where}: Secret keys {keys} missing"
                    files |= {f"{mount['mountPath']}/{k}" for k in keys}
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in claims
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], f"{where}: {entry['name']}"
                if entry["name"].endswith("_FILE"):
                    assert entry["value"] in files, f"{where}: {entry['name']}={entry['value']} is not a mounted file"
            for word in container.get("command", []):
                if str(word).startswith("/etc/dockyard/"):
                    assert word in files, f"{where}: {word} is not a mounted file"


def test_every_dockyard_pod_authenticates_and_only_the_buffer_and_its_data_plane_read_the_redis_password(
    docs,
) -> None:
    # The data plane's clients: the coordinator, the rollout replicas and the policy endpoint (agent trials'
    # parts) stage payloads in Redis, the trainer reads them.
    readers = {"buffer", "coordinator", "rollout", "endpoint", "trainer"}
    for workload, template in pod_specs(docs):
        if workload["kind"] == "StatefulSet":
            continue
        for container in template["spec"]["containers"]:
            env = env_of(container)
            assert "DOCKYARD_AUTH_TOKEN_FILE" in env, f"{workload['metadata']['name']} has no token"
            reads_password = any("REDIS_PASSWORD" in name for name in env)
            assert reads_password == (workload["metadata"]["name"] in readers), workload["metadata"]["name"]


@pytest.mark.parametrize("told", ["rollout", "endpoint"])
def test_services_told_of_the_data_plane_send_its_password_only_to_the_buffers_redis(docs, told: str) -> None:
    [container] = by_kind(docs, "Deployment")[told]["spec"]["template"]["spec"]["containers"]
    [buffer] = by_kind(docs, "Deployment")["buffer"]["spec"]["template"]["spec"]["containers"]
    allowed = env_of(container)["DOCKYARD_DATA_PLANE_REDIS_HOSTS"].split(",")
    assert allowed == [redis_host(env_of(buffer)["DOCKYARD_BUFFER_REDIS_URL"])]


def test_only_the_sandbox_gets_the_docker_socket(docs) -> None:
    holders = []
    for workload, template in pod_specs(docs):
        for volume in template["spec"].get("volumes", []):
            if "docker.sock" in volume.get("hostPath", {}).get("path", ""):
                holders.append(workload["metadata"]["name"])
    assert holders == ["sandbox"]


def test_trainer_and_rollout_request_gpus(docs) -> None:
    for name in ("trainer", "rollout"):
        [container] = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]["containers"]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert env_of(container)[f"DOCKYARD_{name.upper()}_DEVICE"].startswith("cuda")


def test_images_follow_the_build_names(docs) -> None:
    expected = {name: f"dockyard/{name}:latest" for name in SERVED} | {"sandbox": "dockyard/sandbox-service:latest"}
    for name, deployment in by_kind(docs, "Deployment").items():
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] == expected[name]


def test_the_job_config_is_the_tiny_recipe_and_loads(docs, tmp_path: Path) -> None:
    [config_map] = by_kind(docs, "ConfigMap").values()
    text = config_map["data"]["tiny_expr.yaml"]
    assert text == EXAMPLE.read_text(), "deploy/k8s/job-config.yaml drifted from examples/configs/tiny_expr.yaml"
    path = tmp_path / "job.yaml"
    path.write_text(text)
    cfg = load_config(path, [])
    assert not Path(cfg.policy.model_name).is_absolute(), "resolves under /data, the shared volume"


def claim_mounted_at(template: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The claim name of the volume `container` mounts at `path`."""
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    [volume] = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume["persistentVolumeClaim"]["claimName"]


def test_run_folders_stay_in_the_data_volume(docs) -> None:
    template = by_kind(docs, "Deployment")["coordinator"]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    root = env_of(container)["DOCKYARD_COORDINATOR_RUN_ROOT"]
    assert {"name": "data", "mountPath": root} in container["volumeMounts"], container["volumeMounts"]


def test_the_endpoint_reads_run_and_model_folders_where_the_coordinator_puts_them(docs) -> None:
    deployments = by_kind(docs, "Deployment")
    coordinator_template = deployments["coordinator"]["spec"]["template"]
    (coordinator,) = coordinator_template["spec"]["containers"]
    root = env_of(coordinator)["DOCKYARD_COORDINATOR_RUN_ROOT"]
    template = deployments["endpoint"]["spec"]["template"]
    (endpoint,) = template["spec"]["containers"]
    # A job's run_dir is a folder inside the coordinator's run root: the same claim at the same path.
    assert env_of(endpoint)["DOCKYARD_ENDPOINT_RUN_ROOT"] == root
    assert claim_mounted_at(template, endpoint, root) == claim_mounted_at(coordinator_template, coordinator, root)
    # Relative policy folders (the tokenizer) resolve in the working directory: the image's, unless set.
    dockerfile = (K8S.parent / "images" / "endpoint" / "Dockerfile").read_text()
    workdir = endpoint.get("workingDir") or re.findall(r"^WORKDIR\s+(\S+)", dockerfile, re.MULTILINE)[-1]
    assert Path(workdir).is_relative_to(root), f"the endpoint runs in {workdir}, outside the data volume {root}"
    [mount] = [m for m in endpoint["volumeMounts"] if m["mountPath"] == root]
    assert mount.get("readOnly") is True, "the endpoint only reads the data volume"
