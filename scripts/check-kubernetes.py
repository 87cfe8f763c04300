#!/usr/bin/env python3
"""Consistency checks of the built Kubernetes manifests against the worker's config.

Usage: check-kubernetes.py BINARY BUILT.yaml [BUILT.yaml ...]
       check-kubernetes.py --self-test BINARY BUILT.yaml

Each BUILT.yaml is the output of `kubectl kustomize <dir>`. Schema validation of the
built-in kinds is kubernetes-validate's job (scripts/check-kubernetes runs it); this
checks what no schema knows: that the Deployment, its config, the Service, the
PodDisruptionBudget, the ServiceMonitor and the KEDA ScaledObject agree with each other
and with config.toml (grace vs terminationGracePeriodSeconds, probe and metrics ports vs
server.listen, the stream and group KEDA reads vs queue.namespace and queue.group,
lagCount vs worker.concurrency, maxReplicaCount vs the slots), and that the config
itself passes `llm-worker check-config`.

--self-test breaks one thing at a time in a copy and requires the check to fail on each,
so a check that cannot fail is caught.
"""

import copy
import math
import os
import subprocess
import sys
import tempfile
import tomllib

import yaml

# The metadata keys KEDA's redis stream scalers read (a misspelt key is silently ignored
# by KEDA, so it is an error here).
KEDA_STREAM_KEYS = {
    "address", "addresses", "host", "hosts", "port", "ports", "stream", "consumerGroup",
    "pendingEntriesCount", "streamLength", "lagCount", "activationLagCount",
    "activationPendingEntriesCount", "activationStreamLength", "databaseIndex",
    "enableTLS", "unsafeSsl", "usernameFromEnv", "passwordFromEnv",
}
KEDA_TYPES = {"redis-streams", "redis-cluster-streams"}


class Fail(Exception):
    pass


def need(cond, what):
    if not cond:
        raise Fail(what)


def by_kind(docs, kind):
    return [d for d in docs if d and d.get("kind") == kind]


def one(docs, kind):
    found = by_kind(docs, kind)
    need(len(found) == 1, f"expected one {kind}, found {len(found)}")
    return found[0]


def apply_env(cfg, env):
    """LLM_WORKER__SECTION__KEY=value overrides, as the worker applies them."""
    for name, value in env.items():
        if not name.startswith("LLM_WORKER__"):
            continue
        path = name[len("LLM_WORKER__"):].lower().split("__")
        node = cfg
        for part in path[:-1]:
            node = node.setdefault(part, {})
        try:
            value = int(value)
        except ValueError:
            pass
        node[path[-1]] = value


