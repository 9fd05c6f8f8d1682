"""The Helm chart in helm/elastic-train, rendered by the real Helm engine.

Helm runs in-process through helm-python-sdk (Helm's Go SDK behind a C ABI); every
rendered manifest is checked against the Kubernetes 1.32 schemas with kubernetes-validate
(strict: unknown fields are errors). The RayCluster is a custom resource with no schema
there: its key fields are checked here, and its pod templates are validated as Kubernetes
PodTemplates. Offline, no cluster, a few seconds.
"""

from __future__ import annotations

import base64
import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from jobs.launcher import FAST_FAILURE_DETECTION, worker_setup
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "elastic-train"
RELEASE = "etrain"
NAMESPACE = "ml"
KUBE_VERSION = "1.32"
FULLNAME = "etrain-elastic-train"
RAY_CLUSTER = f"{FULLNAME}-ray"
HEAD_SVC = f"{RAY_CLUSTER}-head-svc"
RAY_PORTS = {6379, 8265, 10001}
CRD_KINDS = {("ray.io/v1", "RayCluster")}

API_LABELS = {
    "app.kubernetes.io/name": "elastic-train",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/component": "api",
}
RAY_LABELS = {**API_LABELS, "app.kubernetes.io/component": "ray"}

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
CPU_RESOURCES = {
    "requests": {"cpu": "4", "memory": "8Gi"},
    "limits": {"cpu": "4", "memory": "8Gi"},
}
GPU_RESOURCES = {
    "requests": {"cpu": "8", "memory": "32Gi"},
    "limits": {"cpu": "8", "memory": "32Gi"},
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "kuberay-gpu": {
        "ray": {
            "kuberay": {
                "workerGroups": [
                    {
                        "name": "cpu",
                        "replicas": 1,
                        "minReplicas": 1,
                        "maxReplicas": 3,
                        "resources": CPU_RESOURCES,
                    },
                    {
                        "name": "gpu",
                        "replicas": 0,
                        "minReplicas": 0,
                        "maxReplicas": 2,
                        "gpus": 1,
                        "image": {"tag": "0.1.0-cuda"},
                        "resources": GPU_RESOURCES,
                        "shmSize": "8Gi",
                        "nodeSelector": {"nvidia.com/gpu.present": "true"},
                        "tolerations": [GPU_TOLERATION],
                    },
                ]
            }
        }
    },
    "external-ray": {
        "ray": {
            "mode": "external",
            "external": {
                "address": "ray://raycluster-head-svc.ray.svc:10001",
                "authTokenSecret": {"name": "ray-token", "key": "auth_token"},
            },
        },
        # The external cluster mounts the same ReadWriteMany claim at the same path.
        "checkpoints": {"persistence": {"existingClaim": "shared-checkpoints"}},
    },
    "postgres-secret": {
        "database": {"existingSecret": "etrain-pg", "existingSecretKey": "url"},
    },
    "ingress": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "hosts": [
                {"host": "train.example.org", "paths": [{"path": "/", "pathType": "Prefix"}]}
            ],
            "tls": [{"secretName": "train-tls", "hosts": ["train.example.org"]}],
        }
    },
    "three-replicas": {
        "replicaCount": 3,
        "database": {"existingSecret": "etrain-pg"},
    },
}

# What each value set renders: (kind, name) of every object, exactly.
COMMON = {
    ("Deployment", FULLNAME),
    ("Service", FULLNAME),
    ("ServiceAccount", FULLNAME),
    ("Secret", f"{FULLNAME}-api-token"),
}
KUBERAY = {
    ("RayCluster", RAY_CLUSTER),
    ("Secret", RAY_CLUSTER),
    ("NetworkPolicy", f"{FULLNAME}-ray"),
    ("PersistentVolumeClaim", f"{FULLNAME}-checkpoints"),
}
DATA_PVC = {("PersistentVolumeClaim", f"{FULLNAME}-data")}
EXPECTED_OBJECTS = {
    "defaults": COMMON | KUBERAY | DATA_PVC,
    "kuberay-gpu": COMMON | KUBERAY | DATA_PVC,
    "external-ray": COMMON | DATA_PVC,
    "postgres-secret": COMMON | KUBERAY,
    "ingress": COMMON | KUBERAY | DATA_PVC | {("Ingress", FULLNAME)},
    "three-replicas": COMMON | KUBERAY | {("PodDisruptionBudget", FULLNAME)},
}


