"""``mdtk launch --scheduler k8s``: the TrainJob and JobSet manifests against the CRDs of the
versions targeted (tests/data/k8s/: Kubeflow Trainer v2.3.0, JobSet v0.9.1), what the schemas
cannot say (counts, env, rendezvous, names, mounts, the runtime's names), the pods' view of
their environment, and bad input. All in process: nothing starts.

The real pods' run (2 "pods" x 1 process started with the manifest's command and environment,
one killed and restarted as the next attempt) is in test_launch_faults.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from dist_checks import k8s_pods

from toolkit.errors import EXIT_STATUS

DATA = Path(__file__).resolve().parent / "data" / "k8s"
CRDS = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml", "JobSet": "jobset.x-k8s.io_jobsets.yaml"}
SHAPES = [  # nodes, GPUs per node, overrides, expected dp
    (1, 8, ["parallel.tp=2"], 4),
    (2, 8, ["parallel.tp=4", "parallel.pp=2"], 2),
    (4, 4, ["parallel.tp=2", "parallel.pp=2"], 4),
]


def _load(name: str):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 0.06 s for both CRDs, not 3 s
    return yaml.load((DATA / name).read_text(), Loader=loader)


# -- the CRD schemas as the API server applies them ----------------------------------------------

def _strict(schema: dict) -> dict:
    """The schema with unknown fields refused (``kubectl create``'s strict field validation;
    without it the API server drops them silently): every object schema that lists its
    properties gets ``additionalProperties: false``."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    return out


def _list_map_keys(validator, keys, instance, schema):
    """``x-kubernetes-list-type: map``: no two entries with the same keys (env names, volume
    names, container names, mount paths)."""
    if not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        key = tuple(item.get(k) for k in keys)
        if key in seen:
            same = dict(zip(keys, key, strict=True))
            yield jsonschema.ValidationError(f"two entries with {same}")
        seen.add(key)


KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": _list_map_keys})

#: The CEL rules (x-kubernetes-validations) of both CRDs, each checked here in Python; a rule
#: on a field the manifests set that is not in this table fails the test.
CEL = {
    "self == oldSelf": lambda obj, doc: True,  # immutability: updates only
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')":
        lambda obj, doc: re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"]),
    "size(self.metadata.name) <= 63": lambda obj, doc: len(obj["metadata"]["name"]) <= 63,
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))":
        lambda obj, doc: obj.get("startupPolicy", {}).get("startupPolicyOrder") != "InOrder"
        or not any("dependsOn" in r for r in obj["replicatedJobs"]),
}


def _cel_rules(schema: dict, obj, doc: dict) -> list[str]:
    """The CEL rules on the fields ``obj`` sets that fail (or that CEL lacks a check for)."""
    failed = []
    for rule in schema.get("x-kubernetes-validations", []):
        check = CEL.get(rule["rule"])
        if check is None or not check(obj, doc):
            failed.append(rule["rule"])
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = schema.get("properties", {}).get(k) or schema.get("additionalProperties")
            if isinstance(sub, dict):
                failed += _cel_rules(sub, v, doc)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for v in obj:
            failed += _cel_rules(schema["items"], v, doc)
    return failed


@pytest.fixture(scope="module")
def crds() -> dict:
    out = {}
    for kind, name in CRDS.items():
        crd = _load(name)
        (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
        schema = version["schema"]["openAPIV3Schema"]
        out[kind] = (f"{crd['spec']['group']}/{version['name']}", schema,
                     KubeValidator(_strict(schema)))
    return out


def validate(doc: dict, crds: dict) -> None:
    """``doc`` as the API server would check it: apiVersion, the structural schema (strict),
    the CEL rules, and ObjectMeta's name."""
    api, schema, validator = crds[doc["kind"]]
    assert doc["apiVersion"] == api
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(doc)]
    assert not errors, "\n".join(errors[:20])
    assert not _cel_rules(schema, doc, doc)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])


