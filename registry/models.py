"""Models, their versions and artifacts, deployments and the replicas that serve them."""

from __future__ import annotations

from django.conf import settings
from django.db import models

# The largest count a PositiveSmallIntegerField holds (replicas, standbys, GPUs): the API refuses more.
SMALL_COUNT_MAX = 32767


class Task(models.TextChoices):
    CHAT = "chat", "Chat"
    COMPLETION = "completion", "Completion"
    EMBEDDING = "embedding", "Embedding"
    CLASSIFICATION = "classification", "Classification"


class Model(models.Model):
    """A public model name that customers ask for, e.g. ``smollm2-135m-instruct``."""

    name = models.SlugField(max_length=255, unique=True)
    description = models.TextField(blank=True)
    owner = models.CharField(max_length=255, blank=True)
    task = models.CharField(max_length=20, choices=Task.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ModelVersion(models.Model):
    class Status(models.TextChoices):
        REGISTERED = "registered", "Registered"
        LOADING = "loading", "Loading"
        ACTIVE = "active", "Active"
        DEPRECATED = "deprecated", "Deprecated"

    # Moves allowed by registry.services.model_version_transition; anything else is refused.
    TRANSITIONS: dict[str, frozenset[str]] = {
        Status.REGISTERED: frozenset({Status.LOADING, Status.DEPRECATED}),
        Status.LOADING: frozenset({Status.ACTIVE, Status.REGISTERED}),
        Status.ACTIVE: frozenset({Status.DEPRECATED}),
        Status.DEPRECATED: frozenset({Status.LOADING}),
    }

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="versions")
    version = models.CharField(max_length=50)
    framework = models.CharField(max_length=50, help_text="e.g. transformers, pytorch")
    artifact_uri = models.CharField(max_length=1024)
    artifact_sha256 = models.CharField(max_length=64)
    artifact_size = models.BigIntegerField(help_text="bytes")
    config = models.JSONField(default=dict, blank=True, help_text="e.g. max_seq_len, vocab_size")
    gpu_type = models.CharField(max_length=50, blank=True)
    gpu_count = models.PositiveSmallIntegerField(default=0)
    gpu_vram_gb = models.PositiveIntegerField(default=0, help_text="GPU memory the version needs, GB (0: none)")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.REGISTERED)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model__name", "-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["model", "version"], name="uniq_model_version"),
            models.CheckConstraint(condition=models.Q(artifact_size__gte=0), name="artifact_size_nonneg"),
        ]

    def __str__(self) -> str:
        return f"{self.model.name}:{self.version}"


class Deployment(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        RUNNING = "running", "Running"
        DRAINING = "draining", "Draining"
        STOPPED = "stopped", "Stopped"

    TRANSITIONS: dict[str, frozenset[str]] = {
        Status.PENDING: frozenset({Status.RUNNING, Status.STOPPED}),
        Status.RUNNING: frozenset({Status.DRAINING}),
        Status.DRAINING: frozenset({Status.STOPPED, Status.RUNNING}),
        Status.STOPPED: frozenset({Status.PENDING}),
    }

    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="deployments")
    replicas = models.PositiveSmallIntegerField(default=1)
    min_replicas = models.PositiveSmallIntegerField(default=1)
    max_replicas = models.PositiveSmallIntegerField(default=10)
    traffic_weight = models.PositiveSmallIntegerField(default=100)
    is_canary = models.BooleanField(default=False)
    # Recorded as asked (the API's resources.gpu); supervisors do not place replicas by it yet.
    gpu_type = models.CharField(max_length=50, blank=True)
    autoscale = models.JSONField(default=dict, blank=True)
    # Warm standby replicas kept beside ``replicas``: loaded, ready, heart-beaten, never routed;
    # promoted first when the deployment needs one more serving replica (registry.warm_pool).
    standby = models.PositiveSmallIntegerField(default=0)
    # LoRA adapters one engine of this deployment runs in a batch (vLLM --enable-lora
    # --max-loras); 0: its engines take none. Adapters of its version are loaded into its
    # ready replicas at run time (serving.supervisor.adapters), never by a restart; a new value
    # (registry.services.deployment_adapters_set) restarts its engines one replica at a time.
    max_adapters = models.PositiveSmallIntegerField(default=0)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=models.Q(traffic_weight__lte=100), name="traffic_weight_0_100"),
            models.CheckConstraint(
                condition=models.Q(min_replicas__lte=models.F("max_replicas")), name="min_le_max_replicas"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.version} x{self.replicas} ({self.status})"


