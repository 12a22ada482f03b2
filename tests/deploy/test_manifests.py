"""Every kustomization renders; every object validates against the Kubernetes schemas of the
oldest and newest supported versions (core) or kv-sidecar's CRD schemas (operator); the pod
is wired as the Kubernetes guide (docs/guides/kubernetes.md) says; and a misspelt field
fails validation."""

from __future__ import annotations

import base64
import copy
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from sidecar.adapters.vllm import cli as vllm_cli
from tests.deploy.tools import (
    KUBE,
    KUSTOMIZATIONS,
    OLDEST_SUPPORTED,
    check_jsonschema,
    core_objects,
    kubernetes_validate,
    kustomize,
    pod_spec,
)

pytestmark = pytest.mark.deploy


def _versions() -> tuple[str, str]:
    return OLDEST_SUPPORTED, str(kubernetes_validate().latest_version())


def _core_errors(objects: list[dict[str, Any]]) -> list[str]:
    kv = kubernetes_validate()
    errors = []
    for version in _versions():
        for obj in core_objects(objects):
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                errors.append(f"{version} {obj['kind']}/{obj['metadata']['name']}: "
                              f"{str(exc).splitlines()[0]}")
    return errors


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_kustomization_renders_and_validates(path: str, tmp_path: Path) -> None:
    objects = kustomize(path)
    assert objects
    assert _core_errors(objects) == []
    assert check_jsonschema(objects, tmp_path) == {}


def test_the_oldest_schemas_without_native_sidecars_reject_the_pod() -> None:
    """Why 1.29 is the floor: before 1.28 a container had no restartPolicy."""
    kv = kubernetes_validate()
    deployment = next(o for o in kustomize("base") if o["kind"] == "Deployment")
    with pytest.raises(kv.ValidationError, match="restartPolicy"):
        kv.validate(deployment, "1.27", strict=True)


def test_a_misspelt_restart_policy_fails_validation(tmp_path: Path) -> None:
    """Mutation: one misspelt key in the source manifest; kustomize still renders it (it
    does not validate), the schema check names it."""
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    manifest = tmp_path / "kubernetes" / "base" / "deployment.yaml"
    text = manifest.read_text()
    manifest.write_text(text.replace("restartPolicy: Always", "restartPolcy: Always"))
    errors = _core_errors(kustomize("base", root=tmp_path / "kubernetes"))
    assert errors and all("'restartPolcy' was unexpected" in e for e in errors), errors
    assert len(errors) == 2  # the oldest and the newest schemas both refuse it


@pytest.mark.parametrize(("kind", "mutate", "expect"), [
    ("PodMonitor", lambda s: s["podMetricsEndpoints"][0].update(portt="metrics"), "portt"),
    ("PrometheusRule", lambda s: s["groups"][1]["rules"][0].update({"for": "15 minutes"}),
     "15 minutes"),
    ("AlertmanagerConfig", lambda s: s["route"]["routes"][0]["matchers"][0].update(
        matchType="=="), "=="),
])
def test_a_wrong_operator_field_fails_its_schema(kind: str, mutate: Any, expect: str,
                                                 tmp_path: Path) -> None:
    obj = copy.deepcopy(next(o for o in kustomize("monitoring") if o["kind"] == kind))
    mutate(obj["spec"])
    failures = check_jsonschema([obj], tmp_path)
    assert list(failures) == [f"{kind}/kv-sidecar"]
    assert expect in failures[f"{kind}/kv-sidecar"]


def _container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name}")


