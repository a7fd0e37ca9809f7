#!/usr/bin/env python3
"""End-to-end observability test: a local kvr cluster (`kvr up`: controller, store,
prefill and decode nodes serving SmolLM2, the decode node sampling retrieval quality on every
step), a real Prometheus server (Debian's `prometheus`) scraping every /metrics endpoint the
cluster's processes serve every second, a short `kvr bench`, then:
  * every process of the cluster serves /metrics and Prometheus scrapes it (up == 1);
  * `promtool check metrics` is clean on every endpoint's text;
  * sum(kvr_requests_total{outcome="ok"}) in Prometheus equals the bench JSON's `completed`;
  * every PromQL expression of deploy/grafana/kvr-dashboard.json returns data, template
    variables substituted (a metric no process exports fails the test).

Metrics endpoints are found by probing every TCP port the cluster's processes listen on
(`ss -ltnp`) with GET /metrics, so the test needs no knowledge of each node's flags or log lines.

Environment: KVR_BIN, KVR_SOURCE_DIR, PROMETHEUS_BIN, PROMTOOL_BIN, optional KVR_TEST_MODEL
(set by CTest / scripts/test.sh)."""
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("KVR_SOURCE_DIR", os.path.dirname(os.path.dirname(HERE)))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.join(SOURCE_DIR, "tools", "bench", "tests"))
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "pylib"))
import child_process  # noqa: E402
import grafana_dashboard  # noqa: E402
import kvr_cluster  # noqa: E402

KVR = os.environ.get("KVR_BIN", "kvr")
PROMETHEUS = os.environ.get("PROMETHEUS_BIN", "prometheus")
PROMTOOL = os.environ.get("PROMTOOL_BIN", "promtool")
DASHBOARD = os.path.join(SOURCE_DIR, "deploy", "grafana", "kvr-dashboard.json")


def http_get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode("utf-8", "replace")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(root_pids):
    """root_pids and all their descendant pids (from /proc)."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = set(), list(root_pids)
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, []))
    return out


def listening_ports(pids):
    """{port: process name} of TCP ports that `pids` listen on."""
    text = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ports = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                ports[int(fields[3].rsplit(":", 1)[1])] = f"{name}[{pid}]"
    return ports


def scrape(port):
    """The /metrics text on `port`, or None when it serves none."""
    try:
        status, text = http_get(f"http://127.0.0.1:{port}/metrics", timeout=1.0)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return None
    if status == 200 and ("# TYPE" in text or "# HELP" in text):
        return text
    return None


def sample_names(text):
    return {line.split("{")[0].split()[0] for line in text.splitlines()
            if line and not line.startswith("#")}


class Prometheus:
    def __init__(self, targets, workdir):
        self.port = free_port()
        config = os.path.join(workdir, "prometheus.yml")
        static = [{"targets": [f"127.0.0.1:{port}"], "labels": {"kvr_process": name}}
                  for port, name in sorted(targets.items())]
        # Prometheus itself as well: the server is known to export metrics, so the config and
        # the query path are checked even when no kvr target exists yet.
        static.append({"targets": [f"127.0.0.1:{self.port}"],
                       "labels": {"kvr_process": "prometheus"}})
        with open(config, "w") as f:
            json.dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                       "scrape_configs": [{"job_name": "kvr", "static_configs": static}]}, f)
        self.log = open(os.path.join(workdir, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}",
             f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if http_get(f"http://127.0.0.1:{self.port}/-/ready")[0] == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"prometheus did not become ready; log: {self.log.name}")
            time.sleep(0.2)

    def query(self, promql):
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?" +
               urllib.parse.urlencode({"query": promql}))
        try:
            _, body = http_get(url, timeout=5)
        except urllib.error.HTTPError as e:
            body = e.read().decode()
        r = json.loads(body)
        if r.get("status") != "success":
            raise AssertionError(f"PromQL {promql!r}: {r.get('error', r)}")
        return r["data"]["result"]

    def wait(self, predicate, timeout=20):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.5)

    def stop(self):
        child_process.stop(self.proc, timeout=10)
        self.log.close()


def dashboard_expressions(dashboard):
    """The non-empty PromQL expressions of the dashboard's panels and rows."""
    return [expr for part in (dashboard.get("panels", []), dashboard.get("rows", []))
            for expr in grafana_dashboard.expressions(part) if expr.strip()]


