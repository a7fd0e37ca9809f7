#!/usr/bin/env python3
"""Renders every kustomize overlay of deploy/k8s and validates it.

Checks, per overlay:
  * `kustomize build` renders it (the `kustomize` binary, else `kubectl kustomize`);
  * every resource validates against the Kubernetes JSON schemas of KUBERNETES_VERSION in strict
    mode (PyPI kubernetes-validate; unknown fields are errors). PodMonitor (a CRD without a
    bundled schema) gets the structural checks below instead;
  * the kvr shape: prefill, decode and store containers add IPC_LOCK, mount a Memory /dev/shm
    and take UCX_* from the kvr-ucx ConfigMap; every kvr container has gRPC startup, readiness
    and liveness probes, a memory limit and a metrics port; every workload has a
    PodDisruptionBudget; stores have 2 MiB huge pages unless the overlay is dev; the
    multi-node-rdma overlay requests the RDMA resource;
  * GPUs serve: every container requesting nvidia.com/gpu runs with device cuda (its effective
    config: --config file from the mounted ConfigMap, KVR_* env, flags) and every device-cuda
    container requests one; a CUDA decode node sets gpu_method and gpu_budget, the controller's
    default method and budget fit them, prefill writes store rows of the dtype the decode node
    reads (gpu_row_format, bf16 by default), and the decode pod holds a kvr-store whose
    local_socket is in a volume both containers mount at the same path; the dev overlay requests
    exactly one GPU in all;
  * every metrics port of every pod is scraped by exactly one PodMonitor endpoint (no pod is
    selected by two monitors for one port: that doubles sum() panels);
  * every pod runs as non-root with a read-only root filesystem, and NetworkPolicies admit only
    kvr's own pods (clients: the controller's gRPC port; scrapers: metrics ports);
  * TLS (every overlay; the tls overlay must have it on every kvr container): each TLS file
    setting (tls_ca, tls_cert, tls_key, http_tls_*) of a container's effective config names a
    file that a volume mounted in that container provides (a key only from a Secret), and a
    container with TLS serves a plaintext health port (health_address, a declared containerPort)
    that all three of its gRPC probes ask, since the kubelet's probes speak plaintext;
  * the Grafana dashboard ConfigMap (label grafana_dashboard: "1") holds exactly
    deploy/grafana/kvr-dashboard.json, and every kvr_* metric the dashboard queries is one that
    the metrics headers document (METRICS_HEADERS: the registry's and each role's metric set,
    i.e. a metric kvr exports).
Self-checks feed the schema validator a broken Deployment, and the shape checks each overlay
with a GPU decode container set to the CPU and with a second PodMonitor over the decode pods,
and the TLS checks the tls overlay with a probe on the mutual-TLS port, a key outside every
mount, a key in the config ConfigMap and a missing health_address, so checks that accept
everything fail the test. Exit 0: all good; 1: a check failed; 77: no kustomize renderer
(CTest reports SKIPPED, with the reason printed)."""
import json
import os
import re
import shutil
import subprocess
import sys

import yaml

try:
    import kubernetes_validate
except ImportError:
    sys.exit("kubernetes-validate is not installed in this Python "
             f"({sys.executable}): run scripts/python-env.sh (scripts/requirements-test.txt)")

KUBERNETES_VERSION = "1.33.0"
ROOT = os.environ.get("KVR_SOURCE_DIR") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
sys.path.insert(0, os.path.join(ROOT, "tests", "pylib"))
import grafana_dashboard  # noqa: E402

OVERLAYS = ["dev", "multi-node-rdma", "tls"]
GPU_ROLES = {"kvr-prefill", "kvr-decode"}
errors = []


def fail(msg):
    errors.append(msg)
    print("FAIL", msg)


def renderer():
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(cmd, path):
    r = subprocess.run(cmd + [path], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{' '.join(cmd)} {path}: {r.stderr.strip()}")
        return []
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def schema_check(overlay, doc):
    name = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        if doc["kind"] != "PodMonitor":
            fail(f"{name}: no schema for {doc['apiVersion']} {doc['kind']}")
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        fail(f"{name}: {path}: {e.message}")


def self_check():
    broken = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
              "spec": {"replicas": "two", "selector": {}, "template": {"spec": {
                  "containers": [{"name": "c", "image": "i", "portz": []}]}}}}
    try:
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError:
        return
    fail("self-check: the validator accepted a Deployment with replicas: 'two'")


