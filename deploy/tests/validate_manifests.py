#!/usr/bin/env python3
"""Renders every kustomize overlay of deploy/k8s and validates it (issue 8).

Checks, per overlay:
  * `kustomize build` renders it (the `kustomize` binary, else `kubectl kustomize`);
  * every resource validates against the Kubernetes JSON schemas of KUBERNETES_VERSION in strict
    mode (PyPI kubernetes-validate; unknown fields are errors). PodMonitor (a CRD without a
    bundled schema) gets the structural checks below instead;
  * the kvr shape: prefill/decode request nvidia.com/gpu, add IPC_LOCK, mount a Memory /dev/shm
    and take UCX_* from the kvr-ucx ConfigMap; every kvr container has gRPC startup, readiness
    and liveness probes and a `metrics` port that a PodMonitor scrapes; every role has a
    PodDisruptionBudget; every pod runs as non-root with a read-only root filesystem, and
    NetworkPolicies admit only kvr's own pods (clients: the controller's gRPC port; scrapers:
    metrics ports); the store is a StatefulSet with a memory limit (and 2 MiB huge pages
    unless the overlay is dev); the multi-node-rdma overlay requests the RDMA resource;
  * the Grafana dashboard ConfigMap (label grafana_dashboard: "1") holds exactly
    deploy/grafana/kvr-dashboard.json, and every kvr_* metric the dashboard queries is one that
    common/include/kvr/common/metrics.h documents (i.e. a metric kvr exports).
A self-check first feeds the validator a broken Deployment, so a validator that accepts
everything fails the test. Exit 0: all good; 1: a check failed; 77: no kustomize renderer
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
OVERLAYS = ["dev", "multi-node-rdma"]
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


def container_checks(overlay, docs):
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    workloads = by_kind.get("Deployment", []) + by_kind.get("StatefulSet", [])
    names = {w["metadata"]["name"] for w in workloads}
    for want in ["kvr-controller", "kvr-prefill", "kvr-decode", "kvr-store"]:
        if want not in names:
            fail(f"{overlay}: no workload {want}")
    pdb_selectors = [p["spec"]["selector"]["matchLabels"] for p in by_kind.get(
        "PodDisruptionBudget", [])]
    monitors = by_kind.get("PodMonitor", [])
    for m in monitors:
        if not m["spec"].get("selector", {}).get("matchLabels"):
            fail(f"{overlay}: PodMonitor {m['metadata']['name']} selects nothing")
        for ep in m["spec"].get("podMetricsEndpoints", []):
            if ep.get("port") != "metrics" or ep.get("path", "/metrics") != "/metrics":
                fail(f"{overlay}: PodMonitor {m['metadata']['name']}: endpoint {ep}")
    for w in workloads:
        wname = w["metadata"]["name"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        spec = pod_spec(w)
        if not any(all(labels.get(k) == v for k, v in sel.items()) for sel in pdb_selectors):
            fail(f"{overlay}: {wname} has no PodDisruptionBudget")
        if not any(all(labels.get(k) == v for k, v in m["spec"]["selector"]["matchLabels"].items())
                   for m in monitors):
            fail(f"{overlay}: no PodMonitor selects {wname}")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            cname = f"{overlay}: {wname}/{c['name']}"
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"]:
                if "grpc" not in c.get(probe, {}):
                    fail(f"{cname}: no gRPC {probe}")
            if "metrics" not in {p.get("name") for p in c.get("ports", [])}:
                fail(f"{cname}: no port named metrics")
            res = c.get("resources", {})
            limits, requests = res.get("limits", {}), res.get("requests", {})
            if "memory" not in limits:
                fail(f"{cname}: no memory limit")
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            caps = c.get("securityContext", {}).get("capabilities", {}).get("add", [])
            ucx = any(e.get("configMapRef", {}).get("name", "").startswith("kvr-ucx")
                      for e in c.get("envFrom", []))
            if wname in GPU_ROLES | {"kvr-store"}:
                if "IPC_LOCK" not in caps:
                    fail(f"{cname}: no IPC_LOCK")
                if not ucx:
                    fail(f"{cname}: UCX_* not passed through (envFrom kvr-ucx)")
                shm = volumes.get(mounts.get("/dev/shm"), {})
                if shm.get("emptyDir", {}).get("medium") != "Memory":
                    fail(f"{cname}: /dev/shm is not an emptyDir with medium Memory")
                if overlay == "multi-node-rdma" and "rdma/hca_shared_devices_a" not in limits:
                    fail(f"{cname}: no RDMA resource")
            if wname in GPU_ROLES:
                if str(limits.get("nvidia.com/gpu")) != "1":
                    fail(f"{cname}: does not request nvidia.com/gpu")
            if wname == "kvr-store":
                if w["kind"] != "StatefulSet":
                    fail(f"{cname}: the store is not a StatefulSet")
                if overlay != "dev" and "hugepages-2Mi" not in limits:
                    fail(f"{cname}: no hugepages-2Mi")


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


def dashboard_metrics_exported():
    with open(os.path.join(DEPLOY, "grafana", "kvr-dashboard.json")) as f:
        dashboard = json.load(f)
    with open(os.path.join(ROOT, "common", "include", "kvr", "common", "metrics.h")) as f:
        documented = set(re.findall(r"\bkvr_[a-z0-9_]+", f.read()))
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dashboard)
    if not exprs:
        fail("the dashboard has no PromQL expressions")
    for expr in exprs:
        for m in re.findall(r"\bkvr_[a-z0-9_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", m)
            if m not in documented and base not in documented:
                fail(f"dashboard queries {m}, which metrics.h does not define: {expr}")
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
        dashboard_checks(overlay, docs)
        security_checks(overlay, docs)
        print(f"{overlay}: {len(docs)} resources checked")
    if errors:
        print(f"{len(errors)} problem(s)")
        return 1
    print("all overlays valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
