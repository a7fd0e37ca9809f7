#!/usr/bin/env python3
"""Each kvr binary, given the same settings by flag, by KVR_<ROLE>_* environment variables and by
a --config YAML file, prints the same effective config (--print-config), and each line names the
source it came from. Also: flag > file > env when all three are given, the controller's older
KVR_<NAME> spelling, an unknown YAML key refused naming the key and the file, a bad value refused
naming the setting and its source, `kvr up --config` reading YAML, and every --config file of
the Kubernetes manifests (deploy/k8s/**/config/<role>.yaml) accepted by its binary.

Usage: config_sources_test.py --controller BIN --store BIN --prefill BIN --decode BIN --kvr BIN
                              [--deploy DIR]
"""
import glob
import argparse
import os
import subprocess
import sys
import tempfile

# Per binary: its environment role and settings -> (value given, value printed). The values
# differ from the defaults so that a source that was not read shows.
CASES = {
    "controller": ("CONTROLLER", {
        "lease_seconds": ("7.5", "7.5"),
        "max_attempts": ("5", "5"),
        "default_method": ("quest", "quest"),
        "log_level": ("debug", "debug"),
        "health_address": ("127.0.0.1:47100", "127.0.0.1:47100"),
    }),
    "store": ("STORE", {
        "capacity_bytes": ("4GB", "4GB"),  # 4 x 1000^3, not 4GiB
        "page_bytes": ("131072", "128KiB"),
        "evict_expired": ("yes", "true"),
        "controller": ("127.0.0.1:9", "127.0.0.1:9"),
        "health_address": ("127.0.0.1:47100", "127.0.0.1:47100"),
    }),
    "prefill": ("PREFILL", {
        "chunk_tokens": ("256", "256"),
        "device": ("cuda", "cuda"),
        "store_timeout_seconds": ("2.5", "2.5"),
        "node_name": ("p-1", "p-1"),
        "health_address": ("127.0.0.1:47100", "127.0.0.1:47100"),
    }),
    "decode": ("DECODE", {
        "hot_cache_bytes": ("4GiB", "4GiB"),  # 4 x 1024^3
        "batch_slots": ("3", "3"),
        "gpu_lanes": ("exact,pariskv", "exact,pariskv"),
        "quality_sample_rate": ("0.25", "0.25"),
        "health_address": ("127.0.0.1:47100", "127.0.0.1:47100"),
    }),
}

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


def clean_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVR_")}
    env.update(extra or {})
    return env


def run(argv, env=None):
    return subprocess.run(argv, env=clean_env(env), capture_output=True, text=True, timeout=60)


def effective(out):
    """{name: (value, source)} from a --print-config text."""
    config = {}
    for line in out.splitlines():
        if not line or line.startswith("#"):
            continue
        entry, _, source = line.partition("  # ")
        name, _, value = entry.partition(": ")
        config[name] = (value, source)
    return config


def write(tmp, name, text):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def flag(name):
    return "--" + name.replace("_", "-")