def pod_spec(doc):
    return doc["spec"]["template"]["spec"]


def selects(selector, labels):
    """Whether a LabelSelector (matchLabels and matchExpressions) selects `labels`."""
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def binary(container):
    return os.path.basename((container.get("command") or [""])[0])


# The KVR_* environment prefix of each node binary's settings (flag > file > env > default).
ENV_PREFIX = {"kvr-prefill": "KVR_PREFILL_", "kvr-decode": "KVR_DECODE_", "kvr-store": "KVR_STORE_",
              "kvr-controller": "KVR_CONTROLLER_"}


def effective_config(container, spec, configmaps):
    """The settings a kvr container starts with, from its --config file (read from the
    ConfigMap mounted at that path), then its KVR_* environment below it, and its command-line
    flags above it. {} for a container that is not a kvr node."""
    argv = (container.get("command") or []) + (container.get("args") or [])
    config = {}
    prefix = ENV_PREFIX.get(binary(container))
    if prefix is None:
        return config
    for env in container.get("env", []):
        if env["name"].startswith(prefix) and "value" in env:
            config.setdefault(env["name"][len(prefix):].lower(), env["value"])
    if "--config" in argv:
        path = argv[argv.index("--config") + 1]
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volume = volumes.get(mounts.get(os.path.dirname(path)), {})
        data = configmaps.get(volume.get("configMap", {}).get("name"), {})
        text = data.get(os.path.basename(path))
        if text is not None:
            config.update(yaml.safe_load(text) or {})
    for i, arg in enumerate(argv):
        if arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            config[arg[2:].replace("-", "_")] = argv[i + 1]
    return config


def gpus(container):
    res = container.get("resources", {})
    return int(res.get("limits", {}).get("nvidia.com/gpu", res.get("requests", {}).get(
        "nvidia.com/gpu", 0)))