# ---------------------------------------------------------------- rendering helpers


def _render(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(
            copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True
        )


def _objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


@cache
def _rendered_set(name: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    rendered = _render(VALUE_SETS[name])
    return rendered, _objects(rendered)


def objects_of(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(_rendered_set(name)[1])


def notes_of(name: str) -> str:
    rendered = _rendered_set(name)[0]
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def render_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return _objects(_render(values))


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def kinds(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def api_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["api"]
    return pod["containers"][0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env vars: {names}"
    return {e["name"]: e for e in container.get("env", [])}


def ray_pod_specs(cluster: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = cluster["spec"]
    pods = [("head", spec["headGroupSpec"]["template"])]
    pods += [(g["groupName"], g["template"]) for g in spec["workerGroupSpecs"]]
    return pods


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def schema_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmValuesError) as caught:
        _render(values)
    return str(caught.value)


def render_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmRenderError) as caught:
        _render(values)
    return str(caught.value)


# ---------------------------------------------------------------- every value set


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_lint_reports_no_errors(name: str) -> None:
    report = helm.lint(CHART, copy.deepcopy(VALUE_SETS[name]), strict=True, kube_version="v1.32.0")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_renders_exactly_the_expected_objects(name: str) -> None:
    objects = objects_of(name)
    found = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(found) == len(set(found)), f"an object is rendered twice: {found}"
    assert set(found) == EXPECTED_OBJECTS[name]


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_manifest_validates_against_kubernetes_schemas(name: str) -> None:
    checked = 0
    for obj in objects_of(name):
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            # No Kubernetes schema for a custom resource: validate what it embeds instead.
            for _, template in ray_pod_specs(obj):
                pod_template = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "ray-pod"},
                    "template": template,
                }
                kubernetes_validate.validate(pod_template, KUBE_VERSION, strict=True)
                checked += 1
            continue
        assert kubernetes_validate.validate(obj, KUBE_VERSION, strict=True) == KUBE_VERSION
        checked += 1
    assert checked >= len(EXPECTED_OBJECTS[name])


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_deployment_sets_only_settings_the_service_defines(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = set(Settings.model_fields)
    env = env_of(api_container(objects_of(name)))
    etrain = {n for n in env if n.startswith("ETRAIN_")}
    unknown = {n for n in etrain if n.removeprefix("ETRAIN_").lower() not in fields}
    assert unknown == set(), f"the chart sets ETRAIN_ variables the service lacks: {unknown}"
    # Always set, in every value set.
    assert {
        "ETRAIN_HOST",
        "ETRAIN_PORT",
        "ETRAIN_DATA_DIR",
        "ETRAIN_API_TOKEN",
        "ETRAIN_RAY_NAMESPACE",
        "ETRAIN_RAY_ADDRESS",
        "ETRAIN_CHECKPOINT_DIR",
        "ETRAIN_EVENT_POLL_INTERVAL_S",
        "ETRAIN_LOG_LEVEL",
    } <= etrain
    # And the service reads each literal value as the chart means it.
    for var, entry in env.items():
        if var.startswith("ETRAIN_") and "value" in entry:
            monkeypatch.setenv(var, entry["value"])
    settings = Settings()
    assert settings.host == "0.0.0.0"
    assert settings.port == 8000
    assert str(settings.data_dir) == "/var/lib/etrain"
    assert settings.ray_address == env["ETRAIN_RAY_ADDRESS"]["value"]
    assert settings.ray_namespace == "elastic-train"
    assert settings.event_poll_interval_s == 0.5


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_object_carries_the_recommended_labels(name: str) -> None:
    for obj in objects_of(name):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "elastic-train"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/part-of"] == "elastic-train"
        assert labels["app.kubernetes.io/component"] in {"api", "ray", "checkpoints"}
        assert labels["helm.sh/chart"] == "elastic-train-0.1.0"


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_no_service_exposes_a_ray_port_outside_the_cluster(name: str) -> None:
    objects = objects_of(name)
    for svc in kinds(objects, "Service"):
        assert not selects(svc["spec"]["selector"], RAY_LABELS)
        if svc["spec"].get("type") in {"LoadBalancer", "NodePort"}:
            for port in svc["spec"]["ports"]:
                assert port["port"] not in RAY_PORTS
                assert port["targetPort"] not in RAY_PORTS
    for cluster in kinds(objects, "RayCluster"):
        assert cluster["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    for ingress in kinds(objects, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"] != HEAD_SVC


# ---------------------------------------------------------------- the API pod


def test_api_pod_is_hardened_and_probed() -> None:
    objects = objects_of("defaults")
    deployment = one(objects, "Deployment", FULLNAME)
    pod = deployment["spec"]["template"]["spec"]
    container = api_container(objects)

    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # RWO SQLite volume
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == FULLNAME
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["command"] == ["etrain", "serve"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert set(container["resources"]) == {"requests", "limits"}
    assert set(container["resources"]["limits"]) == {"cpu", "memory"}

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"tmp": "/tmp", "data": "/var/lib/etrain", "checkpoints": "/mnt/checkpoints"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["tmp"]
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": f"{FULLNAME}-data"}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {
        "claimName": f"{FULLNAME}-checkpoints"
    }

    env = env_of(container)
    assert env["ETRAIN_HOST"]["value"] == "0.0.0.0"
    assert env["ETRAIN_PORT"]["value"] == "8000"
    assert env["ETRAIN_DATA_DIR"]["value"] == "/var/lib/etrain"
    assert env["ETRAIN_CHECKPOINT_DIR"]["value"] == "/mnt/checkpoints"
    assert env["ETRAIN_RAY_NAMESPACE"]["value"] == "elastic-train"
    assert env["ETRAIN_RAY_ADDRESS"]["value"] == f"ray://{HEAD_SVC}.{NAMESPACE}.svc:10001"
    assert "ETRAIN_DATABASE_URL" not in env  # SQLite under the data dir


def test_api_token_secret_is_generated_and_wired() -> None:
    objects = objects_of("defaults")
    secret = one(objects, "Secret", f"{FULLNAME}-api-token")
    token = base64.b64decode(secret["data"]["api-token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    env = env_of(api_container(objects))
    assert env["ETRAIN_API_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": f"{FULLNAME}-api-token", "key": "api-token"}
    }
    assert "api-token" in notes_of("defaults")
    assert f"kubectl get secret -n {NAMESPACE} {FULLNAME}-api-token" in notes_of("defaults")


def test_api_token_from_an_existing_secret() -> None:
    objects = render_objects({"auth": {"existingSecret": "my-token", "existingSecretKey": "tok"}})
    assert [s["metadata"]["name"] for s in kinds(objects, "Secret")] == [RAY_CLUSTER]
    env = env_of(api_container(objects))
    assert env["ETRAIN_API_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "my-token", "key": "tok"}
    }


def test_api_token_given_in_values() -> None:
    objects = render_objects({"auth": {"token": "s3cr3t-token"}})
    secret = one(objects, "Secret", f"{FULLNAME}-api-token")
    assert base64.b64decode(secret["data"]["api-token"]) == b"s3cr3t-token"


def test_service_targets_the_api_port_only() -> None:
    svc = one(objects_of("defaults"), "Service", FULLNAME)
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == API_LABELS
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]


def test_ingress_routes_to_the_api_service() -> None:
    ingress = one(objects_of("ingress"), "Ingress", FULLNAME)
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "train-tls", "hosts": ["train.example.org"]}]
    assert ingress["spec"]["rules"] == [
        {
            "host": "train.example.org",
            "http": {
                "paths": [
                    {
                        "path": "/",
                        "pathType": "Prefix",
                        "backend": {"service": {"name": FULLNAME, "port": {"number": 8000}}},
                    }
                ]
            },
        }
    ]
    assert "https://train.example.org/" in notes_of("ingress")


def test_three_replicas_get_a_disruption_budget() -> None:
    objects = objects_of("three-replicas")
    deployment = one(objects, "Deployment", FULLNAME)
    pdb = one(objects, "PodDisruptionBudget", FULLNAME)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == API_LABELS
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert kinds(objects_of("defaults"), "PodDisruptionBudget") == []


def test_sqlite_refuses_more_than_one_replica() -> None:
    message = render_error({"replicaCount": 2})
    assert (
        "replicaCount is 2 but the store is SQLite, which allows one replica only: "
        "set database.url or database.existingSecret (PostgreSQL) to run more than one."
    ) in message


def test_postgres_from_an_existing_secret() -> None:
    objects = objects_of("postgres-secret")
    container = api_container(objects)
    env = env_of(container)
    assert env["ETRAIN_DATABASE_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "etrain-pg", "key": "url"}
    }
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    assert kinds(objects, "PersistentVolumeClaim") == [
        one(objects, "PersistentVolumeClaim", f"{FULLNAME}-checkpoints")
    ]


def test_postgres_url_in_values_goes_to_a_secret() -> None:
    url = "postgresql+psycopg://etrain:pw@db.ml.svc:5432/etrain"
    objects = render_objects({"database": {"url": url}})
    secret = one(objects, "Secret", f"{FULLNAME}-database")
    assert base64.b64decode(secret["data"]["database-url"]).decode() == url
    env = env_of(api_container(objects))
    assert env["ETRAIN_DATABASE_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": f"{FULLNAME}-database", "key": "database-url"}
    }
    assert url not in yaml.safe_dump(one(objects, "Deployment"))


