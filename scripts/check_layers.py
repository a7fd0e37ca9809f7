#!/usr/bin/env python3
"""Fails when a component includes a header of a component above it (docs/conventions.md).

Layers point down only: common and proto <- model <- retrieval <- transport <- kv-store <- node
(the node library: membership) <- controller, prefill-node, decode-node and the kvr-store binary
(kv-store/tools/) <- tools <- tests. A file's component is the longest folder of RANK its path
starts with; an included header's component is named by its path under kvr/ (kvr/kv_store/...,
generated protos kvr/v1, kvr/store, kvr/cluster). Components of one rank may not include each
other.

The same order holds for CMake links: a target's component is that of its first source file
(kvr-store's is kv-store/tools/; a target without sources: its CMake file's), and every kvr
target it links (target_link_libraries; the project's wrappers: kvr_add_library PUBLIC /
PRIVATE, kvr_add_metric_set PUBLIC, kvr_add_executable / kvr_add_test / kvr_add_fuzzer LIBS)
must come from its own component or a lower layer.

There are no exceptions: the model's GPU code, the last one, builds retrieval summaries through
a hook the prefill node supplies.

Usage: check_layers.py [ROOT]   (default: the repository this script is in). Exit 0 when the
tree holds the layering, 1 with one line per offending include otherwise.
"""
import pathlib
import re
import sys

