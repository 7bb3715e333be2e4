"""The Helm chart rendered by Helm's own Go SDK (helm-python-sdk), linted, and every manifest
checked against the Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail)."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "hpu-serve"
K8S_VERSION = "1.33.0"
VALUES_FILES = {"default": None, "all-on": CHART / "ci" / "all-on-values.yaml",
                "cpu": CHART / "ci" / "cpu-values.yaml", "tp8": CHART / "ci" / "tp8-values.yaml",
                "multihost": CHART / "ci" / "multihost-values.yaml"}
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


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


def pod_template(docs: dict[str, dict], role: str = "leader") -> dict:
    """The serving pod's template: the Deployment's, or the LeaderWorkerSet's leader (or worker)."""
    if "LeaderWorkerSet" in docs:
        return docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"][f"{role}Template"]
    return docs["Deployment"]["spec"]["template"]


def container(docs: dict[str, dict], role: str = "leader") -> dict:
    return pod_template(docs, role)["spec"]["containers"][0]


def expected_cards(values: dict) -> int:
    """habana.ai/gaudi per pod: gaudi.cards, else the resource limit, else one per rank."""
    given = values.get("gaudi", {}).get("cards") or values.get("resources", {}).get(
        "limits", {}).get("habana.ai/gaudi")
    if given:
        return int(given)
    multi = values.get("multiHost", {})
    size = multi.get("size", 2) if multi.get("enabled") else 1
    return values.get("tensorParallelSize", 1) // size


def env_of(docs: dict[str, dict]) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(docs)["env"]}


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_lint_is_clean(name: str) -> None:
    result = helm.lint(str(CHART), load_values(name) or None, strict=True)
    assert result["total_charts_linted"] == 1
    assert result["errors"] == []
    assert result["messages"] == []


def test_every_manifest_is_valid_kubernetes(rendered) -> None:
    name, docs = rendered
    expected = {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget"}
    if name == "all-on":
        expected |= {"ConfigMap", "Secret", "HorizontalPodAutoscaler", "ServiceMonitor"}
    if name == "multihost":  # the LeaderWorkerSet replaces the Deployment
        expected = expected - {"Deployment"} | {"LeaderWorkerSet", "ServiceMonitor"}
    assert set(docs) == expected
    for kind, doc in docs.items():
        if kind in ("ServiceMonitor", "LeaderWorkerSet"):  # CRDs: no schema in kubernetes-validate
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if "LeaderWorkerSet" in docs:  # its two pod templates are plain PodTemplateSpecs
        for role in ("leader", "worker"):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": role},
                                          "template": pod_template(docs, role)},
                                         K8S_VERSION, strict=True)


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
        scheme = {"scheme": "HTTPS"} if values.get("tls", {}).get("secretName") else {}
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http", **scheme}
    port = c["ports"][0]
    assert port["name"] == "http"
    assert port["containerPort"] == values.get(
        "service", {}).get("port", 8000)
    assert c["args"][c["args"].index("--port") + 1] == str(port["containerPort"])
    pod = pod_template(docs)["spec"]
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
        cards = expected_cards(load_values(name))
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


def test_log_format_reaches_the_daemon() -> None:
    for value in ("text", "json"):
        multi = {"multiHost": {"enabled": True}, "tensorParallelSize": 2}
        for docs in (render({"logFormat": value}), render({"logFormat": value, **multi})):
            args = container(docs)["args"]  # the serving container, leader of a group too
            assert args[args.index("--log-format") + 1] == value
    args = container(render({}))["args"]
    assert args[args.index("--log-format") + 1] == "text"  # the daemon's default
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError) as info:
        chart.render({"logFormat": "xml"}, name="demo", namespace="serving")
    assert "/logFormat" in str(info.value)