def kvr_shape_errors(overlay, docs):
    """Every problem with the kvr shape of one rendered overlay (see the module docstring)."""
    errs = []
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind.get("ConfigMap", [])}
    workloads = by_kind.get("Deployment", []) + by_kind.get("StatefulSet", [])
    names = {w["metadata"]["name"] for w in workloads}
    for want in ["kvr-controller", "kvr-prefill", "kvr-decode"]:
        if want not in names:
            errs.append(f"{overlay}: no workload {want}")
    pdb_selectors = [p["spec"]["selector"] for p in by_kind.get("PodDisruptionBudget", [])]
    monitors = by_kind.get("PodMonitor", [])
    for m in monitors:
        if not m["spec"].get("selector", {}).get("matchLabels"):
            errs.append(f"{overlay}: PodMonitor {m['metadata']['name']} selects nothing")
        for ep in m["spec"].get("podMetricsEndpoints", []):
            if not ep.get("port", "").endswith("metrics") or ep.get("path", "/metrics") != "/metrics":
                errs.append(f"{overlay}: PodMonitor {m['metadata']['name']}: endpoint {ep}")
    controller_config = {}
    prefill_configs = []
    total_gpus = 0
    for w in workloads:
        wname = w["metadata"]["name"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        spec = pod_spec(w)
        replicas = w["spec"].get("replicas", 1)
        if not any(selects(sel, labels) for sel in pdb_selectors):
            errs.append(f"{overlay}: {wname} has no PodDisruptionBudget")
        # Each metrics port of the pod is one scrape target: exactly one PodMonitor endpoint
        # may scrape it (two double every sum() on the dashboard), and one must.
        metric_ports = [p["name"] for c in spec["containers"] for p in c.get("ports", [])
                        if p.get("name", "").endswith("metrics")]
        for port in metric_ports:
            scrapers = [m["metadata"]["name"] for m in monitors
                        if selects(m["spec"].get("selector"), labels)
                        for ep in m["spec"].get("podMetricsEndpoints", []) if ep.get("port") == port]
            if not scrapers:
                errs.append(f"{overlay}: no PodMonitor scrapes {wname} port {port}")
            elif len(scrapers) > 1:
                errs.append(f"{overlay}: {wname} port {port} is selected by two monitors or more: "
                            f"{scrapers}")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        containers = {c["name"]: c for c in spec["containers"]}
        for c in spec["containers"]:
            cname = f"{overlay}: {wname}/{c['name']}"
            role = binary(c)
            config = effective_config(c, spec, configmaps)
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"]:
                if "grpc" not in c.get(probe, {}):
                    errs.append(f"{cname}: no gRPC {probe}")
            if not any(p.get("name", "").endswith("metrics") for p in c.get("ports", [])):
                errs.append(f"{cname}: no metrics port")
            res = c.get("resources", {})
            limits = res.get("limits", {})
            if "memory" not in limits:
                errs.append(f"{cname}: no memory limit")
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            caps = c.get("securityContext", {}).get("capabilities", {}).get("add", [])
            ucx = any(e.get("configMapRef", {}).get("name", "").startswith("kvr-ucx")
                      for e in c.get("envFrom", []))
            if role in ("kvr-prefill", "kvr-decode", "kvr-store"):
                if "IPC_LOCK" not in caps:
                    errs.append(f"{cname}: no IPC_LOCK")
                if not ucx:
                    errs.append(f"{cname}: UCX_* not passed through (envFrom kvr-ucx)")
                shm = volumes.get(mounts.get("/dev/shm"), {})
                if shm.get("emptyDir", {}).get("medium") != "Memory":
                    errs.append(f"{cname}: /dev/shm is not an emptyDir with medium Memory")
                if overlay == "multi-node-rdma" and "rdma/hca_shared_devices_a" not in limits:
                    errs.append(f"{cname}: no RDMA resource")
            # A GPU requested by a node that runs on the CPU sits idle; a CUDA node without one
            # cannot start.
            n_gpus = gpus(c)
            total_gpus += n_gpus * replicas
            device = str(config.get("device", "cpu"))
            if n_gpus > 0 and device != "cuda":
                errs.append(f"{cname}: requests nvidia.com/gpu but runs with device {device!r} "
                            "(set device: cuda in its config)")
            if device == "cuda" and n_gpus == 0:
                errs.append(f"{cname}: device cuda without an nvidia.com/gpu")
            if role == "kvr-controller":
                controller_config = config
            if role == "kvr-prefill":
                prefill_configs.append((cname, config))
            if role == "kvr-store" and overlay != "dev" and "hugepages-2Mi" not in limits:
                errs.append(f"{cname}: no hugepages-2Mi")
            if role == "kvr-decode" and device == "cuda":
                for key in ("gpu_method", "gpu_budget"):
                    if key not in config:
                        errs.append(f"{cname}: device cuda without {key}")
                # The store it reads in place: a kvr-store container of the same pod whose
                # local_socket lies in a volume both mount at the same path.
                stores = [s for s in containers.values() if binary(s) == "kvr-store"]
                if not stores:
                    errs.append(f"{cname}: a CUDA decode node without a kvr-store in its pod")
                for store in stores:
                    socket = str(effective_config(store, spec, configmaps).get("local_socket", ""))
                    store_mounts = {m["mountPath"]: m["name"]
                                    for m in store.get("volumeMounts", [])}
                    directory = os.path.dirname(socket)
                    if not socket:
                        errs.append(f"{cname}: its store {store['name']} has no local_socket")
                    elif (directory not in store_mounts or
                          mounts.get(directory) != store_mounts[directory]):
                        errs.append(f"{cname}: the store's socket {socket} is not in a volume "
                                    "both containers mount at that path")
    # Requests that name no method get the controller's default: the CUDA decode nodes must
    # serve it, and its budget must fit theirs; their rows must come from the store in the dtype
    # they read (gpu_row_format: bf16 unless set to fp8).
    decode_workloads = [w for w in workloads if w["metadata"]["name"] == "kvr-decode"]
    for w in decode_workloads:
        spec = pod_spec(w)
        for c in spec["containers"]:
            config = effective_config(c, spec, configmaps)
            if binary(c) != "kvr-decode" or config.get("device") != "cuda":
                continue
            method = config.get("gpu_method")
            if controller_config.get("default_method") != method:
                errs.append(f"{overlay}: controller default_method "
                            f"{controller_config.get('default_method')!r} is not the CUDA decode "
                            f"nodes' gpu_method {method!r}")
            if int(controller_config.get("default_budget", 1 << 30)) > int(
                    config.get("gpu_budget", 0)):
                errs.append(f"{overlay}: controller default_budget is above gpu_budget")
            reads = config.get("gpu_row_format", "bf16")
            for pname, pconfig in prefill_configs:
                dtype = pconfig.get("store_dtype",
                                    "bf16" if pconfig.get("device") == "cuda" else "f32")
                if dtype != reads:
                    errs.append(f"{pname}: store_dtype {dtype!r}: the CUDA decode node reads "
                                f"{reads} rows (gpu_row_format)")
    if overlay == "dev" and total_gpus != 1:
        errs.append(f"dev: requests {total_gpus} GPUs in all; the overlay is for one GPU")
    return errs


def container_checks(overlay, docs):
    for e in kvr_shape_errors(overlay, docs):
        fail(e)


def shape_self_check(overlay, docs):
    """The checks above must catch what they are for: a GPU container left on the CPU, and a
    decode pod scraped by two PodMonitors (the manifests once had both)."""
    import copy
    broken = copy.deepcopy(docs)
    for d in broken:
        if d["kind"] == "ConfigMap" and "decode.yaml" in d.get("data", {}):
            d["data"]["decode.yaml"] = d["data"]["decode.yaml"].replace("device: cuda",
                                                                        "device: cpu")
    if not any("requests nvidia.com/gpu but runs with device 'cpu'" in e
               for e in kvr_shape_errors(overlay, broken)):
        fail(f"self-check ({overlay}): a GPU decode container with device cpu was not caught")
    broken = copy.deepcopy(docs)
    broken.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                   "metadata": {"name": "kvr-all"},
                   "spec": {"selector": {"matchLabels": {"app.kubernetes.io/part-of": "kvr"}},
                            "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics"}]}})
    if not any("kvr-decode port metrics is selected by two monitors" in e
               for e in kvr_shape_errors(overlay, broken)):
        fail(f"self-check ({overlay}): a decode pod in two PodMonitors was not caught")


