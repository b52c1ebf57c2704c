"""deploy/kubernetes/: every manifest is what the Kubernetes API reads (each document through the kubernetes
client's model of its kind and back, equal to the YAML: the client drops a misspelt field silently, so it
shows as a difference), the manifests agree with each other, and the pods they describe run: the
environment and command each pod would get, as processes on network-namespace hosts whose /etc/hosts
maps the pods' names (full: a few seconds of six processes)."""

from __future__ import annotations

import base64
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from commlab.transport import keys

yaml = pytest.importorskip("yaml", reason="the manifest tests need PyYAML (in the test extra)")
kubernetes = pytest.importorskip("kubernetes", reason="the manifest tests need the kubernetes client (in the test extra)")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
MODELS = {("v1", "Service"): "V1Service", ("v1", "Secret"): "V1Secret", ("apps/v1", "StatefulSet"): "V1StatefulSet",
          ("batch/v1", "Job"): "V1Job"}


@functools.lru_cache(maxsize=None)
def secrets_yaml(workers: int = 4) -> str:
    """What ``deploy/kubernetes/make_secrets.py --workers N`` writes (fresh keys, made once per test run)."""
    spec = importlib.util.spec_from_file_location("make_secrets", K8S / "make_secrets.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    with tempfile.TemporaryDirectory(prefix="commlab-keys-") as tmp:
        folder = keys.create(Path(tmp) / "keys", [f"w{r}" for r in range(workers)])
        return make.documents(folder, workers, os.urandom(32).hex().encode())


def manifests() -> dict[str, list[dict]]:
    """file name -> its YAML documents; the Secrets as make_secrets.py writes them."""
    out = {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(K8S.glob("*.yaml"))}
    out["make_secrets.py"] = [d for d in yaml.safe_load_all(secrets_yaml()) if d]
    return out


def by_kind(kind: str, name: str | None = None) -> dict:
    found = [d for docs in manifests().values() for d in docs
             if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml")) + ["make_secrets.py"])
def test_each_manifest_is_what_the_kubernetes_api_reads(name):
    from kubernetes.client import ApiClient

    api = ApiClient()
    docs = manifests()[name]
    assert docs, f"{name} holds no document"
    for doc in docs:
        model = MODELS[(doc["apiVersion"], doc["kind"])]
        obj = api._ApiClient__deserialize(doc, model)
        assert api.sanitize_for_serialization(obj) == doc, f"{name}: {doc['kind']} {doc['metadata']['name']}"


def test_the_manifests_agree_with_each_other():
    service, ps, job = by_kind("Service"), by_kind("StatefulSet"), by_kind("Job")
    name = service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert ps["spec"]["serviceName"] == job["spec"]["template"]["spec"]["subdomain"] == name
    for pod in (ps["spec"]["template"], job["spec"]["template"]):  # the Service selects both kinds of pod
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert job["spec"]["completionMode"] == "Indexed"
    (worker,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["RANK"]["value"] == "$(JOB_COMPLETION_INDEX)"
    assert [e["name"] for e in worker["env"]].index("JOB_COMPLETION_INDEX") < [e["name"] for e in worker["env"]].index("RANK")
    world = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == world and env["WORLD_SIZE"]["value"] == str(world)
    assert env["MASTER_ADDR"]["value"] == f"{job['metadata']['name']}-0.{name}"  # rank 0's pod hosts the store
    shards = ps["spec"]["replicas"]
    (server,) = ps["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e for e in server["env"]}["SHARDS"]["value"] == str(shards)
    url = env["COMMLAB_EXCHANGER"]["value"]
    assert url.startswith("ps://" + ",".join(f"{ps['metadata']['name']}-{i}.{name}:5555" for i in range(shards)) + "?")
    # the metrics port: annotated, served, declared
    port = ps["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]
    assert server["args"][server["args"].index("--metrics-port") + 1] == port
    assert {"name": "metrics", "containerPort": int(port)} in server["ports"]
    assert server["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": int(port)}
    # every Secret a pod reads is one make_secrets.py makes, with the keys the pod reads
    made = {d["metadata"]["name"]: d["data"] for d in manifests()["make_secrets.py"]}
    for pod in (ps["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        for volume in pod["volumes"]:
            assert volume["secret"]["secretName"] in made
        for c in pod["containers"]:
            for e in c["env"]:
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in made[ref["name"]], ref
    assert set(made["commlab-client-keys"]) == {f"w{r}.key" for r in range(world)}


def test_the_slurm_script_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "deploy" / "slurm" / "commlab.sbatch")], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr


# ----- the pods, run here ---------------------------------------------------------------------------------
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes's $(VAR) expansion: a variable defined before is replaced, any other is left as it is."""
    return VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def field_ref(path: str, meta: dict) -> str:
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return meta[m.group(1)][m.group(2)]
    if path == "metadata.name":
        return meta["name"]
    raise AssertionError(f"a fieldRef this test does not resolve: {path}")


def pod_command(spec: dict, meta: dict, secrets: dict[str, dict], root: Path, overrides: dict[str, str]):
    """``(argv, env)`` of the pod's one container, as the kubelet would start it: the env list in order (values,
    fieldRefs, secretKeyRefs, $(VAR) expansion), each Secret volume written under ``root`` (mode defaultMode)
    and its mount path mapped there, ``python`` this interpreter. ``overrides``: values replaced by name."""
    (c,) = spec["containers"]
    mounts = {}
    for m in c.get("volumeMounts", []):
        (vol,) = [v for v in spec["volumes"] if v["name"] == m["name"]]
        folder = root / meta["name"] / m["mountPath"].lstrip("/")
        folder.mkdir(parents=True)
        for key, value in secrets[vol["secret"]["secretName"]].items():
            path = folder / key
            path.write_bytes(base64.b64decode(value))
            path.chmod(vol["secret"].get("defaultMode", 0o644))
        mounts[m["mountPath"]] = str(folder)
    remap = lambda s: next((s.replace(k, v) for k, v in mounts.items() if k in s), s)
    env: dict[str, str] = {}
    for e in c["env"]:
        if e["name"] in overrides:
            env[e["name"]] = overrides[e["name"]]
        elif "value" in e:
            env[e["name"]] = remap(expand(e["value"], env))
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = field_ref(e["valueFrom"]["fieldRef"]["fieldPath"], meta)
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    argv = [remap(expand(a, env)) for a in [*c["command"], *c.get("args", [])]]
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]], env


def real_start(procs, cmd: list[str], env: dict) -> subprocess.Popen:
    """``cmd`` started for real (not by the tests' fork server, whose ``ip netns exec`` leaves out the /etc
    mounts: the pods' names would not resolve), with the tests' environment plus ``env``; stopped with ``procs``."""
    from commlab.launch import launcher
    from conftest import REAL_STARTS
    from faultkit import ENV, REPO

    p = launcher.start_group(cmd, {**ENV, **REAL_STARTS, **env}, starter=launcher.plain_start, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.procs.append(launcher.Proc(f"process {len(procs.procs)}", p))
    return p


FETCH = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())
"""


@pytest.mark.full
@pytest.mark.netns
@pytest.mark.multiproc
def test_the_pods_run_across_namespace_hosts_and_their_metrics_are_scraped_off_loopback(tmp_path):
    from bench import netns
    from faultkit import Procs, finish

    reason = netns.link_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    service, ps, job = by_kind("Service"), by_kind("StatefulSet"), by_kind("Job")
    secrets = {d["metadata"]["name"]: d["data"] for d in yaml.safe_load_all(secrets_yaml(job["spec"]["completions"]))}
    domain, shards, world = service["metadata"]["name"], ps["spec"]["replicas"], job["spec"]["completions"]
    pods = []  # (name, pod spec, metadata)
    for i in range(shards):
        meta = {"name": f"{ps['metadata']['name']}-{i}", "labels": {**ps["spec"]["template"]["metadata"]["labels"],
                                                                    "apps.kubernetes.io/pod-index": str(i)},
                "annotations": dict(ps["spec"]["template"]["metadata"].get("annotations", {}))}
        pods.append((meta["name"], ps["spec"]["template"]["spec"], meta))
    for r in range(world):
        meta = {"name": f"{job['metadata']['name']}-{r}", "labels": dict(job["spec"]["template"]["metadata"]["labels"]),
                "annotations": {"batch.kubernetes.io/job-completion-index": str(r)}}
        pods.append((meta["name"], job["spec"]["template"]["spec"], meta))
    tag = f"ck{os.getpid() % 100000}"
    procs = Procs(tmp_path)
    etc = [Path("/etc/netns") / f"{tag}h{h}" for h in range(len(pods))]
    with netns.Links(len(pods), None, tag=tag, subnet="10.95.0") as links:
        try:
            hosts = "127.0.0.1 localhost\n" + "".join(f"{links.addr(h)} {name}.{domain}\n"
                                                       for h, (name, _, _) in enumerate(pods))
            for folder in etc:  # ip netns exec mounts /etc/netns/NS/hosts on /etc/hosts: the cluster's DNS, here
                folder.mkdir(parents=True)
                (folder / "hosts").write_text(hosts)
            started = []
            for h, (name, spec, meta) in enumerate(pods):
                argv, env = pod_command(spec, meta, secrets, tmp_path / "pods", {"STEPS": "4"})
                started.append(real_start(procs, [*links.prefix(h), *argv], env))
            results = finish(started[shards:], timeout=150)  # the workers end; the shards serve on
            for r, (code, _, err) in enumerate(results):
                assert code == 0, f"rank {r}: {err[-3000:]}"
            # a Prometheus in the cluster scrapes each shard at its pod address and annotated port
            port = ps["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]
            for i in range(shards):
                fetch = real_start(procs, [*links.prefix(shards), sys.executable, "-c", FETCH,
                                           f"http://{pods[i][0]}.{domain}:{port}/metrics"], {})
                (code, out, err), = finish([fetch], timeout=60)
                assert code == 0, err[-3000:]
                # sync: one update per step, over the job's every rank
                assert f'commlab_server_updates_total{{shard="{i}",space="(first)"}} 4.0' in out, out[-3000:]
                assert f'commlab_server_world{{shard="{i}",space="(first)"}} {float(world)}' in out, out[-3000:]
                assert f'commlab_server_workers{{shard="{i}",space="(first)"}} {float(world)}' in out, out[-3000:]
        finally:
            procs.close()
            for folder in etc:
                shutil.rmtree(folder, ignore_errors=True)
    assert not any(folder.exists() for folder in etc)