def main():
    parser = argparse.ArgumentParser()
    for role in CASES:
        parser.add_argument("--" + role, required=True)
    parser.add_argument("--kvr", required=True)
    parser.add_argument("--deploy", help="deploy/k8s: check its config/<role>.yaml files")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvr-config-sources-")

    for binary, (role, settings) in CASES.items():
        exe = getattr(args, binary)
        flags = [f"{flag(k)}={v}" for k, (v, _) in settings.items()]
        env = {f"KVR_{role}_{k.upper()}": v for k, (v, _) in settings.items()}
        yaml = write(tmp, f"{binary}.yaml", "".join(f"{k}: {v}\n" for k, (v, _) in settings.items()))
        runs = {
            "flag": run([exe, "--print-config", *flags]),
            "env": run([exe, "--print-config"], env),
            "file": run([exe, "--print-config", "--config", yaml]),
            "default": run([exe, "--print-config"]),
        }
        configs = {}
        for source, r in runs.items():
            check(r.returncode == 0, f"{binary} by {source}: exit {r.returncode}: {r.stderr}")
            configs[source] = effective(r.stdout)
        values = {s: {k: v for k, (v, _) in c.items()} for s, c in configs.items()}
        check(values["flag"] == values["env"] == values["file"],
              f"{binary}: flag, env and file give different configs:\n{values}")
        for name, (_, printed) in settings.items():
            check(values["flag"].get(name) == printed,
                  f"{binary}: {name} printed {values['flag'].get(name)!r}, not {printed!r}")
            check(values["default"].get(name) != printed,
                  f"{binary}: {name}'s default is the test value; pick another")
            check(configs["flag"][name][1] == "flag", f"{binary}: {name} not marked # flag")
            check(configs["file"][name][1] == "file", f"{binary}: {name} not marked # file")
            check(configs["env"][name][1] == f"env KVR_{role}_{name.upper()}",
                  f"{binary}: {name} not marked # env KVR_{role}_{name.upper()}")

        # All three at once: the flag wins over the file, the file over the environment.
        first, (value, printed) = next(iter(settings.items()))
        second = list(settings)[1]
        both = write(tmp, f"{binary}-second.yaml", f"{second}: {settings[second][0]}\n")
        r = run([exe, "--print-config", f"{flag(first)}={value}", "--config", both],
                {f"KVR_{role}_{first.upper()}": "1", f"KVR_{role}_{second.upper()}": "1"})
        got = effective(r.stdout)
        check(got.get(first) == (printed, "flag"), f"{binary}: flag does not beat env: {got}")
        check(got.get(second, ("", ""))[1] == "file", f"{binary}: file does not beat env: {got}")

        # Refusals name what is wrong and where.
        typo = write(tmp, f"{binary}-typo.yaml", "no_such_setting: 1\n")
        r = run([exe, "--print-config", "--config", typo])
        check(r.returncode == 2 and "unknown setting 'no_such_setting'" in r.stderr
              and typo in r.stderr, f"{binary}: unknown YAML key: {r.returncode} {r.stderr}")
        integer = next(k for k, (v, _) in settings.items() if v.isdigit())
        r = run([exe, "--print-config"], {f"KVR_{role}_{integer.upper()}": "lots"})
        check(r.returncode == 2 and f"{integer} (environment KVR_{role}_{integer.upper()})"
              in r.stderr, f"{binary}: bad env value: {r.returncode} {r.stderr}")

        r = run([exe, "--help"])
        check(r.returncode == 0 and "--config FILE" in r.stdout and "INT=" in r.stdout,
              f"{binary}: --help shows no types and defaults: {r.stdout}")

    # The controller's older environment spelling, read below the new one.
    r = run([args.controller, "--print-config"], {"KVR_LEASE_SECONDS": "9"})
    check(effective(r.stdout).get("lease_seconds") == ("9", "env KVR_LEASE_SECONDS"),
          f"controller: KVR_LEASE_SECONDS not read: {r.stdout}")
    r = run([args.controller, "--print-config"],
            {"KVR_LEASE_SECONDS": "9", "KVR_CONTROLLER_LEASE_SECONDS": "8"})
    check(effective(r.stdout).get("lease_seconds", ("",))[0] == "8",
          f"controller: KVR_CONTROLLER_LEASE_SECONDS does not beat KVR_LEASE_SECONDS")

    # kvr up: the same YAML mechanism (flags and file; no environment of its own).
    up_yaml = write(tmp, "up.yaml", "stores: 2\nstore_capacity: 512MiB\n"
                    "decode_arg: [--batch-slots=32, \"--gpu-lanes=exact,pariskv\"]\n")
    by_file = run([args.kvr, "up", "--print-config", "--config", up_yaml])
    by_flag = run([args.kvr, "up", "--print-config", "--stores=2", "--store-capacity=512MiB",
                   "--decode-arg=--batch-slots=32", "--decode-arg=--gpu-lanes=exact,pariskv"])
    check(by_file.returncode == 0 and by_flag.returncode == 0,
          f"kvr up --print-config: {by_file.stderr} {by_flag.stderr}")
    file_values = {k: v for k, (v, _) in effective(by_file.stdout).items()}
    flag_values = {k: v for k, (v, _) in effective(by_flag.stdout).items()}
    check(file_values == flag_values, f"kvr up: flag and file differ:\n{file_values}\n{flag_values}")
    check(file_values.get("decode_arg") == "[--batch-slots=32, \"--gpu-lanes=exact,pariskv\"]",
          f"kvr up: decode_arg is {file_values.get('decode_arg')}")
    r = run([args.kvr, "up", "--print-config", "--insecure", "--detach=false"])
    check(effective(r.stdout).get("insecure") == ("true", "flag"),
          f"kvr up: a bare --insecure is not true: {r.stdout} {r.stderr}")
    typo = write(tmp, "up-typo.yaml", "store: 2\n")
    r = run([args.kvr, "up", "--config", typo])
    check(r.returncode != 0 and "unknown setting 'store'" in r.stderr,
          f"kvr up: unknown key: {r.stderr}")

    # The manifests' config files: every key known, every value valid.
    if args.deploy:
        files = glob.glob(os.path.join(args.deploy, "**", "config", "*.yaml"), recursive=True)
        check(files, f"no config files under {args.deploy}")
        for path in files:
            role = os.path.splitext(os.path.basename(path))[0]
            exe = getattr(args, role, None)
            check(exe is not None, f"{path}: no binary for role {role}")
            if exe:
                r = run([exe, "--print-config", "--config", path])
                check(r.returncode == 0, f"{path}: {r.stderr}")

    if failures:
        print(f"{len(failures)} failure(s)", file=sys.stderr)
        return 1
    print("every binary reads its settings the same from flags, KVR_<ROLE>_* and YAML")
    return 0


if __name__ == "__main__":
    sys.exit(main())