# The settings that name a TLS file (PEM), and those of them that hold a private key.
TLS_FILE_SETTINGS = ("tls_ca", "tls_cert", "tls_key", "http_tls_cert", "http_tls_key",
                     "http_tls_client_ca")
TLS_KEY_SETTINGS = ("tls_key", "http_tls_key")


def volume_files(volume, configmaps):
    """(file names a volume provides or None when the manifests cannot tell, whether every
    file comes from a Secret)."""
    def source_files(kind, source):
        items = source.get("items")
        if items:
            return {i["path"] for i in items}
        if kind == "configMap":
            return set(configmaps.get(source.get("name"), {}))
        if kind == "secret":
            return None  # a Secret made outside the manifests: its keys are unknown here
        return set()

    if "secret" in volume:
        return source_files("secret", volume["secret"]), True
    if "configMap" in volume:
        return source_files("configMap", volume["configMap"]), False
    if "csi" in volume:
        return None, True  # e.g. cert-manager's csi-driver: files named by its attributes
    if "projected" in volume:
        files, secret_only = set(), True
        for source in volume["projected"].get("sources", []):
            kind = next(iter(source))
            part = source_files(kind, source[kind])
            files = None if files is None or part is None else files | part
            secret_only = secret_only and kind == "secret"
        return files, secret_only
    return set(), False


def probe_port(probe, container):
    """The port number a gRPC probe asks (a named port resolved among the container's)."""
    port = probe.get("grpc", {}).get("port")
    if isinstance(port, str):
        named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        return named.get(port)
    return port