def test_entrypoint_modules_reach_the_service_as_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    objects = render_objects({"entrypointModules": ["mycorp.train", "lab_models"]})
    value = env_of(api_container(objects))["ETRAIN_ENTRYPOINT_MODULES"]["value"]
    monkeypatch.setenv("ETRAIN_ENTRYPOINT_MODULES", value)
    assert Settings().entrypoint_modules == ["mycorp.train", "lab_models"]
    assert "ETRAIN_ENTRYPOINT_MODULES" not in env_of(api_container(objects_of("defaults")))
    message = schema_error({"entrypointModules": ["os; rm -rf /"]})
    assert "at '/entrypointModules/0': 'os; rm -rf /' does not match pattern" in message


def test_extra_env_cannot_override_a_chart_setting() -> None:
    message = render_error({"extraEnv": [{"name": "ETRAIN_PORT", "value": "9000"}]})
    assert "extraEnv sets ETRAIN_PORT, which the chart sets itself from its values" in message


# ---------------------------------------------------------------- the Ray cluster


def test_raycluster_defaults() -> None:
    objects = objects_of("defaults")
    cluster = one(objects, "RayCluster", RAY_CLUSTER)
    spec = cluster["spec"]
    pinned = re.search(r"^ray==([0-9.]+)", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None
    assert spec["rayVersion"].startswith(pinned.group(1).rstrip("."))
    assert spec["authOptions"] == {"mode": "token", "secretName": RAY_CLUSTER}
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["securityContext"]["allowPrivilegeEscalation"] is False

    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["rayStartParams"] == {"dashboard-host": "0.0.0.0"}
    head_container = head["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in head_container["ports"]} == {
        "gcs-server": 6379,
        "dashboard": 8265,
        "client": 10001,
    }

    groups = spec["workerGroupSpecs"]
    assert [
        (g["groupName"], g["replicas"], g["minReplicas"], g["maxReplicas"]) for g in groups
    ] == [("cpu", 1, 0, 4)]

    token_secret = one(objects, "Secret", RAY_CLUSTER)
    token = base64.b64decode(token_secret["data"]["auth_token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)

    for group, template in ray_pod_specs(cluster):
        pod = template["spec"]
        assert selects(RAY_LABELS, template["metadata"]["labels"]), group
        assert not selects(API_LABELS, template["metadata"]["labels"]), group
        assert pod["securityContext"]["runAsNonRoot"] is True, group
        assert pod["securityContext"]["fsGroup"] == 1000, group
        container = pod["containers"][0]
        assert container["image"] == "elastic-train:0.1.0", group
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, group
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, group
        assert set(container["resources"]) == {"requests", "limits"}, group
        assert {"cpu", "memory"} <= set(container["resources"]["limits"]), group
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts == {
            "tmp": "/tmp",
            "dshm": "/dev/shm",
            "checkpoints": "/mnt/checkpoints",
        }, group
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["checkpoints"]["persistentVolumeClaim"] == {
            "claimName": f"{FULLNAME}-checkpoints"
        }, group
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory", group
        env = env_of(container)
        assert env["RAY_AUTH_MODE"]["value"] == "token", group
        # A lost node is declared dead as fast as on the service's own Ray.
        assert {
            name.removeprefix("RAY_"): int(env[name]["value"])
            for name in env
            if name.startswith("RAY_health_check_")
        } == FAST_FAILURE_DETECTION, group
        # Its worker processes start with the same set-up hook as the service's own Ray's.
        assert {name: env[name]["value"] for name in worker_setup()} == worker_setup(), group
        assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": RAY_CLUSTER, "key": "auth_token"}
        }, group

    # The service gets the same token, and the checkpoint volume at the same path.
    api_env = env_of(api_container(objects))
    assert api_env["RAY_AUTH_MODE"]["value"] == "token"
    assert api_env["RAY_AUTH_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": RAY_CLUSTER, "key": "auth_token"}
    }
    pvc = one(objects, "PersistentVolumeClaim", f"{FULLNAME}-checkpoints")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"


def test_raycluster_with_a_gpu_worker_group() -> None:
    cluster = one(objects_of("kuberay-gpu"), "RayCluster", RAY_CLUSTER)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert list(groups) == ["cpu", "gpu"]
    sizes = {n: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for n, g in groups.items()}
    assert sizes == {"cpu": (1, 1, 3), "gpu": (0, 0, 2)}

    cpu_pod = groups["cpu"]["template"]["spec"]
    gpu_pod = groups["gpu"]["template"]["spec"]
    cpu = cpu_pod["containers"][0]
    gpu = gpu_pod["containers"][0]
    assert cpu["image"] == "elastic-train:0.1.0"
    assert gpu["image"] == "elastic-train:0.1.0-cuda"
    assert cpu["resources"] == CPU_RESOURCES
    assert gpu["resources"] == {
        "requests": {"cpu": "8", "memory": "32Gi"},
        "limits": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 1},
    }
    assert "tolerations" not in cpu_pod
    assert "nodeSelector" not in cpu_pod
    assert gpu_pod["tolerations"] == [GPU_TOLERATION]
    assert gpu_pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    gpu_volumes = {v["name"]: v for v in gpu_pod["volumes"]}
    assert gpu_volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    for pod in (cpu_pod, gpu_pod):
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["checkpoints"] == "/mnt/checkpoints"


