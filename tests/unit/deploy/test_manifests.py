"""deploy/k8s and deploy/ray: the manifests validate against the real schemas, and they wire
the plugin the way the rest of the project does.

Kubernetes objects are checked, strictly (unknown fields rejected), against the JSON schemas
that the PyPI package ``kubernetes-validate`` ships. The RayService's pod templates are checked
against the Kubernetes ``PodTemplateSpec`` schema the same way; the RayService itself against
the OpenAPI schema of KubeRay's CRD (``ray.io_rayservices.yaml``), which the project cannot
commit (it comes from the KubeRay repository): the test reads it from ``$KUBERAY_RAYSERVICE_CRD``
or ``../shared/kuberay/ray.io_rayservices.yaml`` and is skipped, saying so, without it.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from vllm_adaptive.config import parse_adaptive_config

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships
CRD_PATHS = [
    Path(os.environ.get("KUBERAY_RAYSERVICE_CRD", "/nonexistent")),
    REPO.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml",
]
MODEL_PATH = "/opt/vllm-adaptive/cache/models/smollm2-135m-instruct"
PLAIN = ["vllm-cpu.yaml", "vllm-gpu.yaml"]
RAY = ["rayservice-cpu.yaml", "rayservice-gpu.yaml"]


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


def _validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pod_template(template: dict[str, Any]) -> dict[str, Any]:
    """A PodTemplateSpec wrapped as a v1 PodTemplate, so the same validator checks it."""
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "t"},
        "template": template,
    }


def _entry_points() -> set[str]:
    """Names of the package's vLLM plugin entry points (what VLLM_PLUGINS may name)."""
    return {ep.name for ep in importlib.metadata.distribution("vllm-adaptive").entry_points}


@pytest.mark.parametrize("name", PLAIN)
def test_plain_manifests_valid(name: str) -> None:
    docs = _docs(name)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "Service"]
    for doc in docs:
        _validate(doc)


def test_validator_rejects_broken_manifests() -> None:
    """The schemas really bite: a misspelt field and a wrong type both fail."""
    deployment = _by_kind(_docs("vllm-cpu.yaml"))["Deployment"]
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for doc in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(doc)


@pytest.mark.parametrize("name", PLAIN)
def test_plain_deployment_wiring(name: str) -> None:
    kinds = _by_kind(_docs(name))
    config_map, deployment, service = kinds["ConfigMap"], kinds["Deployment"], kinds["Service"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]

    # the adaptive config: ConfigMap -> env -> --additional-config, and valid for the plugin
    args = container["args"]
    assert args[:3] == ["vllm", "serve", MODEL_PATH]
    assert args[args.index("--additional-config") + 1] == "$(VLLM_ADAPTIVE_CONFIG)"
    assert args[args.index("--port") + 1] == str(port)
    ref = env["VLLM_ADAPTIVE_CONFIG"]["valueFrom"]["configMapKeyRef"]
    assert ref["name"] == config_map["metadata"]["name"]
    additional = json.loads(config_map["data"][ref["key"]])
    parse_adaptive_config(additional["adaptive"])

    # every plugin named in VLLM_PLUGINS is one of the package's entry points
    plugins = env["VLLM_PLUGINS"]["value"].split(",")
    assert set(plugins) <= _entry_points()
    assert {"vllm_adaptive", "vllm_adaptive_metrics"} <= set(plugins)

    # readiness on /health, Prometheus on /metrics, both on the serving port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/path"] == "/metrics"
    assert notes["prometheus.io/port"] == str(port)

    # the Service reaches these pods on that port
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