def tls_errors(overlay, docs):
    """Every TLS problem of one rendered overlay (see the module docstring)."""
    errs = []
    configmaps = {c["metadata"]["name"]: c.get("data", {}) for c in docs
                  if c["kind"] == "ConfigMap"}
    for w in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        spec = pod_spec(w)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            if binary(c) not in ENV_PREFIX:
                continue
            cname = f"{overlay}: {w['metadata']['name']}/{c['name']}"
            config = effective_config(c, spec, configmaps)
            mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c.get("volumeMounts", [])}
            for setting in TLS_FILE_SETTINGS:
                path = str(config.get(setting) or "")
                if not path:
                    continue
                under = [m for m in mounts if path.startswith(m + "/")]
                if not under:
                    errs.append(f"{cname}: {setting} {path} is on no volume the container mounts")
                    continue
                mount = max(under, key=len)
                volume = volumes.get(mounts[mount], {})
                files, secret_only = volume_files(volume, configmaps)
                relative = path[len(mount) + 1:]
                if files is not None and relative not in files:
                    errs.append(f"{cname}: {setting} {path} is not a file of volume "
                                f"{mounts[mount]} (it has {sorted(files)})")
                if setting in TLS_KEY_SETTINGS and not secret_only:
                    errs.append(f"{cname}: {setting} {path} is not from a Secret")
            if not (config.get("tls_cert") or config.get("tls_ca")):
                if overlay == "tls":
                    errs.append(f"{cname}: no TLS (tls_ca, tls_cert, tls_key) in the tls overlay")
                continue
            # A mutual-TLS port fails the kubelet's plaintext gRPC probes: they must ask the
            # plaintext health port.
            health = str(config.get("health_address") or "")
            if ":" not in health:
                errs.append(f"{cname}: TLS without a plaintext health_address for its probes")
                continue
            port = int(health.rsplit(":", 1)[1])
            if port not in [p["containerPort"] for p in c.get("ports", [])]:
                errs.append(f"{cname}: health port {port} is not a declared containerPort")
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"]:
                asked = probe_port(c.get(probe, {}), c)
                if asked != port:
                    errs.append(f"{cname}: {probe} asks port {asked}, not the plaintext health "
                                f"port {port} (the gRPC port is TLS)")
    return errs


def tls_checks(overlay, docs):
    for e in tls_errors(overlay, docs):
        fail(e)


def tls_self_check(overlay, docs):
    """The TLS checks must catch a probe left on the TLS port, a key on no mount, a key in
    the config ConfigMap and a container with TLS but no health port."""
    import copy

    def broken(edit):
        docs2 = copy.deepcopy(docs)
        for d in docs2:
            if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvr-decode":
                for c in pod_spec(d)["containers"]:
                    edit(c)
        return tls_errors(overlay, docs2)

    def set_env(name, value):
        def edit(c):
            c["env"] = [e for e in c.get("env", []) if e["name"] != name]
            if value is not None:
                c["env"].append({"name": name, "value": value})
        return edit

    def probe_on_grpc_port(c):
        if c["name"] == "decode":
            c["readinessProbe"]["grpc"]["port"] = 50061

    cases = [
        ("a readiness probe on the mutual-TLS port", probe_on_grpc_port,
         "readinessProbe asks port 50061, not the plaintext health port"),
        ("a key on no mounted volume", set_env("KVR_DECODE_TLS_KEY", "/etc/kvr-certs/tls.key"),
         "tls_key /etc/kvr-certs/tls.key is on no volume"),
        ("a key in the config ConfigMap", set_env("KVR_DECODE_TLS_KEY", "/etc/kvr/tls.key"),
         "tls_key /etc/kvr/tls.key is not a file of volume config"),
        ("TLS without a health port", set_env("KVR_STORE_HEALTH_ADDRESS", None),
         "TLS without a plaintext health_address"),
    ]
    for what, edit, want in cases:
        if not any(want in e for e in broken(edit)):
            fail(f"self-check ({overlay}): {what} was not caught")