# Folder -> rank; a file may include its own component and components of a lower rank. A
# nested folder (kv-store/tools) is a component of its own: the kvr-store binary sits beside
# the other nodes, above the node library, while the store library under it stays below.
RANK = {
    "common": 0, "proto": 0,
    "model": 1,
    "retrieval": 2,
    "transport": 3,
    "kv-store": 4,
    "node": 5,
    "controller": 6, "prefill-node": 6, "decode-node": 6, "kv-store/tools": 6,
    "tools": 7,
    "tests": 8,
}
# Header namespace (kvr/<name>/) -> folder.
NAMESPACE = {
    "common": "common", "v1": "proto", "store": "proto", "cluster": "proto",
    "model": "model", "retrieval": "retrieval", "transport": "transport",
    "kv_store": "kv-store", "node": "node", "controller": "controller",
    "prefill_node": "prefill-node", "decode": "decode-node", "loadgen": "tools",
    "eval_endpoint": "tools",
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"kvr/([a-z_0-9]+)/')
SOURCES = ("*.h", "*.cc", "*.cu", "*.cuh")


def component(rel):
    """The component of the file at `rel` (a path relative to the root): the longest folder of
    RANK that holds it."""
    best = None
    for folder in RANK:
        if rel.startswith(folder + "/") and (best is None or len(folder) > len(best)):
            best = folder
    return best


def sources(root):
    seen = set()
    for top in sorted({f.split("/")[0] for f in RANK}):
        base = root / top
        if not base.is_dir():
            continue
        for pattern in SOURCES:
            for path in sorted(base.rglob(pattern)):
                if path not in seen:
                    seen.add(path)
                    yield path


def check(root):
    errors = []
    for path in sources(root):
        rel = path.relative_to(root).as_posix()
        folder = component(rel)
        rank = RANK[folder]
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m or m.group(1) not in NAMESPACE:
                continue
            target = NAMESPACE[m.group(1)]
            if RANK[target] <= rank and (target == folder or RANK[target] < rank):
                continue
            errors.append(f"{rel}:{n}: {folder} (layer {rank}) includes {target} "
                          f"(layer {RANK[target]}): {line.strip()}")
    return errors


COMMAND = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")
KEYWORDS = {"PUBLIC", "PRIVATE", "INTERFACE", "STATIC", "SHARED", "OBJECT", "MODULE", "ALIAS",
            "IMPORTED", "GLOBAL", "EXCLUDE_FROM_ALL", "SOURCES", "LIBS", "LABELS", "CORPUS"}


def cmake_commands(text):
    """(name, [args]) of every command in a CMake file, comments dropped."""
    text = "\n".join(line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
                     for line in text.splitlines())
    out, pos = [], 0
    while True:
        m = COMMAND.search(text, pos)
        if not m:
            return out
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        out.append((m.group(1), text[m.end():i - 1].split()))
        pos = i


# The project's target wrappers (cmake/KvrTargets.cmake): keyword -> whether what follows it are
# sources or links, and the target's name ("kvr_" + the given name for the libraries, which
# also get the alias kvr::<name>).
WRAPPERS = {
    "kvr_add_library": ("kvr_", {"SOURCES": "sources", "PUBLIC": "links", "PRIVATE": "links"}),
    # Its sources are DIR/src/metrics.cc and metrics_observer.cc (DIR: the calling folder).
    "kvr_add_metric_set": ("kvr_", {"DIR": "dir", "PUBLIC": "links"}),
    "kvr_add_executable": ("", {"SOURCES": "sources", "LIBS": "links"}),
}
WRAPPER_KEYWORDS = {"SOURCES", "INCLUDES", "PRIVATE_INCLUDES", "PUBLIC", "PRIVATE", "LIBS",
                    "INTERFACE", "CUDA", "DIR"}


def wrapper_sections(args, roles):
    """(sources, links) of a wrapper call's arguments: the words after each keyword of `roles`
    up to the next keyword."""
    out = {"sources": [], "links": [], "dir": []}
    role = None
    for a in args[1:]:
        if a in WRAPPER_KEYWORDS:
            role = roles.get(a)
            continue
        if role is not None:
            out[role].append(a)
    if "DIR" in roles:  # kvr_add_metric_set: its sources lie in DIR, else beside the call
        out["sources"] = [(out["dir"][0] + "/" if out["dir"] else "") + "src/metrics.cc"]
    return out["sources"], out["links"]


def source_component(first, folder, rel):
    """The component of a target whose first source is `first` (as written in the CMake file at
    `rel`, in `folder`), or of that file when it names no source."""
    if first is None:
        return component(rel)
    if first.startswith("${PROJECT_SOURCE_DIR}/"):
        first = first[len("${PROJECT_SOURCE_DIR}/"):]
    else:
        first = folder + "/" + first.replace("${CMAKE_CURRENT_SOURCE_DIR}/", "")
    return component(first) or component(rel)


def check_links(root):
    """Errors for CMake targets that link a kvr target of a higher (or same-rank other) layer."""
    defined, aliases, links = {}, {}, []
    for top in sorted({f.split("/")[0] for f in RANK}):
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(list(base.rglob("CMakeLists.txt")) + list(base.rglob("*.cmake"))):
            folder = path.parent.relative_to(root).as_posix()
            rel = path.relative_to(root).as_posix()
            for name, args in cmake_commands(path.read_text(errors="replace")):
                if not args:
                    continue
                if name in ("add_library", "add_executable", "kvr_add_test", "kvr_add_fuzzer"):
                    if len(args) >= 3 and args[1] == "ALIAS":
                        aliases[args[0]] = args[2]
                        continue
                    sources = [a for a in args[1:] if a not in KEYWORDS and "::" not in a]
                    defined[args[0]] = source_component(sources[0] if sources else None, folder,
                                                        rel)
                if name in WRAPPERS and not args[0].startswith("$"):
                    prefix, roles = WRAPPERS[name]
                    target = prefix + args[0]
                    sources, deps = wrapper_sections(args, roles)
                    defined[target] = source_component(sources[0] if sources else None, folder,
                                                       rel)
                    if prefix:
                        aliases["kvr::" + args[0]] = target
                    links.append((rel, target, deps))
                if name in ("target_link_libraries", "kvr_add_test", "kvr_add_fuzzer"):
                    links.append((rel, args[0], args[1:]))
    errors = []
    for rel, target, deps in links:
        folder = defined.get(target)
        if folder is None:
            continue
        rank = RANK[folder]
        for dep in deps:
            dep_target = aliases.get(dep, dep)
            dep_folder = defined.get(dep_target)
            if dep_folder is None:
                continue
            if RANK[dep_folder] <= rank and (dep_folder == folder or RANK[dep_folder] < rank):
                continue
            errors.append(f"{rel}: {target} ({folder}, layer {rank}) links {dep} ({dep_folder}, "
                          f"layer {RANK[dep_folder]})")
    return errors


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent)
    errors = check(root.resolve()) + check_links(root.resolve())
    for e in errors:
        print(e)
    if errors:
        print(f"check_layers: {len(errors)} include(s) or link(s) against the layering "
              "(docs/conventions.md, 'Layers point down only')")
        return 1
    print("check_layers: every include and link points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