def test_network_policy_admits_only_the_service_and_ray_pods() -> None:
    objects = objects_of("defaults")
    policies = kinds(objects, "NetworkPolicy")
    assert len(policies) == 1
    policy = policies[0]["spec"]
    assert policy["podSelector"] == {"matchLabels": RAY_LABELS}
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": RAY_LABELS}}]},
        {
            "from": [{"podSelector": {"matchLabels": API_LABELS}}],
            "ports": [
                {"port": 10001, "protocol": "TCP"},
                {"port": 6379, "protocol": "TCP"},
                {"port": 8265, "protocol": "TCP"},
            ],
        },
    ]
    # The selectors match the pods the chart makes, and only those.
    api_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selects(API_LABELS, api_labels)
    assert not selects(RAY_LABELS, api_labels)
    for _, template in ray_pod_specs(one(objects, "RayCluster")):
        assert selects(policy["podSelector"]["matchLabels"], template["metadata"]["labels"])


def test_network_policy_with_a_full_driver_connection_admits_the_api_on_every_port() -> None:
    objects = render_objects({"ray": {"kuberay": {"connection": "gcs"}}})
    policy = one(objects, "NetworkPolicy")["spec"]
    assert policy["ingress"][1] == {"from": [{"podSelector": {"matchLabels": API_LABELS}}]}
    env = env_of(api_container(objects))
    assert env["ETRAIN_RAY_ADDRESS"]["value"] == f"{HEAD_SVC}.{NAMESPACE}.svc:6379"