def selector_matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check(docs, binary, where):
    dep = one(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    need(selector_matches(dep["spec"]["selector"]["matchLabels"], pod_labels),
         "Deployment selector does not match its pod labels")
    need(len(spec["containers"]) == 1, "one container expected")
    c = spec["containers"][0]

    # Security: non-root, read-only root fs, no privilege escalation, no capabilities,
    # seccomp RuntimeDefault.
    psc = spec.get("securityContext", {})
    csc = c.get("securityContext", {})
    need(psc.get("runAsNonRoot") is True, "pod securityContext.runAsNonRoot must be true")
    need(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
         "pod seccompProfile must be RuntimeDefault")
    need(csc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem must be true")
    need(csc.get("allowPrivilegeEscalation") is False,
         "allowPrivilegeEscalation must be false")
    need(csc.get("capabilities", {}).get("drop") == ["ALL"], "capabilities must drop ALL")
    need(c.get("resources", {}).get("limits", {}).get("memory"), "a memory limit is required")

    # The config: the ConfigMap mounted where --config points, plus literal env overrides.
    args = c.get("args", [])
    need("--config" in args, "the container must pass --config")
    config_path = args[args.index("--config") + 1]
    mount = next((m for m in c.get("volumeMounts", [])
                  if config_path.startswith(m["mountPath"].rstrip("/") + "/")), None)
    need(mount is not None, f"no volume mounted at {config_path}")
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm_name = vol["configMap"]["name"]
    cm = next((d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == cm_name), None)
    need(cm is not None, f"ConfigMap {cm_name} is mounted but not in the build")
    key = os.path.relpath(config_path, mount["mountPath"])
    item = next((i for i in vol["configMap"].get("items", []) if i["path"] == key), None)
    toml_text = cm["data"][item["key"] if item else key]
    cfg = tomllib.loads(toml_text)
    env_literal = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    env_from = {e["name"]: e["valueFrom"] for e in c.get("env", []) if "valueFrom" in e}
    apply_env(cfg, {k: v for k, v in env_literal.items() if "$(" not in v})

    # Consumer name from the pod name (downward API).
    need(env_literal.get("LLM_WORKER__QUEUE__CONSUMER") == "$(POD_NAME)",
         "LLM_WORKER__QUEUE__CONSUMER must be $(POD_NAME)")
    need(env_from.get("POD_NAME", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
         "POD_NAME must come from the downward API (metadata.name)")

    # The worker's own validation of the config.
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml_text)
        path = f.name
    try:
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_WORKER__")}
        run_env.update({k: v for k, v in env_literal.items() if "$(" not in v})
        for pname, p in cfg.get("providers", {}).items():
            if p.get("api_key_env"):
                run_env[p["api_key_env"]] = "placeholder-for-check-config"
            run_env[f"LLM_WORKER__PROVIDERS__{pname.upper()}__VALIDATE_KEY"] = "false"
        r = subprocess.run([binary, "--config", path, "check-config"], env=run_env,
                           capture_output=True, text=True, timeout=60)
        need(r.returncode == 0, f"check-config failed: {r.stderr.strip()}")
    finally:
        os.unlink(path)

    # Grace: the pod must outlive the drain (grace) plus the release of its slots.
    grace_s = cfg["worker"]["shutdown_grace_ms"] / 1000
    tgps = spec.get("terminationGracePeriodSeconds", 30)
    need(tgps >= grace_s + 5,
         f"terminationGracePeriodSeconds {tgps} must be at least worker.shutdown_grace_ms "
         f"({grace_s:g} s) + 5 s")

    # Probes and ports: server.listen's port is the container port the probes use.
    listen = cfg.get("server", {}).get("listen", "")
    need(listen, "server.listen must be set (probes and metrics need it)")
    port = int(listen.rsplit(":", 1)[1])
    need(not listen.startswith("127.") and not listen.startswith("[::1]"),
         "server.listen must not be loopback-only in a pod (probes come from the kubelet)")
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    need(port in ports.values(), f"containerPort {port} (server.listen) is not declared")

    def probe_port(probe):
        p = probe["httpGet"]["port"]
        return ports.get(p) if isinstance(p, str) else p

    need(c["livenessProbe"]["httpGet"]["path"] == "/health", "liveness must probe /health")
    need(c["readinessProbe"]["httpGet"]["path"] == "/ready", "readiness must probe /ready")
    need(probe_port(c["livenessProbe"]) == port, "liveness probe port is not server.listen's")
    need(probe_port(c["readinessProbe"]) == port, "readiness probe port is not server.listen's")

    # Service and PodDisruptionBudget select these pods; the Service's target is the port.
    svc = one(docs, "Service")
    need(selector_matches(svc["spec"]["selector"], pod_labels),
         "Service selector does not match the pods")
    for sp in svc["spec"]["ports"]:
        t = sp["targetPort"]
        need((ports.get(t) if isinstance(t, str) else t) == port,
             f"Service port {sp.get('name')} does not target server.listen's port")
    pdb = one(docs, "PodDisruptionBudget")
    need(selector_matches(pdb["spec"]["selector"]["matchLabels"], pod_labels),
         "PodDisruptionBudget selector does not match the pods")

    for sm in by_kind(docs, "ServiceMonitor"):
        need(selector_matches(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"]),
             "ServiceMonitor does not select the metrics Service")
        names = {p.get("name") for p in svc["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            need(ep.get("port") in names, f"ServiceMonitor port {ep.get('port')} is not a Service port")
            need(ep.get("path", "/metrics") == "/metrics", "ServiceMonitor must scrape /metrics")

    # KEDA: the stream and group the worker reads, lag per pod = concurrency, a single job
    # wakes a pod, and no more pods than the slots can keep busy.
    auths = {a["metadata"]["name"]: a for a in by_kind(docs, "TriggerAuthentication")}
    for so in by_kind(docs, "ScaledObject"):
        s = so["spec"]
        need(s["scaleTargetRef"]["name"] == dep["metadata"]["name"],
             "ScaledObject does not target the Deployment")
        need(s.get("minReplicaCount") == 0, "minReplicaCount must be 0 (scale to zero when idle)")
        ns = cfg["queue"]["namespace"]
        group = cfg["queue"]["group"]
        conc = cfg["worker"]["concurrency"]
        slots = sum(p.get("slots", 0) for p in cfg.get("pools", {}).values())
        ceiling = math.ceil(slots / conc) + 1
        need(1 <= s["maxReplicaCount"] <= ceiling,
             f"maxReplicaCount {s['maxReplicaCount']} must be 1..{ceiling} "
             f"(ceil(slots {slots} / concurrency {conc}) + 1)")
        kinds = set()
        for t in s["triggers"]:
            need(t["type"] in KEDA_TYPES, f"trigger type {t['type']} is not a redis stream scaler")
            m = t["metadata"]
            unknown = set(m) - KEDA_STREAM_KEYS
            need(not unknown, f"unknown KEDA metadata keys {sorted(unknown)}")
            need(m.get("stream") == "{%s}:jobs" % ns, f"trigger stream {m.get('stream')} is not {{{ns}}}:jobs")
            need(m.get("consumerGroup") == group, f"trigger group {m.get('consumerGroup')} is not {group}")
            if "lagCount" in m:
                kinds.add("lag")
                need(int(m["lagCount"]) == conc, f"lagCount {m['lagCount']} must be worker.concurrency {conc}")
                need(m.get("activationLagCount") == "0", "activationLagCount must be \"0\" (one job wakes a pod)")
            if "pendingEntriesCount" in m:
                kinds.add("pending")
                need(int(m["pendingEntriesCount"]) == conc,
                     f"pendingEntriesCount {m['pendingEntriesCount']} must be worker.concurrency {conc}")
            if t["type"] == "redis-streams":
                host_port = cfg["redis"]["url"].split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
                need(m.get("address") == host_port,
                     f"trigger address {m.get('address')} is not redis.url's {host_port}")
                need("." in host_port.split(":")[0],
                     "redis.url's host must be namespace-qualified (KEDA resolves it from its own namespace)")
            if cfg["redis"].get("password_env"):
                ref = t.get("authenticationRef", {}).get("name")
                need(ref in auths, f"trigger authenticationRef {ref} is not in the build")
                keys = {(x["name"], x["key"]) for x in auths[ref]["spec"]["secretTargetRef"]
                        if x["parameter"] == "password"}
                pw = env_from.get(cfg["redis"]["password_env"], {}).get("secretKeyRef", {})
                need((pw.get("name"), pw.get("key")) in keys,
                     "TriggerAuthentication's password is not the Secret key the pods use")
        need(kinds == {"lag", "pending"}, "want one lagCount and one pendingEntriesCount trigger")
    print(f"ok {where}: {len(docs)} objects consistent (grace {grace_s:g} s < {tgps} s, port {port})")


def self_test(binary, docs):
    def mutate(f):
        d = copy.deepcopy(docs)
        f(d)
        return d

    def dep(d):
        return one(d, "Deployment")["spec"]["template"]["spec"]

    def trig(d, i):
        return one(d, "ScaledObject")["spec"]["triggers"][i]["metadata"]

    def cm(d):
        return one(d, "ConfigMap")["data"]

    breaks = {
        "grace shorter than the drain": lambda d: dep(d).update(terminationGracePeriodSeconds=10),
        "liveness on another port": lambda d: dep(d)["containers"][0]["livenessProbe"]["httpGet"].update(port=9999),
        "writable root fs": lambda d: dep(d)["containers"][0]["securityContext"].update(readOnlyRootFilesystem=False),
        "lagCount not the concurrency": lambda d: trig(d, 0).update(lagCount="5"),
        "wrong stream": lambda d: trig(d, 0).update(stream="jobs"),
        "misspelt KEDA key": lambda d: trig(d, 1).update(pendingEntryCount="3"),
        "too many replicas": lambda d: one(d, "ScaledObject")["spec"].update(maxReplicaCount=50),
        "bad config": lambda d: cm(d).update({"config.toml": cm(d)["config.toml"].replace("[worker]", "[worker]\nconcurency = 3")}),
        "consumer not the pod name": lambda d: [e.update(value="w") for e in dep(d)["containers"][0]["env"]
                                                if e["name"] == "LLM_WORKER__QUEUE__CONSUMER"],
    }
    check(docs, binary, "self-test baseline")
    for what, f in breaks.items():
        try:
            check(mutate(f), binary, what)
        except Fail as e:
            print(f"ok self-test: {what} -> {e}")
            continue
        raise SystemExit(f"FAIL self-test: {what} was not caught")


def main():
    argv = sys.argv[1:]
    selftest = argv and argv[0] == "--self-test"
    if selftest:
        argv = argv[1:]
    binary, files = argv[0], argv[1:]
    for path in files:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        try:
            if selftest:
                self_test(binary, docs)
            else:
                check(docs, binary, path)
        except Fail as e:
            raise SystemExit(f"FAIL {path}: {e}")


if __name__ == "__main__":
    main()
