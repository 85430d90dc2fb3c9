"""The embedded PostgreSQL and Redis: they start from any clone location and say plainly why when they cannot."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from core import embedded

REPO = Path(__file__).resolve().parents[2]
SYSTEM_DIR = Path("/var/lib/inference-platform")
ENVIRONMENT = ("DATABASE_URL", "REDIS_URL", "PLATFORM_VAR_DIR", "EMBEDDED_PG_PORT", "EMBEDDED_REDIS_PORT")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**values: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ENVIRONMENT}
    return {**env, **values}


def embedded_command(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "core.embedded", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def kill_pid_in(path: Path) -> None:
    """Kill the server whose pid is the first line of `path` (one this test started)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        os.kill(int(path.read_text().splitlines()[0]), signal.SIGKILL)


@dataclass
class Clone:
    private: Path
    path: Path
    env: dict[str, str]
    pg_port: int

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return embedded_command(self.path, self.env, *args)

    def pg_data(self) -> Path | None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            recorded = json.loads((self.path / "var" / "embedded.json").read_text())["postgres_data"]
            return self.path / "var" / recorded
        return None


@pytest.fixture
def private_clone(tmp_path: Path) -> Iterator[Clone]:
    """A git clone of this repository inside a folder only its owner may enter (like /root)."""
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    clone_path = private / "platform"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone_path)], check=True, timeout=120)
    pg_port = free_port()
    clone = Clone(
        private=private,
        path=clone_path,
        env=clean_env(EMBEDDED_PG_PORT=str(pg_port), EMBEDDED_REDIS_PORT=str(free_port())),
        pg_port=pg_port,
    )
    try:
        yield clone
    finally:
        clone.run("stop")
        data = clone.pg_data()
        if data is not None:
            kill_pid_in(data / "postmaster.pid")
        kill_pid_in(clone_path / "var" / "redis" / "redis.pid")
        if data is not None and data.resolve().is_relative_to(SYSTEM_DIR):
            shutil.rmtree(data, ignore_errors=True)


def test_it_starts_from_a_private_clone(private_clone: Clone) -> None:
    assert stat.S_IMODE(private_clone.private.stat().st_mode) == 0o700

    started = private_clone.run("start")
    assert started.returncode == 0, started.stderr
    assert f"127.0.0.1:{private_clone.pg_port}/inference" in started.stdout

    status = private_clone.run("status")
    assert status.returncode == 0, status.stderr
    assert "postgres: running" in status.stdout
    assert "redis:    running" in status.stdout

    again = private_clone.run("start")
    assert again.returncode == 0, again.stderr
    assert "initialising" not in again.stderr

    url = f"postgresql://postgres@127.0.0.1:{private_clone.pg_port}/inference"
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'vector'").fetchone()
        assert row is not None
        conn.execute("CREATE DATABASE scratch")
    with psycopg.connect(url.replace("/inference", "/scratch"), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION vector")
        distance = conn.execute("SELECT '[1,2,3]'::vector <-> '[1,2,4]'::vector").fetchone()
        assert distance == (1.0,)

    data = private_clone.pg_data()
    assert data is not None
    if os.geteuid() == 0:
        # PostgreSQL runs as its own user, from data of its own outside the private folder.
        assert data.resolve().is_relative_to(SYSTEM_DIR)
        assert pwd.getpwuid(data.stat().st_uid).pw_name == embedded.PG_SYSTEM_USER
    else:
        assert data == private_clone.path / "var" / "postgres"

    stopped = private_clone.run("stop")
    assert stopped.returncode == 0, stopped.stderr
    status = private_clone.run("status")
    assert "postgres: stopped" in status.stdout
    assert "redis:    stopped" in status.stdout
    # Nothing was opened up to make it work.
    assert stat.S_IMODE(private_clone.private.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("service", "port_variable", "other_url"),
    [
        ("postgres", "EMBEDDED_PG_PORT", {"REDIS_URL": "redis://127.0.0.1:1/0"}),
        ("redis", "EMBEDDED_REDIS_PORT", {"DATABASE_URL": "postgresql://postgres@127.0.0.1:1/inference"}),
    ],
)
def test_it_names_a_taken_port_and_the_fix(
    tmp_path: Path, service: str, port_variable: str, other_url: dict[str, str]
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        env = clean_env(
            PLATFORM_VAR_DIR=str(tmp_path / "var"),
            EMBEDDED_PG_PORT=str(free_port()),
            EMBEDDED_REDIS_PORT=str(free_port()),
            **other_url,
        )
        env[port_variable] = str(port)
        result = embedded_command(REPO, env, "start")

    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Traceback" not in output
    message = result.stderr.strip()
    assert message.startswith("error: ")
    assert "\n" not in message
    assert f"port {port} is taken" in message
    assert port_variable in message
    # Nothing was initialised for a server that could not start.
    assert not (tmp_path / "var" / "embedded.json").exists()


def test_it_explains_a_full_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/srv/full/postgres")

    monkeypatch.setattr(embedded, "VAR_DIR", tmp_path)
    monkeypatch.setattr(embedded, "postgres_start", full_disk)
    with pytest.raises(embedded.EmbeddedServiceError) as raised:
        embedded.start(postgres=True, redis=False)
    assert str(raised.value) == (
        "no space is left on the disk holding /srv/full/postgres: free some space (see `df -h`) and start again"
    )