def test_ray_dashboard_is_exposed_only_when_asked() -> None:
    assert all(
        not (
            o["kind"] == "Ingress"
            and any(
                p["backend"]["service"]["name"] == HEAD_SVC
                for r in o["spec"]["rules"]
                for p in r["http"]["paths"]
            )
        )
        for name in VALUE_SETS
        for o in objects_of(name)
    )
    assert "port-forward -n ml svc/" + HEAD_SVC in notes_of("defaults")

    controller = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
    dashboard = {"ingress": {"enabled": True, "host": "ray.example.org"}}
    message = render_error({"ray": {"kuberay": {"dashboard": dashboard}}})
    assert "ray.kuberay.dashboard.allowFrom is empty" in message

    objects = render_objects(
        {"ray": {"kuberay": {"dashboard": {**dashboard, "allowFrom": [controller]}}}}
    )
    ingress = one(objects, "Ingress", f"{FULLNAME}-ray-dashboard")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend == {"service": {"name": HEAD_SVC, "port": {"number": 8265}}}
    rules = one(objects, "NetworkPolicy")["spec"]["ingress"]
    assert rules[-1] == {"from": [controller], "ports": [{"port": 8265, "protocol": "TCP"}]}
    # Behind Ray's own auth: token mode stays on.
    assert one(objects, "RayCluster")["spec"]["authOptions"]["mode"] == "token"