@functools.cache
def _crd_schema() -> dict[str, Any]:
    for path in CRD_PATHS:
        if path.is_file():
            crd = yaml.safe_load(path.read_text())
            (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            return version["schema"]["openAPIV3Schema"]
    pytest.skip(
        "KubeRay's RayService CRD is not on this machine: put ray.io_rayservices.yaml "
        "(ray-project/kuberay, ray-operator/config/crd/bases/, tag v1.7.0) in "
        "../shared/kuberay/ or name it in $KUBERAY_RAYSERVICE_CRD"
    )


def _strict(schema: Any) -> Any:
    """Reject unknown fields, as kubernetes-validate's strict schemas do: every object schema
    that lists its properties and does not preserve unknown fields gets
    ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.mark.parametrize("name", RAY)
def test_rayservice_valid_against_kuberay_crd(name: str) -> None:
    validator = jsonschema.Draft7Validator(_strict(_crd_schema()))
    (doc,) = _docs(name)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert errors == []
    broken = copy.deepcopy(doc)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2
    assert list(validator.iter_errors(broken)), "the strict CRD schema accepts an unknown field"


@pytest.mark.parametrize("name", RAY)
def test_rayservice_pod_templates_valid(name: str) -> None:
    (doc,) = _docs(name)
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    cluster = doc["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]]
    templates += [group["template"] for group in cluster["workerGroupSpecs"]]
    for template in templates:
        _validate(_pod_template(template))


def test_rayservice_carries_the_tested_serve_config() -> None:
    """serveConfigV2 is deploy/ray/serve-config.yaml, which tests/slow/test_ray_serve.py
    deploys; the GPU variant differs only in the accelerator kind."""
    serve_config = yaml.safe_load((DEPLOY / "ray" / "serve-config.yaml").read_text())
    (cpu,) = _docs("rayservice-cpu.yaml")
    assert yaml.safe_load(cpu["spec"]["serveConfigV2"]) == serve_config
    (gpu,) = _docs("rayservice-gpu.yaml")
    gpu_config = yaml.safe_load(gpu["spec"]["serveConfigV2"])
    (llm,) = gpu_config["applications"][0]["args"]["llm_configs"]
    assert llm["accelerator_config"] == {"kind": "gpu"}
    llm["accelerator_config"] = {"kind": "cpu"}
    assert gpu_config == serve_config


def test_serve_config_wiring() -> None:
    (app,) = yaml.safe_load((DEPLOY / "ray" / "serve-config.yaml").read_text())["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    (llm,) = app["args"]["llm_configs"]
    assert llm["model_loading_config"]["model_source"] == MODEL_PATH
    assert set(llm["runtime_env"]["env_vars"]["VLLM_PLUGINS"].split(",")) <= _entry_points()
    parse_adaptive_config(llm["engine_kwargs"]["additional_config"]["adaptive"])
    module, _, cls = llm["callback_config"]["callback_class"].partition(":")
    assert (module, cls) == ("vllm_adaptive.engine.ray_serve", "ReplicaCpuBinding")
    assert (REPO / (module.replace(".", "/") + ".py")).is_file()


def _without(doc: Any, keys: set[str]) -> Any:
    if isinstance(doc, dict):
        return {k: _without(v, keys) for k, v in doc.items() if k not in keys}
    if isinstance(doc, list):
        return [_without(v, keys) for v in doc]
    return doc


@pytest.mark.parametrize("cpu_name,gpu_name", [PLAIN, RAY])
def test_gpu_variant_differs_only_in_image_and_resources(cpu_name: str, gpu_name: str) -> None:
    cpu, gpu = _docs(cpu_name), _docs(gpu_name)
    for doc in cpu + gpu:  # the serve config is compared in its own test
        doc.get("spec", {}).pop("serveConfigV2", None)
    assert _without(cpu, {"image", "resources"}) == _without(gpu, {"image", "resources"})
    images = {c["image"] for d in gpu for c in _containers(d)}
    assert images == {"vllm-adaptive:0.1.0-gpu"}
    gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for d in gpu for c in _containers(d)]
    assert "1" in gpus


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {})
    if "template" in spec:
        return spec["template"]["spec"]["containers"]
    if "rayClusterConfig" in spec:
        cluster = spec["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        return [c for g in groups for c in g["template"]["spec"]["containers"]]
    return []