def substitute(expr, variables):
    """Grafana template variables -> values that match every series."""
    intervals = {"__rate_interval": "1m", "__interval": "5s", "__range": "5m",
                 "__interval_ms": "5000", "__range_s": "300", "__range_ms": "300000"}
    for name, value in intervals.items():
        expr = re.sub(r"\$\{" + name + r"\}|\$" + name + r"\b|\[\[" + name + r"\]\]", value,
                      expr)
    for name in sorted(variables, key=len, reverse=True):
        ref = r"(?:\$\{" + re.escape(name) + r"(?::[a-z]+)?\}|\$" + re.escape(name) + r"\b|\[\[" \
              + re.escape(name) + r"\]\])"
        # label="$var" and label=~"$var" -> label=~".*" (also matches a missing label)
        expr = re.sub(r'(=~?|!~?)\s*"' + ref + '"',
                      lambda m: ('=~' if m.group(1).startswith("=") else '!~') + '".*"', expr)
        expr = re.sub(ref, ".*", expr)
    return expr


class PrometheusE2eTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvr-prom-e2e-")
        # kvr up prints "kvr up: ready" once every node registered, after the line
        # "  public gRPC (kvr.v1.Generation)  HOST:PORT" with the controller's address.
        # Retrieval-quality panels need sampled steps (off by default: each sample reads the
        # layer's candidate keys from the store): every step here.
        argv = [KVR, "up", "--base-port", "0", "--prefill", "1", "--decode", "1",
                "--log-dir", os.path.join(cls.tmp, "logs"),
                "--decode-arg=--quality-sample-rate=1"]
        if os.environ.get("KVR_TEST_MODEL"):
            argv += ["--model", os.environ["KVR_TEST_MODEL"]]
        cls.up = child_process.Process(argv, "kvr-up")
        cls.up.wait_for("kvr up: ready", timeout=180)
        line = cls.up.wait_for("  public gRPC")
        cls.address = line.split()[-1]
        roots = [cls.up.proc.pid]
        cls.processes = {}
        # Every cluster process, not the `kvr up` launcher itself (it serves no node).
        launcher = {cls.up.proc.pid}
        for pid in descendants(roots) - launcher:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    cls.processes[pid] = f.read().strip()
            except OSError:
                pass
        ports = listening_ports(set(cls.processes))
        cls.targets = {port: name for port, name in ports.items() if scrape(port) is not None}
        cls.prometheus = Prometheus(cls.targets, cls.tmp)
        # Let Prometheus scrape the idle cluster once, then load it.
        cls.prometheus.wait(lambda: len(cls.prometheus.query("up == 1")) == len(cls.targets) + 1)
        result_file = os.path.join(cls.tmp, "bench.json")
        # Real nodes: prompts longer than the decode node's sink + local window, so that decode
        # steps select, fetch from the store and hit its hot cache (the retrieval panels).
        # 2 in flight keeps the 2-core machine responsive (store memory is reserved for the
        # tokenized prompt: a prefill node tokenizes text before placement).
        # The cluster's gRPC is TLS with the CA kvr up made in its log directory.
        args = ["--num-prompts", "4", "--input-len", "1000", "--output-len", "8",
                "--concurrency", "2", "--method", "clusterkv", "--budget", "64",
                "--tls-ca", os.path.join(cls.tmp, "logs", "tls", "ca.pem")]
        r = kvr_cluster.run_bench(KVR, cls.address, [*args, "--result-file", result_file],
                                  timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"kvr bench failed:\n{r.stdout}\n{r.stderr}")
        with open(result_file) as f:
            cls.bench = json.load(f)
        cls.scrapes = {port: scrape(port) for port in cls.targets}
        cls.exported = set()
        for text in cls.scrapes.values():
            cls.exported |= sample_names(text or "")

    @classmethod
    def tearDownClass(cls):
        cls.prometheus.stop()
        cls.up.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_bench_completed(self):
        self.assertEqual(self.bench["failed"], 0, self.bench["errors"])
        self.assertEqual(self.bench["completed"], self.bench["num_prompts"])

    def test_prometheus_scrapes_every_endpoint(self):
        up = self.prometheus.query("up")
        self.assertEqual(len(up), len(self.targets) + 1, up)
        for series in up:
            self.assertEqual(series["value"][1], "1", series)

    def test_every_process_serves_metrics(self):
        served = {int(name.rsplit("[", 1)[1].rstrip("]")) for name in self.targets.values()}
        without = [f"{name}[{pid}]" for pid, name in sorted(self.processes.items())
                   if pid not in served]
        self.assertFalse(without, "cluster processes serving no /metrics: " + ", ".join(without))
        for node in ("kvr-controller", "kvr-store", "kvr-prefill", "kvr-decode"):
            self.assertIn(node, {name.split("[")[0] for name in self.targets.values()},
                          f"no {node} among the scraped processes {sorted(self.targets.values())}")

    def test_nodes_are_named_as_kvr_up_names_them(self):
        # kvr up passes its names (store-0, prefill-0, decode-0) to the nodes, which label their
        # metrics (kvr_node_info) and register with them.
        names = {}
        for port, text in self.scrapes.items():
            m = re.search(r'^kvr_node_info\{[^}]*name="([^"]*)"', text or "", re.M)
            names[self.targets[port].split("[")[0]] = m.group(1) if m else None
        self.assertEqual(names.get("kvr-store"), "store-0", names)
        self.assertEqual(names.get("kvr-prefill"), "prefill-0", names)
        self.assertEqual(names.get("kvr-decode"), "decode-0", names)

    def test_promtool_check_metrics(self):
        self.assertTrue(self.targets, "no process of the cluster serves /metrics")
        for port, text in self.scrapes.items():
            r = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                               text=True)
            self.assertEqual(r.returncode, 0,
                             f"{self.targets[port]} /metrics:\n{r.stdout}{r.stderr}")

    def test_request_count_matches_bench(self):
        self.assertIn("kvr_requests_total", self.exported)
        expected = self.bench["completed"]
        promql = 'sum(kvr_requests_total{outcome="ok"})'

        def matches():
            r = self.prometheus.query(promql)
            return r and float(r[0]["value"][1]) == expected

        if not self.prometheus.wait(matches):
            self.fail(f"{promql} = {self.prometheus.query(promql)}, bench completed = {expected}")

    def test_dashboard_expressions_return_data(self):
        with open(DASHBOARD) as f:
            dashboard = json.load(f)
        variables = [v["name"] for v in dashboard.get("templating", {}).get("list", [])]
        exprs = dashboard_expressions(dashboard)
        self.assertTrue(exprs, "the dashboard has no PromQL expressions")
        empty, not_exported = [], []
        for expr in exprs:
            promql = substitute(expr, variables)
            metrics = {m for m in re.findall(r"\bkvr_[a-zA-Z0-9_:]*", promql)}
            unknown = sorted(m for m in metrics if m not in self.exported)
            if unknown:
                not_exported.append(f"{expr}  (no process exports: {', '.join(unknown)})")
                continue
            # rate() over a fresh series needs a second scrape: give it a few.
            if not self.prometheus.query(promql) and not self.prometheus.wait(
                    lambda: self.prometheus.query(promql), timeout=10):
                empty.append(f"{expr}\n    -> {promql}")
        self.assertFalse(not_exported, f"{len(not_exported)} of {len(exprs)} dashboard "
                         "expressions use metrics no process exports:\n  " +
                         "\n  ".join(not_exported))
        self.assertFalse(empty, "dashboard expressions without data:\n  " + "\n  ".join(empty))

if __name__ == "__main__":
    unittest.main(verbosity=2)