def dashboard_checks(overlay, docs):
    with open(os.path.join(DEPLOY, "grafana", "kvr-dashboard.json")) as f:
        text = f.read()
    maps = [d for d in docs if d["kind"] == "ConfigMap"
            and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    if len(maps) != 1:
        fail(f"{overlay}: {len(maps)} ConfigMaps labelled grafana_dashboard=1, want 1")
        return
    if maps[0].get("data", {}).get("kvr-dashboard.json") != text:
        fail(f"{overlay}: the dashboard ConfigMap differs from deploy/grafana/kvr-dashboard.json")


# The headers that document every metric kvr exports: the registry's own (build and node info)
# and each role's metric set.
METRICS_HEADERS = (
    "common/include/kvr/common/metrics.h",
    "controller/include/kvr/controller/metrics.h",
    "prefill-node/include/kvr/prefill_node/metrics.h",
    "decode-node/include/kvr/decode/metrics.h",
    "kv-store/include/kvr/kv_store/metrics.h",
)


def dashboard_metrics_exported():
    with open(os.path.join(DEPLOY, "grafana", "kvr-dashboard.json")) as f:
        dashboard = json.load(f)
    documented = set()
    for header in METRICS_HEADERS:
        with open(os.path.join(ROOT, header)) as f:
            documented |= set(re.findall(r"\bkvr_[a-z0-9_]+", f.read()))
    exprs = grafana_dashboard.expressions(dashboard)
    if not exprs:
        fail("the dashboard has no PromQL expressions")
    for expr in exprs:
        for m in re.findall(r"\bkvr_[a-z0-9_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", m)
            if m not in documented and base not in documented:
                fail(f"dashboard queries {m}, which no metrics header defines: {expr}")
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            for m in re.findall(r"\bkvr_[a-z0-9_]+", v.get("definition", "")):
                if re.sub(r"_(bucket|sum|count)$", "", m) not in documented:
                    fail(f"template variable {v['name']} queries unknown {m}")


def security_checks(overlay, docs):
    """Every kvr pod runs as non-root with a read-only root filesystem; NetworkPolicies admit
    only kvr's own pods to every kvr pod, clients to the controller's gRPC port alone."""
    for w in [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]:
        wname = w["metadata"]["name"]
        spec = pod_spec(w)
        if spec.get("securityContext", {}).get("runAsNonRoot") is not True:
            fail(f"{overlay}: {wname}: pod not runAsNonRoot")
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            if sc.get("readOnlyRootFilesystem") is not True:
                fail(f"{overlay}: {wname}/{c['name']}: root filesystem writable")
            if sc.get("allowPrivilegeEscalation") is not False:
                fail(f"{overlay}: {wname}/{c['name']}: privilege escalation allowed")
    policies = {p["metadata"]["name"]: p["spec"] for p in docs if p["kind"] == "NetworkPolicy"}
    internal = policies.get("kvr-internal", {})
    kvr = {"app.kubernetes.io/part-of": "kvr"}
    if internal.get("podSelector", {}).get("matchLabels") != kvr or [
            f for rule in internal.get("ingress", []) for f in rule.get("from", [])] != [
            {"podSelector": {"matchLabels": kvr}}]:
        fail(f"{overlay}: NetworkPolicy kvr-internal does not limit kvr pods to kvr pods")
    for name, p in policies.items():
        for rule in p.get("ingress", []):
            if name != "kvr-internal" and not rule.get("ports"):
                fail(f"{overlay}: NetworkPolicy {name} admits every port")


def main():
    cmd = renderer()
    if cmd is None:
        print("SKIP: neither `kustomize` nor `kubectl` is installed (Debian 12 packages "
              "neither); install kustomize v5 to render the overlays")
        return 77
    print("renderer:", " ".join(cmd), "| schemas: kubernetes", KUBERNETES_VERSION,
          "| kubernetes-validate", getattr(kubernetes_validate, "__version__", "?"))
    self_check()
    dashboard_metrics_exported()
    for overlay in OVERLAYS:
        docs = render(cmd, os.path.join(DEPLOY, "k8s", "overlays", overlay))
        if not docs:
            fail(f"{overlay}: rendered nothing")
            continue
        for d in docs:
            schema_check(overlay, d)
        container_checks(overlay, docs)
        shape_self_check(overlay, docs)
        dashboard_checks(overlay, docs)
        security_checks(overlay, docs)
        tls_checks(overlay, docs)
        if overlay == "tls":
            tls_self_check(overlay, docs)
        print(f"{overlay}: {len(docs)} resources checked")
    if errors:
        print(f"{len(errors)} problem(s)")
        return 1
    print("all overlays valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