def test_tracing_endpoint_reaches_the_daemon() -> None:
    """tracing.otlpEndpoint: the flag and the exporter's OTEL_* settings; unset: neither."""
    docs = render(load_values("all-on"))
    args, env = container(docs)["args"], env_of(docs)
    assert flag(args, "--otlp-traces-endpoint") == "http://otel-collector.observability:4317"
    assert {k: v for k, v in env.items() if k.startswith("OTEL_")} == {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",
        "OTEL_SERVICE_NAME": "llama-gaudi-serve"}
    http = render({"tracing": {"otlpEndpoint": "http://collector:4318/v1/traces",
                               "protocol": "http/protobuf", "insecure": False}})
    assert flag(container(http)["args"], "--otlp-traces-endpoint") == \
        "http://collector:4318/v1/traces"
    assert env_of(http)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env_of(http)["OTEL_SERVICE_NAME"] == "demo-hpu-serve"  # the release's full name
    off = render({})
    assert "--otlp-traces-endpoint" not in container(off)["args"]
    assert not any(k.startswith("OTEL_") for k in env_of(off))
    # multi-host: the leader serves and traces; the workers only hold ranks
    multi = render(dict(load_values("multihost"), tracing={"otlpEndpoint": "http://c:4317"}))
    assert flag(container(multi, "leader")["args"], "--otlp-traces-endpoint") == "http://c:4317"
    worker_env = {e["name"] for e in container(multi, "worker")["env"]}
    assert not any(name.startswith("OTEL_") for name in worker_env)


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


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_tls_secret_reaches_the_daemon_probes_and_scrapes() -> None:
    """tls.secretName: the Secret mounted, vLLM's --ssl-* flags pointing into it, probes and
    the ServiceMonitor over HTTPS; unset: none of it."""
    docs = render(load_values("all-on"))
    c = container(docs)
    assert flag(c["args"], "--ssl-certfile") == "/etc/hpu-serve-tls/tls.crt"
    assert flag(c["args"], "--ssl-keyfile") == "/etc/hpu-serve-tls/tls.key"
    assert flag(c["args"], "--ssl-ca-certs") == "/etc/hpu-serve-tls/ca.crt"
    assert flag(c["args"], "--ssl-cert-reqs") == "1"
    assert {"name": "tls", "mountPath": "/etc/hpu-serve-tls", "readOnly": True} in \
        c["volumeMounts"]
    volumes = {v["name"]: v for v in pod_template(docs)["spec"]["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "llama-gaudi-tls"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"
    endpoint = docs["ServiceMonitor"]["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert pod_template(docs)["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    off = container(render({}))
    assert not any(a.startswith("--ssl") for a in off["args"])
    assert "scheme" not in off["readinessProbe"]["httpGet"]  # Kubernetes' default: HTTP
    # multi-host: only the leader serves HTTP, so only it gets the certificate
    multi = render(dict(load_values("multihost"), tls={"secretName": "s"}))
    assert flag(container(multi, "leader")["args"], "--ssl-certfile")
    assert "tls" not in {m["name"] for m in container(multi, "worker")["volumeMounts"]}


def test_single_host_tensor_parallel_on_eight_gaudi_cards() -> None:
    values = load_values("tp8")
    docs = render(values)
    assert "LeaderWorkerSet" not in docs
    c, env = container(docs), env_of(docs)
    assert flag(c["args"], "--tensor-parallel-size") == "8"
    assert "--distributed-executor-backend" not in c["args"]  # the daemon's mp: one host
    assert "command" not in c  # the image's entrypoint: `hpu-serve serve`
    # resources.limits["habana.ai/gaudi"]: 8 (requests must equal limits for a device)
    assert c["resources"]["limits"]["habana.ai/gaudi"] == 8
    assert c["resources"]["requests"]["habana.ai/gaudi"] == 8
    assert env["HABANA_VISIBLE_DEVICES"] == "all"
    assert env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true"  # TP inside HPU graphs
    pod = pod_template(docs)["spec"]
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # tensorParallelSize alone asks for one card per rank
    alone = container(render({"tensorParallelSize": 4}))
    assert alone["resources"]["limits"]["habana.ai/gaudi"] == 4
    assert flag(alone["args"], "--tensor-parallel-size") == "4"


def test_one_rank_and_cpu_ranks() -> None:
    default = render({})
    assert flag(container(default)["args"], "--tensor-parallel-size") == "1"
    assert "PT_HPU_ENABLE_LAZY_COLLECTIVES" not in env_of(default)
    # on CPU /dev/shm is mounted only for several ranks (multi-process torch)
    for tp, mounted in ((1, False), (3, True)):
        docs = render({**load_values("cpu"), "tensorParallelSize": tp})
        c = container(docs)
        assert flag(c["args"], "--tensor-parallel-size") == str(tp)
        assert ("/dev/shm" in {m["mountPath"] for m in c["volumeMounts"]}) is mounted
        assert "habana.ai/gaudi" not in c["resources"].get("limits", {})
    backend = container(render({"tensorParallelSize": 2, "distributedExecutorBackend": "ray"}))
    assert flag(backend["args"], "--distributed-executor-backend") == "ray"


def test_multi_host_leader_worker_set() -> None:
    values = load_values("multihost")
    docs = render(values)
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["kind"] == "LeaderWorkerSet"
    spec = lws["spec"]
    assert spec["replicas"] == 1  # groups
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only after the workers
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = container(docs, "leader"), container(docs, "worker")
    # the leader: Ray head, wait for both Ray nodes, then the server over Ray with TP 16
    assert leader["command"][:2] == ["/bin/sh", "-c"]
    script = leader["command"][2]
    assert "ray start --head --port=6379 --disable-usage-stats '--num-cpus=32'" in script
    assert "' 2 900\n" in script  # waits for multiHost.size nodes, workersJoinTimeout s
    assert script.rstrip().endswith('exec hpu-serve serve --host 0.0.0.0 "$@"')
    assert script.index("ray start --head") < script.index("exec hpu-serve serve")
    args = leader["args"]
    assert flag(args, "--tensor-parallel-size") == "16"
    assert flag(args, "--distributed-executor-backend") == "ray"
    assert args[0] == "/models/Meta-Llama-3.1-405B-Instruct"
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == {"http": 8000,
                                                                       "ray-gcs": 6379}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # a worker: joins the leader's Ray cluster and blocks; no HTTP, no probes, no API key
    assert worker["command"][:2] == ["/bin/sh", "-c"]
    assert worker["command"][2].rstrip().endswith(
        "exec ray start --address=$(LWS_LEADER_ADDRESS):6379 --block --disable-usage-stats "
        "'--num-cpus=32'")
    assert "args" not in worker and "ports" not in worker
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    assert "VLLM_API_KEY" in env_of(docs)
    assert "VLLM_API_KEY" not in {e["name"] for e in worker["env"]}
    # shared: image, resources (8 cards each: 2 x 8 = 16 ranks), knobs, volumes
    assert leader["image"] == worker["image"]
    assert leader["resources"] == worker["resources"]
    assert worker["resources"]["limits"]["habana.ai/gaudi"] == 8
    assert worker["resources"]["requests"]["habana.ai/gaudi"] == 8
    worker_env = {e["name"]: e.get("value") for e in worker["env"]}
    assert worker_env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true"
    assert worker_env["PT_HPU_LAZY_MODE"] == "1"
    assert worker_env["HABANA_VISIBLE_DEVICES"] == "all"
    leader_pod, worker_pod = pod_template(docs, "leader"), pod_template(docs, "worker")
    assert leader_pod["spec"]["volumes"] == worker_pod["spec"]["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert "prometheus.io/scrape" not in worker_pod["metadata"]["annotations"]
    # the Service (and so the ServiceMonitor) reaches the leaders only
    selector = docs["Service"]["spec"]["selector"]
    assert selector[LWS_WORKER_INDEX] == "0"
    assert selector.items() - {LWS_WORKER_INDEX: "0"}.items() <= leader_pod[
        "metadata"]["labels"].items()
    assert docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= docs[
        "Service"]["metadata"]["labels"].items()
    # the PDB covers every pod of a group
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= \
        worker_pod["metadata"]["labels"].items()
    # without multiHost the Service selects the Deployment's pods, no worker-index label
    assert LWS_WORKER_INDEX not in render({})["Service"]["spec"]["selector"]


def readme_layouts() -> list[dict]:
    """The chart values the "Multi-card and multi-host" section of docs/deployment.md gives."""
    text = (CHART.parents[2] / "docs" / "deployment.md").read_text()
    section = text.split("\n## Multi-card and multi-host\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section, re.S)]


def test_readme_layouts_render_as_described() -> None:
    one_host, two_hosts = readme_layouts()
    docs = render(one_host)
    c = container(docs)
    assert flag(c["args"], "--tensor-parallel-size") == "8"
    assert c["resources"]["limits"]["habana.ai/gaudi"] == 8
    assert env_of(docs)["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true"
    assert "/dev/shm" in {m["mountPath"] for m in c["volumeMounts"]}
    docs = render(two_hosts)
    assert "Deployment" not in docs
    assert docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["size"] == 2
    leader, worker = container(docs, "leader"), container(docs, "worker")
    assert flag(leader["args"], "--tensor-parallel-size") == "16"
    assert flag(leader["args"], "--distributed-executor-backend") == "ray"
    assert "ray start --head --port=6379" in leader["command"][2]
    assert "ray start --address=$(LWS_LEADER_ADDRESS):6379 --block" in worker["command"][2]
    assert worker["resources"]["limits"]["habana.ai/gaudi"] == 8


@pytest.mark.parametrize(("bad", "message"), [
    ({"multiHost": {"enabled": True, "size": 2}, "tensorParallelSize": 16,
      "distributedExecutorBackend": "mp"}, 'distributedExecutorBackend must be "ray" or empty'),
    ({"multiHost": {"enabled": True, "size": 2}}, "tensorParallelSize to be a multiple of 2"),
    ({"multiHost": {"enabled": True, "size": 4}, "tensorParallelSize": 6},
     "tensorParallelSize to be a multiple of 4"),
    ({"multiHost": {"enabled": True, "size": 2}, "tensorParallelSize": 16, "gaudi": {"cards": 4}},
     "8 ranks per pod, one Gaudi card each: each pod must request 8 cards (gaudi.cards), not 4"),
    ({"multiHost": {"enabled": True, "size": 2}, "tensorParallelSize": 4,
      "autoscaling": {"enabled": True}}, "scale whole groups with replicaCount"),
    ({"tensorParallelSize": 8, "gaudi": {"cards": 4}},
     "tensorParallelSize=8 needs 8 Gaudi cards (one per rank) but the pod requests 4"),
    ({"gaudi": {"cards": 8}, "resources": {"limits": {"habana.ai/gaudi": 4}}},
     "the Gaudi card count is given differently"),
])
def test_parallel_settings_that_cannot_work_fail_the_install(bad: dict, message: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmRenderError) as info:
        chart.render(bad, name="demo", namespace="serving")
    assert message in str(info.value)


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
    ({"tensorParallelSize": 0}, "/tensorParallelSize"),
    ({"distributedExecutorBackend": "nccl"}, "/distributedExecutorBackend"),
    ({"multiHost": {"enabled": True, "size": 1}}, "/multiHost/size"),  # one pod is not multi-host
    ({"multiHost": {"enabled": "yes"}}, "/multiHost/enabled"),
    ({"multiHost": {"hosts": 2}}, "hosts"),
    ({"gaudi": {"shmSize": "8Gi"}}, "shmSize"),  # moved to the top level
    ({"tracing": {"otlpEndpoint": "collector:4317"}}, "/tracing/otlpEndpoint"),  # no scheme
    ({"tracing": {"protocol": "http/json"}}, "/tracing/protocol"),
])
def test_bad_values_are_rejected_at_install_time(bad: dict, message: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError) as info:
        chart.render(bad, name="demo", namespace="serving")
    assert message in str(info.value)