def test_existing_ray_token_secret() -> None:
    objects = render_objects({"ray": {"kuberay": {"auth": {"existingSecret": "ray-tok"}}}})
    assert one(objects, "RayCluster")["spec"]["authOptions"] == {
        "mode": "token",
        "secretName": "ray-tok",
    }
    assert [s["metadata"]["name"] for s in kinds(objects, "Secret")] == [f"{FULLNAME}-api-token"]
    assert env_of(api_container(objects))["RAY_AUTH_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "ray-tok", "key": "auth_token"}
    }


# ---------------------------------------------------------------- external and embedded Ray


def test_external_ray_address() -> None:
    objects = objects_of("external-ray")
    assert kinds(objects, "RayCluster") == []
    assert kinds(objects, "NetworkPolicy") == []
    env = env_of(api_container(objects))
    assert env["ETRAIN_RAY_ADDRESS"]["value"] == "ray://raycluster-head-svc.ray.svc:10001"
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "ray-token", "key": "auth_token"}
    }
    # Checkpoints on the claim the external cluster shares: the chart makes no claim of its own.
    assert env["ETRAIN_CHECKPOINT_DIR"]["value"] == "/mnt/checkpoints"
    mounts = {m["name"]: m["mountPath"] for m in api_container(objects)["volumeMounts"]}
    assert mounts == {"tmp": "/tmp", "data": "/var/lib/etrain", "checkpoints": "/mnt/checkpoints"}
    volumes = one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in volumes
        if "persistentVolumeClaim" in v
    }
    assert claims["checkpoints"] == "shared-checkpoints"
    assert "raycluster-head-svc.ray.svc:10001" in notes_of("external-ray")


