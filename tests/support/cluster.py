"""A platform on several hosts of one machine (``tests.support.netns``), for the multi-host
tests (tests/multihost/) and the scale-out benchmark (bench/scale_out.py).

- the **data host** is this machine's own namespace: the test database's PostgreSQL and a Redis
  of the cluster's own, on loopback, published at the bridge address (``Network.publish``);
  the metering worker runs there too;
- each **engine host** (``h1``, ``h2`` …) runs ``manage.py runworkers`` with its own host
  name and slots, its engines (the fake engine) listening on the host's address, and a
  gateway on ``<address>:8000``; both reach PostgreSQL and Redis only across the bridge;
- **haproxy** in front of the gateways, on loopback, where the clients are;
- with ``s3=True``, an S3-compatible server (moto's) on the data host: the hosts' artifact
  store is ``registry.s3_store.S3ArtifactStore``, each with a cache folder of its own, and
  ``register_artifact`` stores a version's files from this process (the host that registered
  it), so every engine host loads the weights from the store.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.db import connection

from tests.support.chaos import FAKE_LAUNCHER, GATEWAY_ENV, MeteringWorker, RedisServer, start_metering
from tests.support.gateway import committed
from tests.support.haproxy import CHECK_INTERVAL_MS, FALL, Balancer
from tests.support.netns import Host, Network
from tests.support.processes import Gateway, child_env, free_port, start_process, stop_process

GATEWAY_PORT = 8000


def create_model(
    django_db_blocker: Any, name: str, *, replicas: int, uri: str = "", sha256: str = "0" * 64, size: int = 1,
    framework: str = "fake", config: dict[str, Any] | None = None,
) -> int:  # fmt: skip
    """A chat model with one version and a deployment wanting ``replicas`` (committed): its id."""
    from registry.models import Model, ModelVersion
    from registry.services import deployment_create

    def create() -> int:
        model = Model.objects.create(name=name, task="chat")
        version = ModelVersion.objects.create(
            model=model, version="1", framework=framework, artifact_uri=uri or f"local://{name}/1",
            artifact_sha256=sha256, artifact_size=size, config=config or {"max_seq_len": 1024},
        )  # fmt: skip
        return int(deployment_create(version=version, replicas=replicas, max_replicas=max(3, replicas)).pk)

    return int(committed(django_db_blocker, create))


def drop_model(django_db_blocker: Any, name: str) -> None:
    from registry.models import Deployment, Model, ModelVersion

    def drop() -> None:
        Deployment.objects.filter(version__model__name=name).delete()
        ModelVersion.objects.filter(model__name=name).delete()
        Model.objects.filter(name=name).delete()

    committed(django_db_blocker, drop)


# Short clocks, so that faults play out in seconds (production: 3 s beats, 9 s stale, 15 s lease).
TIMINGS = {
    "WORKER_HEARTBEAT_SECONDS": "0.5",
    # Eight missed beats: a supervisor's pass delayed by a loaded machine must not leave a
    # moment with no routable replica.
    "REPLICA_STALE_AFTER": "4",
    "WORKER_HOST_LEASE_SECONDS": "3",
    "WORKER_DRAIN_TIMEOUT": "5",
    "WORKER_MAX_BACKOFF": "1",
    "GATEWAY_HEARTBEAT_SECONDS": "1",
    "GATEWAY_LOST_AFTER": "4",
    # The balancer takes a draining gateway out after FALL failed checks; then a margin.
    "GATEWAY_DRAIN_SECONDS": str(CHECK_INTERVAL_MS * FALL / 1000 + 1.5),
}


@dataclass
class EngineHost:
    host: Host
    name: str  # its WORKER_HOST
    log_dir: Path
    supervisor: subprocess.Popen[bytes] | None = None
    gateway: subprocess.Popen[bytes] | None = None

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host.address}:{GATEWAY_PORT}"


@dataclass
class Cluster:
    network: Network
    directory: Path
    models: list[str]
    slots: int = 1
    slots_of: dict[str, str] = field(default_factory=dict)  # a host's WORKER_SLOTS, when not range(slots)
    env: dict[str, str] = field(default_factory=dict)
    redis: RedisServer = field(init=False)
    balancer: Balancer = field(init=False)
    hosts: dict[str, EngineHost] = field(default_factory=dict)
    metering: MeteringWorker | None = None
    s3: bool = False
    s3_port: int = 0
    s3_bucket: str = ""
    s3_server: subprocess.Popen[bytes] | None = None

    def start(self, names: list[str], *, gateways: list[str] | None = None) -> Cluster:
        self.redis = RedisServer(self.directory / "redis").start()
        self.network.publish(self.redis.port)
        self.network.publish(int(connection.settings_dict["PORT"]))
        if self.s3:
            self._start_s3()
        tag = uuid.uuid4().hex[:4]
        for name in names:
            host = self.network.add_host(name)
            self.hosts[name] = EngineHost(host=host, name=f"mh-{name}-{tag}", log_dir=self.directory / name)
        self.metering = start_metering(self.directory, TEST_REDIS_URL=self.redis.url, **TIMINGS)
        for name in names:
            self.start_supervisor(name)
        for name in gateways if gateways is not None else names:
            self.start_gateway(name)
        servers = {name: f"{h.host.address}:{GATEWAY_PORT}" for name, h in self.hosts.items()
                   if gateways is None or name in gateways}  # fmt: skip
        self.balancer = Balancer(self.directory / "haproxy", "127.0.0.1", free_port(), servers).start()
        return self

    def stop(self) -> None:
        for engine_host in self.hosts.values():
            for process in (engine_host.gateway, engine_host.supervisor):
                if process is not None:
                    stop_process(process, grace=10)
        with contextlib.suppress(AttributeError):
            self.balancer.stop()
        if self.metering is not None:
            self.metering.stop()
        with contextlib.suppress(AttributeError):
            self.redis.stop()
        if self.s3_server is not None:
            stop_process(self.s3_server, grace=2)

    # --- the object store ----------------------------------------------------------------------

    def _start_s3(self) -> None:
        self.s3_port = free_port()
        self.s3_server = start_process(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.s3_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.network.publish(self.s3_port)
        self.s3_bucket = f"models-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + 30
        while True:
            try:
                self.store(self.directory / "registrar-cache").client.create_bucket(Bucket=self.s3_bucket)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def store(self, cache_root: Path) -> Any:
        """The cluster's S3 store as this process (the data host) reaches it."""
        from registry.s3_store import S3ArtifactStore

        return S3ArtifactStore(
            bucket=self.s3_bucket, cache_root=cache_root, endpoint_url=f"http://127.0.0.1:{self.s3_port}",
            region="us-east-1", access_key_id="testing", secret_access_key="testing",
        )  # fmt: skip

    def register_artifact(self, source: Path, key: str) -> Any:
        """Store a version's files in the object store from this process: the registering host."""
        return self.store(self.directory / "registrar-cache").put_directory(source=source, key=key)

    def cache_of(self, name: str) -> Path:
        """A host's artifact cache folder (ARTIFACT_CACHE_ROOT)."""
        return self.hosts[name].log_dir / "artifact-cache"

    # --- what runs on a host ---------------------------------------------------------------------

    def host_env(self, engine_host: EngineHost) -> dict[str, str]:
        db, data = connection.settings_dict, self.network.data_address
        addresses = ",".join(["127.0.0.1", "localhost", data,
                              *(h.host.address for h in self.hosts.values())])  # fmt: skip
        env = {
            "DATABASE_URL": f"postgresql://{db.get('USER') or 'postgres'}@{data}:{db['PORT']}/{db['NAME']}",
            "TEST_REDIS_URL": f"redis://{self.network.data_address}:{self.redis.port}/0",
            "ALLOWED_HOSTS": addresses,
            "WORKER_HOST": engine_host.name,
            "WORKER_ENGINE_HOST": engine_host.host.address,
            "WORKER_SLOTS": self.slots_of.get(engine_host.host.name) or ",".join(str(i) for i in range(self.slots)),
            "WORKER_LOG_DIR": str(engine_host.log_dir / "engines"),
            "WORKER_ENGINE_LAUNCHER": FAKE_LAUNCHER,
            # Production settings on every host (README, "Several hosts"): the balancer in front
            # says which requests came over HTTPS (haproxy.py sets X-Forwarded-Proto).
            "PLATFORM_ENV": "production",
            "SECRET_KEY": settings.SECRET_KEY,
            "TRUST_PROXY_HEADERS": "true",
            **(self._s3_env(engine_host) if self.s3 else {}),
            **GATEWAY_ENV,
            **TIMINGS,
        }
        return child_env(**{**env, **self.env})

    def _s3_env(self, engine_host: EngineHost) -> dict[str, str]:
        return {
            "ARTIFACT_STORE_BACKEND": "registry.s3_store.S3ArtifactStore",
            "ARTIFACT_S3_BUCKET": self.s3_bucket,
            "ARTIFACT_S3_ENDPOINT_URL": f"http://{self.network.data_address}:{self.s3_port}",
            "ARTIFACT_S3_REGION": "us-east-1",
            "ARTIFACT_S3_ACCESS_KEY_ID": "testing",
            "ARTIFACT_S3_SECRET_ACCESS_KEY": "testing",
            "ARTIFACT_CACHE_ROOT": str(self.cache_of(engine_host.host.name)),
        }

    def start_supervisor(self, name: str) -> None:
        engine_host = self.hosts[name]
        engine_host.log_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "manage.py", "runworkers", "--models", ",".join(self.models)]
        with open(engine_host.log_dir / "runworkers.log", "ab") as log:
            engine_host.supervisor = start_process(engine_host.host.command(command), env=self.host_env(engine_host),
                                                   stdout=log, stderr=subprocess.STDOUT, grace=60)  # fmt: skip

    def start_gateway(self, name: str, *, wait: bool = True) -> None:
        engine_host = self.hosts[name]
        engine_host.log_dir.mkdir(parents=True, exist_ok=True)
        # What server_command gives with GATEWAY_DRAIN_SECONDS set (this process's is 0).
        command = [sys.executable, "-m", "console.gateway", "--host", engine_host.host.address,
                   "--port", str(GATEWAY_PORT), "--one"]  # fmt: skip
        with open(engine_host.log_dir / "gateway.log", "ab") as log:
            engine_host.gateway = start_process(engine_host.host.command(command), env=self.host_env(engine_host),
                                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        if wait:
            self.wait_gateway(name)

    def wait_gateway(self, name: str, timeout: float = 60.0) -> None:
        engine_host = self.hosts[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert engine_host.gateway is not None
            if engine_host.gateway.poll() is not None:
                raise RuntimeError(f"the gateway of {name} exited:\n{self.log(name, 'gateway')}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{engine_host.gateway_url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the gateway of {name} did not answer in {timeout:.0f} s:\n{self.log(name, 'gateway')}")

    def log(self, name: str, what: str) -> str:
        path = self.hosts[name].log_dir / f"{'runworkers' if what == 'supervisor' else what}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def kill_host(self, name: str) -> int:
        """The host is gone: every process on it killed at once."""
        return self.hosts[name].host.kill_all()

    # --- what clients see ------------------------------------------------------------------------

    def door(self) -> Gateway:
        """The balancer, as the clients' one gateway."""
        assert self.balancer.process is not None
        return Gateway(port=self.balancer.port, process=self.balancer.process, log_path=self.directory / "haproxy")

    def wait_up(self, names: list[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.balancer.state()
            if all(state[name]["status"].startswith("UP") for name in names):
                return
            time.sleep(0.1)
        states = [(n, r["status"]) for n, r in self.balancer.state().items()]
        raise AssertionError(f"gateways not UP in haproxy: {states}")

    def host_of(self, endpoint: str) -> str:
        """The cluster host whose address an engine endpoint names."""
        for name, engine_host in self.hosts.items():
            if f"//{engine_host.host.address}:" in endpoint:
                return name
        raise AssertionError(f"{endpoint} is on no host of the cluster")

    def describe(self) -> dict[str, Any]:
        return {name: {"address": h.host.address, "worker_host": h.name} for name, h in self.hosts.items()}