def _flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def test_vllm_pod_wiring_matches_engine_args_and_the_sidecar() -> None:
    spec = pod_spec(kustomize("base"))
    sidecar, engine = _container(spec, "kv-sidecar"), _container(spec, "engine")
    assert sidecar["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["initContainers"]] == ["install-probe", "kv-sidecar"]
    assert sidecar["command"] == ["kv-sidecar", "vllm", "serve"]
    served = vllm_cli.parser().parse_args(["serve", *sidecar["args"]])  # the real flags
    assert served.reference == "engine" and served.host == "0.0.0.0"
    s, e = _flags(sidecar["args"]), _flags(engine["args"])
    for key in ("model", "served-model-name", "dtype", "block-size"):
        assert s[key] == e[key], key
    # The engine's probe/event flags are exactly what `kv-sidecar vllm engine-args` prints.
    ns = vllm_cli.parser().parse_args(["engine-args", "--probe", s["probe"], "--events",
                                       s["events"], "--replay", s["replay"],
                                       "--sample-every", "100"])
    printed = _capture(lambda: vllm_cli._engine_args(ns))
    assert engine["args"][-4:] == shlex.split(printed)
    # Every full block is fingerprinted as the engine writes it (the probe's default).
    probe_extra = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    assert probe_extra["kv_connector_extra_config"]["fingerprint_every"] == 1
    # The sockets live on one volume both containers mount; the probe on PYTHONPATH.
    mounts = {c: {m["name"]: m["mountPath"] for m in _container(spec, c)["volumeMounts"]}
              for c in ("kv-sidecar", "engine", "install-probe")}
    assert mounts["kv-sidecar"]["ipc"] == mounts["engine"]["ipc"] == "/run/kv-sidecar"
    assert s["probe"].startswith("ipc:///run/kv-sidecar/")
    target = _container(spec, "install-probe")["command"][-1]
    assert mounts["install-probe"]["probe-python"] == target == \
        mounts["engine"]["probe-python"]
    assert {"name": "PYTHONPATH", "value": target} in engine["env"]
    assert {"name": "metrics", "containerPort": int(s["port"])} in sidecar["ports"]
    assert s["host"] == "0.0.0.0"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Probes: the sidecar's on /healthz (startup gates the engine), no readiness of its own.
    for probe in ("startupProbe", "livenessProbe"):
        assert sidecar[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert "readinessProbe" not in sidecar
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"


def _capture(fn: Any) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn()
    return out.getvalue().strip()


@pytest.mark.parametrize("path", ["base", "overlays/sglang", "overlays/guard"])
def test_every_container_is_restricted(path: str) -> None:
    for obj in kustomize(path):
        if obj["kind"] != "Deployment":
            continue
        spec = obj["spec"]["template"]["spec"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c["securityContext"]
            where = f"{path} {obj['metadata']['name']}/{c['name']}"
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "requests" in c["resources"], where


def test_sglang_overlay_runs_the_canary_on_the_metrics_port() -> None:
    objects = kustomize("overlays/sglang")
    spec = pod_spec(objects)
    assert not spec.get("initContainers")
    engine, canary = _container(spec, "engine"), _container(spec, "kv-sidecar-canary")
    assert engine["command"][-1] == "sglang.launch_server"
    assert "--enable-metrics" in engine["args"]
    port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "http")
    flags = _flags(canary["command"])
    assert flags["endpoint"] == f"http://127.0.0.1:{port}/v1"
    assert {"name": "metrics", "containerPort": int(flags["port"])} in canary["ports"]
    assert {v["name"] for v in spec["volumes"]}.isdisjoint({"ipc", "probe-python"})
    # The canary's command parses: the flags are the real CLI's.
    from sidecar.cli.main import build_parser

    ns = build_parser().parse_args(["canary", *canary["command"][3:]])
    assert ns.host == "0.0.0.0" and ns.port == int(flags["port"])


def test_guard_overlay_puts_a_service_in_front_of_the_engine() -> None:
    objects = kustomize("overlays/guard")
    spec = pod_spec(objects, "guard")
    guard = _container(spec, "guard")
    assert guard["command"] == ["kv-sidecar", "guard"]
    flags = _flags(guard["args"])
    assert flags["upstream"] == "http://engine:8000"
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert services["guard"]["spec"]["selector"]["app.kubernetes.io/component"] == "guard"
    assert services["guard"]["spec"]["ports"][0]["targetPort"] == "http"
    assert flags["listen"].endswith(":8080")


def test_probe_install_copies_an_importable_probe(tmp_path: Path) -> None:
    """What the install-probe init container runs: afterwards a Python with the copy on
    PYTHONPATH (as vLLM's container has it) imports the probe's modules and msgpack from
    the copy, not from wherever kv-sidecar happens to be installed."""
    spec = pod_spec(kustomize("base"))
    command = _container(spec, "install-probe")["command"]
    assert command[:3] == ["python", "-m", "sidecar.adapters.vllm.probe_install"]
    dest = tmp_path / "python"
    assert subprocess.run([sys.executable, *command[1:-1], str(dest)],
                          timeout=120).returncode == 0
    # The probe's wire codec: msgpack beyond what vLLM brings (torch).
    code = ("import msgpack, sidecar.adapters.vllm.wire as w; print(w.__file__); "
            "print(msgpack.__file__); print(msgpack.unpackb(msgpack.packb([1, 'a'])))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": str(dest)}, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(str(dest)) and lines[1].startswith(str(dest)), lines
    assert lines[2] == "[1, 'a']"
    # A second run replaces the copy whole (no stale modules of an older version remain).
    (dest / "sidecar" / "stale_module.py").write_text("")
    assert subprocess.run([sys.executable, *command[1:-1], str(dest)],
                          timeout=120).returncode == 0
    assert not (dest / "sidecar" / "stale_module.py").exists()


def test_guard_command_line_parses_with_the_real_cli(tmp_path: Path) -> None:
    """The guard overlay's flags against ``kv-sidecar guard`` itself, once the CLI has it
    (issue 25 adds the command; until then this says so and skips); then the guard's own
    start-up checks (upstream, token) pass on them, with the token file the pod mounts
    from the rendered Secret."""
    import argparse

    from sidecar.cli.main import build_parser

    parser = build_parser()
    commands = {name for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                for name in a.choices}
    if "guard" not in commands:
        pytest.skip("`kv-sidecar guard` is not in this tree yet: the overlay's flags are the "
                    "brief's `--upstream URL --listen HOST:PORT`")
    objects = kustomize("overlays/guard")
    spec = pod_spec(objects, "guard")
    guard = _container(spec, "guard")
    args = parser.parse_args([*guard["command"][1:], *guard["args"]])
    from sidecar.protect.cli import preflight

    # The token file: the mounted Secret's key, written where the test can read it.
    mount = next(m for m in guard["volumeMounts"] if m["name"] == "guard-secret")
    volume = next(v for v in spec["volumes"] if v["name"] == "guard-secret")
    secret = next(o for o in objects if o["kind"] == "Secret"
                  and o["metadata"]["name"] == volume["secret"]["secretName"])
    assert args.token_file.startswith(mount["mountPath"] + "/")
    key = args.token_file[len(mount["mountPath"]) + 1:]
    token = base64.b64decode(secret["data"][key]).decode()
    (tmp_path / key).write_text(token)
    args.token_file = str(tmp_path / key)
    endpoint, loaded = preflight(args)
    assert loaded == token and endpoint.host == "engine"
    # Without --allow-remote or without the token the guard would refuse to start.
    with pytest.raises(Exception, match=r"allow-remote|loopback|remote"):
        preflight(argparse.Namespace(**{**vars(args), "allow_remote": False}))
    with pytest.raises(Exception, match="token"):
        preflight(argparse.Namespace(**{**vars(args), "token_file": None}))


def test_guard_secret_is_a_placeholder_the_readme_says_to_replace() -> None:
    text = (KUBE / "overlays" / "guard" / "guard-secret.env").read_text()
    assert "REPLACE-ME" in text
    readme = (KUBE.parent.parent / "docs" / "guides" / "kubernetes.md").read_text()
    assert "guard-secret.env" in readme


def _images(objects: list[dict[str, Any]]) -> dict[str, str]:
    out = {}
    for obj in objects:
        if obj["kind"] != "Deployment":
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            out[f"{obj['metadata']['name']}/{c['name']}"] = c["image"]
    return out


def _tag(image: str) -> str:
    """The tag of ``image`` ('' for none); a digest counts as pinned."""
    if "@" in image:
        return "@digest"
    name = image.rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else ""


@pytest.mark.parametrize("path", ["base", "overlays/sglang", "overlays/guard"])
def test_every_rendered_image_has_an_explicit_tag(path: str) -> None:
    """Base's images: transformer does not reach objects an overlay adds: an untagged image
    is :latest with imagePullPolicy Always, a different build on every restart."""
    images = _images(kustomize(path))
    assert images
    untagged = {where: i for where, i in images.items() if _tag(i) in ("", "latest")}
    assert untagged == {}


def test_the_tag_check_catches_an_untagged_image() -> None:
    assert _tag("kv-sidecar") == "" and _tag("reg:5000/kv-sidecar") == ""
    assert _tag("kv-sidecar:latest") == "latest" and _tag("reg:5000/a/b:0.1.0") == "0.1.0"


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_guard_overlay_wiring_one_breaker_follows_the_engine_and_is_paged() -> None:
    """One replica (a breaker is per process); the guard follows the engine pod's sidecar
    /status through a Service that selects that pod's metrics port; its /metrics is on a
    port the PodMonitor scrapes; page alerts reach its webhook with its own token."""
    from sidecar.cli.main import build_parser

    objects = kustomize("overlays/guard")
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert deployments["guard"]["spec"]["replicas"] == 1
    guard = _container(pod_spec(objects, "guard"), "guard")
    args = build_parser().parse_args([*guard["command"][1:], *guard["args"]])
    engine_spec = pod_spec(objects)
    engine_labels = deployments["engine"]["spec"]["template"]["metadata"]["labels"]
    sidecar = _container(engine_spec, "kv-sidecar")
    assert args.model == _flags(_container(engine_spec, "engine")["args"])["served-model-name"]
    # --sidecar-status: a Service in front of the engine pod's sidecar metrics port.
    url = urlsplit(args.sidecar_status)
    assert url.path == "/status"
    svc = services[url.hostname]["spec"]
    assert _selects(svc["selector"], engine_labels)
    port = next(p for p in svc["ports"] if p["port"] == url.port)
    assert port["targetPort"] == "metrics"
    assert {"name": "metrics", "containerPort": int(_flags(sidecar["args"])["port"])} in \
        sidecar["ports"]
    # The guard's /metrics: on the pod's address, a port named metrics the PodMonitor scrapes.
    assert args.metrics_host == "0.0.0.0"
    assert {"name": "metrics", "containerPort": args.metrics_port} in guard["ports"]
    monitor = next(o for o in kustomize("monitoring") if o["kind"] == "PodMonitor")
    guard_labels = deployments["guard"]["spec"]["template"]["metadata"]["labels"]
    assert _selects(monitor["spec"]["selector"]["matchLabels"], guard_labels)
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # Pages to the guard's webhook, authorised with the token the guard reads.
    amc = next(o for o in objects if o["kind"] == "AlertmanagerConfig")
    assert {"name": "severity", "matchType": "=", "value": "page"} in \
        amc["spec"]["route"]["matchers"]
    receiver = next(r for r in amc["spec"]["receivers"]
                    if r["name"] == amc["spec"]["route"]["receiver"])
    hook = receiver["webhookConfigs"][0]
    secret = next(o for o in objects if o["kind"] == "Secret"
                  and o["metadata"]["name"] == hook["urlSecret"]["name"])
    target = urlsplit(base64.b64decode(secret["data"][hook["urlSecret"]["key"]]).decode())
    assert target.path == "/guard/alertmanager"
    assert target.hostname is not None and target.hostname.split(".")[0] == "guard"
    assert target.port == services["guard"]["spec"]["ports"][0]["port"]
    credentials = hook["httpConfig"]["authorization"]["credentials"]
    assert credentials["name"] == secret["metadata"]["name"]
    assert args.token_file.endswith("/" + credentials["key"])


def test_a_misspelt_webhook_credentials_field_fails_its_schema(tmp_path: Path) -> None:
    obj = copy.deepcopy(next(o for o in kustomize("overlays/guard")
                             if o["kind"] == "AlertmanagerConfig"))
    auth = obj["spec"]["receivers"][0]["webhookConfigs"][0]["httpConfig"]["authorization"]
    auth["credential"] = auth.pop("credentials")
    failures = check_jsonschema([obj], tmp_path)
    assert list(failures) == ["AlertmanagerConfig/kv-sidecar-guard"]