def test_the_validator_refuses_what_the_api_server_refuses(crds):
    """The checks above can fail: a misspelt field, a wrong type, a quantity that is not one,
    two env entries of one name, a name the CEL rule refuses."""
    from toolkit.launch.k8s import K8sJob, trainjob

    job = trainjob(K8sJob(name="ok", kind="trainjob", image="i", nodes=2, gpus=8,
                          config="bundled:x.yaml", overrides=(), config_text=None, env={}))
    validate(job, crds)

    def broken(change) -> dict:
        doc = yaml.safe_load(yaml.safe_dump(job))
        change(doc)
        return doc

    trainer = lambda d: d["spec"]["trainer"]  # noqa: E731
    pod = lambda d: d["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][  # noqa: E731
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    for change, words in [
        (lambda d: trainer(d).update(numNode=2), "'numNode' was unexpected"),
        (lambda d: trainer(d).update(numNodes="2"), "'2' is not of type 'integer'"),
        (lambda d: pod(d)["volumes"][0]["emptyDir"].update(sizeLimit="16 GB"), "16 GB"),
        (lambda d: trainer(d)["env"].append(dict(trainer(d)["env"][0])), "two entries"),
    ]:
        with pytest.raises(AssertionError, match=re.escape(words)):
            validate(broken(change), crds)
    bad_name = broken(lambda d: d["metadata"].update(name="Bad_Name"))
    assert _cel_rules(crds["TrainJob"][1], bad_name, bad_name) == [
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"]


# -- the command, in process ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """The launch tests' tiny config, its output on the volume mounted at /mnt/ckpt."""
    root = tmp_path_factory.mktemp("k8s")
    cfg = root / "tiny.yaml"
    cfg.write_text(
        "output_dir: /mnt/ckpt/run\n"
        "model: {config: bundled:examples/tiny_llama_config.json, tokenizer: tok}\n"
        "data: {mode: pretrain, sources: [bundled:examples/data/pretrain.jsonl]}\n"
        "train: {steps: 10, micro_batch: 1, global_batch: 64, seq_len: 64}\n")
    return cfg


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``mdtk ARGS`` through ``cli.main`` (as the console script runs it): status, out, err."""
    from toolkit import cli

    monkeypatch.setattr("sys.argv", ["mdtk", *args])
    before = dict(os.environ)  # a torchrun dry run sets the launch's defaults in os.environ
    try:
        cli.main()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    finally:
        for var in set(os.environ) - set(before):
            del os.environ[var]
        os.environ.update(before)
    out, err = capsys.readouterr()
    return status, out, err


VARIANTS = {  # more overrides, more options, whether the config is a file (in a ConfigMap)
    "plain": ([], [], True),
    "queued": (["model.tokenizer=/mnt/data/tokenizer"],
               ["--queue", "team-a", "--namespace", "research", "--volume", "data:/mnt/data",
                "--max-restarts", "5"], False),
}


def _overrides(overrides: list[str], variant: str) -> list[str]:
    return [*overrides, *VARIANTS[variant][0], "output_dir=/mnt/ckpt/run"]


def _manifest(monkeypatch, capsys, config, kind, nodes, gpus, overrides, variant):
    _, extra, file_config = VARIANTS[variant]
    if kind == "trainjob":
        extra = [a for a in extra if a not in ("--max-restarts", "5")]
    cfg = str(config) if file_config else "bundled:examples/pretrain_tiny.yaml"
    status, out, err = _main(
        monkeypatch, capsys, "launch", cfg, *_overrides(overrides, variant),
        "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--scheduler", "k8s",
        "--k8s-kind", kind, "--image", "registry.example/mdtk:0.1", "--volume",
        "ckpt:/mnt/ckpt", "--network", "ib", "--stop-minutes", "7", "--job-name", "tiny-run",
        *extra, "--dry-run")
    assert status == 0, err
    return list(yaml.safe_load_all(out)), err


def _pod(job: dict) -> tuple[dict, dict]:
    """(pod spec patch or template, node container's mounts/volumes holder)."""
    spec = (job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
            if job["kind"] == "TrainJob" else job["spec"])
    (rjob,) = spec["replicatedJobs"]
    assert rjob["name"] == "node"
    pod = rjob["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("nodes,gpus,overrides,dp", SHAPES)
@pytest.mark.parametrize("kind", ["trainjob", "jobset"])
def test_manifest_validates_against_the_crd_and_counts_right(
        crds, config, monkeypatch, capsys, kind, nodes, gpus, overrides, dp, variant):
    docs, err = _manifest(monkeypatch, capsys, config, kind, nodes, gpus, overrides, variant)
    assert f"{nodes} x {gpus} = {nodes * gpus} ranks: dp={dp}" in err
    job = k8s_pods.job_of(docs)
    validate(job, crds)
    queued = variant == "queued"
    # the counts
    if kind == "trainjob":
        t = job["spec"]["trainer"]
        assert (t["numNodes"], t["numProcPerNode"]) == (nodes, gpus)
        assert t["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": gpus}
        assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    else:
        (rjob,) = job["spec"]["replicatedJobs"]
        spec = rjob["template"]["spec"]
        assert rjob["replicas"] == 1 and spec["completionMode"] == "Indexed"
        assert spec["parallelism"] == spec["completions"] == nodes
        assert spec["backoffLimit"] == 0  # a failed pod fails its Job: JobSet restarts them all
        assert job["spec"]["failurePolicy"] == {"maxRestarts": 5 if queued else 3}
        assert job["spec"]["network"]["enableDNSHostnames"] is True  # the headless service
        _, c = _pod(job)
        assert c["resources"]["limits"] == {"nvidia.com/gpu": gpus}
    command = k8s_pods.container(job)["command"]
    tail = [*_overrides(overrides, variant), "--nodes", str(nodes), "--gpus-per-node", str(gpus),
            "--in-pod"]
    assert command[:2] == ["mdtk", "launch"] and command[3:] == tail
    # Kueue, namespace
    labels = job["metadata"]["labels"]
    assert labels.get("kueue.x-k8s.io/queue-name") == ("team-a" if queued else None)
    assert job["metadata"].get("namespace") == ("research" if queued else None)
    _check_pod(job, docs, config, gpus, queued)
    env = {e["name"]: e.get("value") for e in k8s_pods.container(job)["env"]}
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the NCCL defaults, as for Slurm
    assert (env.get("NCCL_IB_DISABLE"), env.get("NCCL_SOCKET_IFNAME")) == (
        ("0", "^lo,docker,virbr") if nodes > 1 else (None, None))
    if kind == "jobset":
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("tiny-run-node-0-0.tiny-run", "29500")
    _check_rendezvous(monkeypatch, capsys, job, docs, nodes, gpus, config)


def _check_pod(job: dict, docs: list[dict], config: Path, gpus: int, queued: bool) -> None:
    """/dev/shm, the config, the volumes, the grace period."""
    pod, c = _pod(job)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{2 * gpus}Gi"}
    claims = {p: v["persistentVolumeClaim"]["claimName"] for p, v in mounts.items()
              if "persistentVolumeClaim" in v}
    assert claims == ({"/mnt/ckpt": "ckpt", "/mnt/data": "data"} if queued
                      else {"/mnt/ckpt": "ckpt"})
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    command = k8s_pods.container(job)["command"]
    if queued:  # a bundled config resolves inside the image
        assert not maps and command[2] == "bundled:examples/pretrain_tiny.yaml"
    else:  # the file, byte for byte, where the command reads it
        (cm,) = maps
        assert cm["data"] == {"config.yaml": config.read_text()}
        assert mounts["/etc/mdtk"]["configMap"]["name"] == cm["metadata"]["name"]
        assert command[2] == "/etc/mdtk/config.yaml"
    env = {e["name"]: e for e in k8s_pods.container(job)["env"]}
    assert pod["terminationGracePeriodSeconds"] == 7 * 60
    assert 30 <= int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"]) < 7 * 60
    assert env["JOBSET_RESTART_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']")
    if job["kind"] == "TrainJob":
        _check_runtime_patch(job)


def _check_runtime_patch(job: dict) -> None:
    """What the Trainer's webhook checks (pkg/runtime/framework/plugins/{torch,jobset}): the
    patched job and container exist in the runtime, no env in the node container's patch, no
    reserved PET_* env under trainer, the manager a domain-prefixed path."""
    runtime = _load("torch_distributed.yaml")
    assert runtime["metadata"]["name"] == job["spec"]["runtimeRef"]["name"]
    assert runtime["spec"]["mlPolicy"]["torch"] == {}
    have = {r["name"]: {c["name"] for c in r["template"]["spec"]["template"]["spec"]["containers"]}
            for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    (patch,) = job["spec"]["runtimePatches"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[\w./-]+", patch["manager"])
    for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
        for c in rjob["template"]["spec"]["template"]["spec"]["containers"]:
            assert c["name"] in have[rjob["name"]] and "env" not in c
    reserved = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                "PET_MASTER_PORT"}
    assert not reserved & {e["name"] for e in job["spec"]["trainer"]["env"]}


def _check_rendezvous(monkeypatch, capsys, job, docs, nodes, gpus, config) -> None:
    """The pod command, with the last pod's environment, is the torchrun agent of that node:
    c10d on the first pod's DNS name (one node: a static rendezvous there)."""
    last = nodes - 1
    for var, value in k8s_pods.pod_env(job, last, attempt=2).items():
        monkeypatch.setenv(var, value)
    argv = k8s_pods.pod_argv(job, {"/etc/mdtk": config.parent})
    if argv[4].startswith(str(config.parent)):
        argv[4] = str(config)  # the ConfigMap's file is the config itself
    status, out, err = _main(monkeypatch, capsys, *argv[3:], "--dry-run")
    assert status == 0, err
    source = "TrainJob" if job["kind"] == "TrainJob" else "JobSet"
    host = "tiny-run-node-0-0.tiny-run"
    assert (f"{source} pod: node {last} of {nodes}, restart attempt 2, rendezvous {host}:29500"
            in err)
    assert f"--nproc-per-node={gpus} --nnodes={nodes}" in out
    if nodes > 1:
        assert (f"--rdzv-backend=c10d --rdzv-endpoint={host}:29500 --rdzv-id=mdtk-2 "
                f"--node-rank={last} --rdzv-conf=is_host=false") in out
    else:
        assert f"--master-addr={host} --master-port=29500" in out


# -- the pods' environment -----------------------------------------------------------------------

def test_pod_env_mismatch_or_missing_is_one_error():
    from toolkit.launch.k8s import K8sError
    from toolkit.launch.pods import read_pod_env

    trainjob = {"PET_NODE_RANK": "1", "PET_NNODES": "4", "PET_NPROC_PER_NODE": "8",
                "PET_MASTER_ADDR": "j-node-0-0.j", "PET_MASTER_PORT": "29500"}
    pod = read_pod_env(trainjob, 4, 8)
    assert (pod.node_rank, pod.master_addr, pod.attempt, pod.source) == (
        1, "j-node-0-0.j", 0, "TrainJob")
    with pytest.raises(K8sError, match="PET_NNODES=4 but the pod command says 2: the TrainJob "
                                       "was changed after mdtk wrote it"):
        read_pod_env(trainjob, 2, 8)
    with pytest.raises(K8sError, match="neither PET_NODE_RANK .* nor JOB_COMPLETION_INDEX"):
        read_pod_env({}, 2, 8)
    with pytest.raises(K8sError, match="JOB_COMPLETION_INDEX=2 is not a node of --nodes 2"):
        read_pod_env({"JOB_COMPLETION_INDEX": "2", "MASTER_ADDR": "h"}, 2, 8)
    with pytest.raises(K8sError, match="MASTER_ADDR is not set"):
        read_pod_env({"JOB_COMPLETION_INDEX": "0"}, 2, 8)


# -- bad input: one error each, nothing written --------------------------------------------------

BAD = [  # options, the error's words
    (["parallel.tp=2", "--gpus-per-node", "3"],
     "error: 3 GPUs (1 node x 3) with tp=2: world size 3 is not divisible by tp*pp*cp"),
    (["--gpus-per-node", "8", "output_dir=/home/me/run"],
     "error: output_dir=/home/me/run is not on a persistent volume (mounted: ckpt at "
     "/mnt/ckpt): a pod's own disk is lost with the pod"),
    (["--gpus-per-node", "8", "--k8s-kind", "pytorchjob"],
     "error: --k8s-kind pytorchjob: choose one of trainjob, jobset"),
    (["--gpus-per-node", "8", "data.sources=[/home/me/corpus.jsonl]"],
     "error: data.sources=/home/me/corpus.jsonl is not visible from the pods (mounted: ckpt at "
     "/mnt/ckpt)"),
    (["--gpus-per-node", "8", "--max-restarts", "2"],
     "error: --max-restarts 2: a TrainJob restarts as its runtime (torch-distributed) says"),
    (["--gpus-per-node", "8", "--job-name", "Big_Run"],
     "error: --job-name Big_Run: Kubernetes names the pods Big_Run-node-0-0"),
]


@pytest.mark.parametrize("options,message", BAD)
def test_bad_input_is_one_error_and_nothing_is_written(
        config, tmp_path, monkeypatch, capsys, options, message):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "job.yaml"
    status, stdout, err = _main(monkeypatch, capsys, "launch", str(config), "--scheduler", "k8s",
                                "--image", "img", "--volume", "ckpt:/mnt/ckpt", "-o", str(out),
                                *options)
    assert status == EXIT_STATUS
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and stdout == ""
    assert list(tmp_path.iterdir()) == []  # no manifest, no temporary file


def test_written_manifest_is_the_dry_run(config, tmp_path, monkeypatch, capsys):
    args = ["launch", str(config), "--gpus-per-node", "8", "--scheduler", "k8s", "--image",
            "img", "--volume", "ckpt:/mnt/ckpt", "--k8s-kind", "jobset"]
    status, printed, _ = _main(monkeypatch, capsys, *args, "--dry-run")
    assert status == 0
    out = tmp_path / "job.yaml"
    status, stdout, _ = _main(monkeypatch, capsys, *args, "-o", str(out))
    assert status == 0 and out.read_text() == printed
    assert f"kubectl create -f {out}" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]