class Replica(models.Model):
    class State(models.TextChoices):
        STARTING = "starting", "Starting"
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        FAILED = "failed", "Failed"
        STOPPED = "stopped", "Stopped"

    TRANSITIONS: dict[str, frozenset[str]] = {
        State.STARTING: frozenset({State.READY, State.FAILED, State.STOPPED}),
        State.READY: frozenset({State.DRAINING, State.FAILED}),
        # draining → starting: a restart asked for (registry.services.replica_restart_request).
        State.DRAINING: frozenset({State.STOPPED, State.FAILED, State.STARTING}),
        State.FAILED: frozenset({State.STARTING, State.STOPPED}),
        State.STOPPED: frozenset({State.STARTING}),
    }

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_set")
    host = models.CharField(max_length=255)
    endpoint = models.URLField(max_length=512, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=20, choices=State.choices, default=State.STARTING)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # Set by ``registry.services.replica_restart_request``; its supervisor drains the engine,
    # stops it and starts it again. Cleared when the replica next moves to starting or stopped.
    restart_requested_at = models.DateTimeField(null=True, blank=True)
    # One of its deployment's warm pool: started, ready and heart-beaten like any other, but
    # never routed. Promotion (``registry.warm_pool.standby_promote``) clears it.
    standby = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["deployment_id", "id"]
        indexes = [models.Index(fields=["host", "state"])]

    def __str__(self) -> str:
        return f"{self.deployment.version} @ {self.host} ({self.state})"


class LoadedAdapter(models.Model):
    """A LoRA adapter version loaded into a replica's engine (of its base version, whose
    deployment takes adapters): requests for the adapter are routed to that replica under the
    adapter's ``lora_name``. Written by the replica's supervisor after the engine said yes;
    gone with the replica."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="loaded_adapters")
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="loaded_on")
    # The engine process it was loaded into: once the replica's engine is another (restarted,
    # empty), the row no longer routes anything, and the supervisor loads the adapter again.
    pid = models.PositiveIntegerField()
    loaded_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["replica", "version"], name="adapter_loaded_once")]

    def __str__(self) -> str:
        return f"{self.version} on replica {self.replica_id}"


class Upstream(models.Model):
    """Where a version of the external engine kind is served: an OpenAI-compatible server the
    platform does not run (a vLLM or SGLang server, a router or gateway in front of several).

    Its replicas have no process: the supervisor that claims one probes ``url`` and marks it
    ready (``serving.gateway.engine_kinds.EXTERNAL``); gateways send it this key instead of a
    replica key, and ``served_model`` as the request's ``model``. The key is kept encrypted
    (``registry.upstreams``): the table alone never gives it away.
    """

    version = models.OneToOneField(ModelVersion, on_delete=models.CASCADE, related_name="upstream")
    url = models.URLField(max_length=512, help_text="the server's base URL, without /v1")
    served_model = models.CharField(max_length=255, help_text="the name the upstream serves the model under")
    api_key_sealed = models.TextField(blank=True, help_text="the upstream's API key, encrypted (empty: none)")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.version} -> {self.url} ({self.served_model})"


class Adapter(models.Model):
    """A version whose artifact is a LoRA adapter (framework ``lora``, ``registry.adapters``),
    and the base version it applies to. An engine serving the base loads it beside the base
    under ``registry.adapters.lora_name``. A base that carries adapters cannot be deleted.
    """

    version = models.OneToOneField(ModelVersion, on_delete=models.CASCADE, related_name="adapter")
    base = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="adapters")
    rank = models.PositiveSmallIntegerField(help_text="the LoRA rank r")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["base_id", "version_id"]

    def __str__(self) -> str:
        return f"{self.version} (LoRA r={self.rank}) on {self.base}"


class HostLease(models.Model):
    """A host's engine supervisor holds this while it runs: one supervisor per host name.

    Taken, renewed and released only by ``registry.services.host_lease_*``, each a single
    guarded statement, so two supervisors can never both hold it. It expires by itself: a
    supervisor killed with SIGKILL stops renewing, and after ``expires_at`` (the database's
    clock) the next one takes it over.
    """

    host = models.CharField(max_length=255, unique=True)
    # "<pid>@<machine>/<random>": who holds it, and a part no other process can repeat.
    holder = models.CharField(max_length=255)
    taken_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.host} held by {self.holder} until {self.expires_at:%Y-%m-%d %H:%M:%S}"

    @property
    def holder_pid(self) -> str:
        return self.holder.split("@", 1)[0]

    @property
    def holder_machine(self) -> str:
        return self.holder.split("@", 1)[-1].rsplit("/", 1)[0]


class AuditEntry(models.Model):
    """One write made through the management API: who, what, and the thing before and after.

    Written by ``registry.services.audit_record`` in the write's own transaction, so a write
    that rolls back leaves no entry. Never edited.
    """

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept when the user is deleted; empty for the operator (management commands, bootstrap).
    actor_name = models.CharField(max_length=150, blank=True)
    action = models.CharField(max_length=64, help_text="e.g. model_version.register, traffic.set")
    target_type = models.CharField(max_length=64)
    target = models.CharField(max_length=255, help_text="the target's id or name")
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "audit entries"
        indexes = [
            # Supervisors look up open swaps by action on every pass; the log is searched by
            # action and by target; both stay index scans as the log grows.
            models.Index(fields=["action", "created_at"], name="audit_action_time"),
            models.Index(fields=["target_type", "target"], name="audit_target"),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.target_type}:{self.target} by {self.actor_name or 'operator'}"
