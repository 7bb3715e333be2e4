"""The Helm chart rendered by Helm's own Go SDK (helm-python-sdk), linted, and every manifest
checked against the Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail)."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "hpu-serve"
K8S_VERSION = "1.33.0"
VALUES_FILES = {"default": None, "all-on": CHART / "ci" / "all-on-values.yaml",
                "cpu": CHART / "ci" / "cpu-values.yaml"}


def load_values(name: str) -> dict:
    path = VALUES_FILES[name]
    return yaml.safe_load(path.read_text()) if path else {}


def render(values: dict) -> dict[str, dict]:
    """kind -> manifest (the chart renders at most one of each kind)."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="demo", namespace="serving")
    docs: dict[str, dict] = {}
    for name, text in files.items():
        if not name.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert doc["kind"] not in docs, f"two {doc['kind']} manifests"
                docs[doc["kind"]] = doc
    return docs


@pytest.fixture(scope="module", params=list(VALUES_FILES))
def rendered(request) -> tuple[str, dict[str, dict]]:
    return request.param, render(load_values(request.param))


def container(docs: dict[str, dict]) -> dict:
    return docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def env_of(docs: dict[str, dict]) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(docs)["env"]}


def test_lint_is_clean() -> None:
    result = helm.lint(str(CHART))
    assert result["total_charts_linted"] == 1
    assert result["errors"] == []
    assert result["messages"] == []


