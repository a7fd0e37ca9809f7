"""The PromQL of kvr's Grafana dashboard (deploy/grafana/kvr-dashboard.json) for the tests that
check it against what kvr exports (standard library only)."""


def expressions(node):
    """Every "expr" string (a target's PromQL) anywhere below `node`, a dashboard's JSON or a
    part of it, in document order; empty ones included."""
    found = []

    def walk(n):
        if isinstance(n, dict):
            if isinstance(n.get("expr"), str):
                found.append(n["expr"])
            for v in n.values():
                walk(v)
        elif isinstance(n, list):
            for v in n:
                walk(v)

    walk(node)
    return found