def test_embedded_ray_is_one_pod() -> None:
    objects = render_objects({"ray": {"mode": "embedded", "embedded": {"numCpus": 4}}})
    assert kinds(objects, "RayCluster") == []
    env = env_of(api_container(objects))
    assert "ETRAIN_RAY_ADDRESS" not in env
    assert env["ETRAIN_RAY_NUM_CPUS"]["value"] == "4"
    assert "ETRAIN_RAY_NUM_GPUS" not in env
    fields = set(Settings.model_fields)
    assert {n.removeprefix("ETRAIN_").lower() for n in env if n.startswith("ETRAIN_")} <= fields
    mounts = {m["name"]: m["mountPath"] for m in api_container(objects)["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    message = render_error(
        {"ray": {"mode": "embedded"}, "replicaCount": 2, "database": {"url": "postgresql://db/x"}}
    )
    assert "replicaCount is 2 but ray.mode is embedded" in message


# ---------------------------------------------------------------- the schema


def test_schema_refuses_replicas_as_a_word() -> None:
    message = schema_error({"replicaCount": "two"})
    assert "at '/replicaCount': got string, want integer" in message


def test_schema_refuses_a_missing_image_repository() -> None:
    assert "at '/image': missing property 'repository'" in schema_error(
        {"image": {"repository": None}}
    )
    assert "at '/image/repository': minLength: got 0, want 1" in schema_error(
        {"image": {"repository": ""}}
    )


def test_schema_refuses_an_unknown_ray_mode() -> None:
    message = schema_error({"ray": {"mode": "slurm"}})
    assert "at '/ray/mode': value must be one of 'kuberay', 'external', 'embedded'" in message


def test_schema_refuses_external_mode_without_an_address() -> None:
    message = schema_error({"ray": {"mode": "external"}})
    assert "at '/ray/external/address': minLength: got 0, want 1" in message


def test_schema_refuses_a_misspelt_value() -> None:
    message = schema_error({"replicas": 2})
    assert "additional properties 'replicas' not allowed" in message


def test_lint_reports_a_schema_refusal() -> None:
    report = helm.lint(CHART, {"replicaCount": "two"})
    assert any("got string, want integer" in e for e in report["errors"])


# ---------------------------------------------------------------- values.yaml is documented


def test_every_value_is_documented() -> None:
    """Each key in values.yaml has a comment above it, or sits under a commented key."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    key = re.compile(r"^(\s*)(- )?([A-Za-z][\w.-]*):")
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    previous = ""
    for number, line in enumerate(lines, 1):
        match = key.match(line)
        if match:
            indent = len(match.group(1)) + (2 if match.group(2) else 0)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            commented = previous.lstrip().startswith("#")
            inherited = any(documented for _, documented in stack)
            if not (commented or inherited or match.group(2)):
                value = line.split(":", 1)[1].strip()
                if value:  # a leaf: it needs words of its own
                    undocumented.append(f"{number}: {line.strip()}")
            stack.append((indent, commented or inherited or bool(match.group(2))))
        if line.strip():
            previous = line
    assert undocumented == []
    # Every top-level key the schema knows is in values.yaml, and the reverse.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    with helm.Chart.load(CHART) as chart:
        schema = chart.schema
    assert schema is not None
    assert set(values) == set(schema["properties"]) - {"global"}
    assert set(schema["required"]) <= set(values)


def test_checkpoints_in_a_bucket_reach_the_service_and_every_ray_pod() -> None:
    """storageUri becomes ETRAIN_CHECKPOINT_DIR (the service writes there through
    pyarrow.fs: tests/integration/test_object_storage.py), the credentials Secret reaches
    the API and every Ray container, and no checkpoint volume is made or mounted."""
    for mode in ("kuberay", "external"):
        values: dict[str, Any] = {
            "ray": {"mode": mode, "external": {"address": "ray://head:10001"}},
            "checkpoints": {
                "storageUri": "s3://ckpt-bucket/elastic-train",
                "credentialsSecret": "ckpt-s3",
            },
        }
        objects = render_objects(values)
        api = api_container(objects)
        assert env_of(api)["ETRAIN_CHECKPOINT_DIR"]["value"] == "s3://ckpt-bucket/elastic-train"
        assert api["envFrom"] == [{"secretRef": {"name": "ckpt-s3"}}]
        assert "checkpoints" not in {m["name"] for m in api.get("volumeMounts", [])}
        claims = {o["metadata"]["name"] for o in kinds(objects, "PersistentVolumeClaim")}
        assert f"{FULLNAME}-checkpoints" not in claims
        if mode != "kuberay":
            continue
        for group, template in ray_pod_specs(one(objects, "RayCluster", RAY_CLUSTER)):
            (container,) = template["spec"]["containers"]
            assert container["envFrom"] == [{"secretRef": {"name": "ckpt-s3"}}], group
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert "checkpoints" not in mounts, group


def test_a_bucket_without_credentials_or_of_an_unknown_scheme_is_refused() -> None:
    message = render_error({"checkpoints": {"storageUri": "s3://ckpt-bucket/elastic-train"}})
    assert "checkpoints.credentialsSecret is empty" in message, message
    for uri in ("ftp://host/ckpt", "s3://", "/mnt/checkpoints"):
        message = schema_error({"checkpoints": {"storageUri": uri, "credentialsSecret": "ckpt-s3"}})
        assert "storageUri" in message, (uri, message)


def test_the_readme_values_example_renders() -> None:
    text = (ROOT / "helm" / "README.md").read_text()
    block = re.search(r"GPU workers and PostgreSQL:\n\n```yaml\n(.*?)```", text, re.S)
    assert block is not None
    objects = render_objects(yaml.safe_load(block.group(1)))
    cluster = one(objects, "RayCluster", RAY_CLUSTER)
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["image"] == "registry.example.com/elastic-train:0.1.0-cuda"
    assert one(objects, "Deployment")["spec"]["replicas"] == 2
    one(objects, "PodDisruptionBudget", FULLNAME)