def test_every_manifest_is_valid_kubernetes(rendered) -> None:
    name, docs = rendered
    expected = {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget"}
    if name == "all-on":
        expected |= {"ConfigMap", "Secret", "HorizontalPodAutoscaler", "ServiceMonitor"}
    assert set(docs) == expected
    for kind, doc in docs.items():
        if kind == "ServiceMonitor":  # a CRD: no schema in kubernetes-validate
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_probes_and_security(rendered) -> None:
    name, docs = rendered
    values = load_values(name)
    c = container(docs)
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 600  # load + warmup before the port opens
    if name == "default":
        assert budget == 1800
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    port = c["ports"][0]
    assert port["name"] == "http"
    assert port["containerPort"] == values.get(
        "service", {}).get("port", 8000)
    assert c["args"][c["args"].index("--port") + 1] == str(port["containerPort"])
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/cache", "/tmp"} <= mounts  # writable places under a read-only root
    assert pod["terminationGracePeriodSeconds"] > float(
        c["args"][c["args"].index("--shutdown-timeout") + 1])


def test_gaudi_resource_only_on_hpu(rendered) -> None:
    name, docs = rendered
    c = container(docs)
    limits = c["resources"].get("limits", {})
    if name == "cpu":
        assert "habana.ai/gaudi" not in limits
        assert "VLLM_CPU_KVCACHE_SPACE" in env_of(docs)
        assert "HABANA_VISIBLE_DEVICES" not in env_of(docs)
    else:
        cards = load_values(name).get("gaudi", {}).get("cards", 1)
        assert limits["habana.ai/gaudi"] == cards == c["resources"]["requests"]["habana.ai/gaudi"]
        assert env_of(docs)["HABANA_VISIBLE_DEVICES"] == "all"
        assert "/dev/shm" in {m["mountPath"] for m in c["volumeMounts"]}


def test_all_on_values_reach_the_daemon() -> None:
    values = load_values("all-on")
    docs = render(values)
    c, env = container(docs), env_of(docs)
    args = c["args"]
    assert args[0] == "/models/Llama-3.1-70B-Instruct"
    flags = {"--max-model-len": "8192", "--max-num-seqs": "128", "--block-size": "128",
             "--gpu-memory-utilization": "0.85", "--max-num-batched-tokens": "8192",
             "--num-gpu-blocks-override": "4096", "--served-model-name": "llama-3.1-70b",
             "--dtype": "bfloat16", "--execution-mode": "graphs", "--max-waiting-requests": "512"}
    for flag, value in flags.items():
        assert args[args.index(flag) + 1] == value, flag
    assert "--enforce-eager" in args
    assert args[-2:] == ["--seed", "7"]
    # every warmup / graph-memory / bucketing knob, under vLLM's names
    knobs = {"VLLM_SKIP_WARMUP": "false", "VLLM_GRAPH_RESERVED_MEM": "0.2",
             "VLLM_GRAPH_PROMPT_RATIO": "0.5", "VLLM_GRAPH_PROMPT_STRATEGY": "max_bs",
             "VLLM_GRAPH_DECODE_STRATEGY": "min_tokens", "PT_HPU_LAZY_MODE": "0",
             "VLLM_ENABLE_BUCKETING": "true", "VLLM_BUCKETING_STRATEGY": "lin",
             "VLLM_BUCKETING_FROM_FILE": "/etc/hpu-serve/buckets.txt"}
    b = values["bucketing"]
    for phase, dims in (("prompt", ("bs", "seq")), ("decode", ("bs", "block"))):
        for dim in dims:
            for edge in ("min", "step", "max"):
                knobs[f"VLLM_{phase.upper()}_{dim.upper()}_BUCKET_{edge.upper()}"] = str(
                    b[phase][dim][edge])
    assert {k: env.get(k) for k in knobs} == knobs
    # the bucket file is the ConfigMap's content, mounted where the env var points
    assert docs["ConfigMap"]["data"]["buckets.txt"].strip() == b["fromFile"].strip()
    # API key from a Secret, never as a literal env value
    assert env["VLLM_API_KEY"] == {"secretKeyRef": {"name": "llama-gaudi-api-key",
                                                    "key": "token"}}
    assert docs["Secret"]["metadata"]["name"] == "llama-gaudi-api-key"
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "model-weights",
                                                          "readOnly": True}
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == "hpu-recipe-cache"
    assert pod["nodeSelector"]
    assert pod["tolerations"]
    assert pod["affinity"]
    assert "replicas" not in docs["Deployment"]["spec"]  # the HPA owns it
    metric = docs["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric == "vllm_num_requests_waiting"
    # the ServiceMonitor scrapes the Service's named port
    monitor = docs["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"][0]["port"] == docs["Service"]["spec"]["ports"][0]["name"]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= docs["Service"][
        "metadata"]["labels"].items()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_model_sources() -> None:
    host = render(load_values("cpu"))
    pod = host["Deployment"]["spec"]["template"]["spec"]
    assert container(host)["args"][0] == "/models/smollm2.gguf"
    assert {v["name"]: v for v in pod["volumes"]}["models"]["hostPath"]["path"] == "/srv/models"
    default = render({})
    assert container(default)["args"][0] == "--port"  # no model argument: embedded default
    assert "models" not in {v["name"] for v in default["Deployment"]["spec"]["template"][
        "spec"]["volumes"]}
    annotations = default["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize(("bad", "message"), [
    ({"replicaCount": "two"}, "/replicaCount"),
    ({"device": "gpu"}, "/device"),
    ({"engine": {"maxNumSeqs": 0}}, "/engine/maxNumSeqs"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "/engine/gpuMemoryUtilization"),
    ({"bucketing": {"prompt": {"bs": {"min": "one"}}}}, "/bucketing/prompt/bs/min"),
    ({"warmup": {"skip": "yes"}}, "/warmup/skip"),
    ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
    ({"compileCache": {"type": "pvc"}}, "/compileCache/claimName"),
    ({"startupProbe": {"failureThreshold": 0}}, "/startupProbe/failureThreshold"),
    ({"replicas": 2}, "replicas"),  # a typo is an error, not a silently ignored key
])
def test_bad_values_are_rejected_at_install_time(bad: dict, message: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError) as info:
        chart.render(bad, name="demo", namespace="serving")
    assert message in str(info.value)
