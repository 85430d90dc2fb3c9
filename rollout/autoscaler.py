"""The autoscaler's policy and decisions: how many replicas a deployment should want.

``decide`` is pure: a deployment's bounds and policy, what its replicas are doing now
(``Observations``), the time and the time of its last change in, a ``Decision`` (target
and reasons) out. ``autoscale_deployments`` applies it to every running deployment whose
policy is enabled, with the observations gathered by the caller (``rollout.observations``
scrapes the engines: the registry never talks HTTP to them), and writes each change with
``registry.services.deployment_scale``; that audit entry ("autoscale", with the reasons
and the figures) is the stored decision. Supervisors follow ``Deployment.replicas``.

Policy (``Deployment.autoscale``; every key optional but ``enabled``):

    enabled                       false   on/off
    target_queue_per_replica      4       waiting requests (vllm:num_requests_waiting) per ready replica
    target_in_flight_per_replica  16      running + waiting requests per ready replica
    target_p99_ms                 null    p99 whole-request latency over AUTOSCALER_WINDOW_SECONDS
    target_p99_ttft_ms            null    p99 time to first token over the same window
    cooldown_seconds              60      after any change, no scale-out for this long
    scale_in_quiet_seconds        300     scale in only after this long without a change and
                                          with the load of the whole period fitting in one
                                          replica fewer at scale_in_utilisation of the target
    scale_in_utilisation          0.5     (0, 1]
    max_step                      null    most replicas added at once (default: double)
    predictive                    false   also scale ahead of the demand the deployment's weekly
                                          profile expects (rollout.predictive)
    predictive_lead_seconds       null    how far ahead (null: the model's measured load time
                                          plus one tick)

Bounds are the deployment's ``min_replicas`` (never below 1) and ``max_replicas``.

Predictive scaling never lowers what the reactive rule wants: with a ``Forecast`` (how much
more the profile expects at its busiest between now and the lead time), the target is the
larger of the reactive one and the replicas the load now plus that rise needs at
``target_in_flight_per_replica``; a scale-in the forecast would undo is held.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from core.errors import InvalidInput
from core.formats import counted
from registry.adapters import is_adapter_framework
from registry.models import AuditEntry, Deployment
from registry.services import AUTOSCALER, Actor, audit_record, deployment_scale

logger = logging.getLogger(__name__)

SCALE_ACTIONS = ("autoscale", "deployment.scale")
# A day: the profile's hours are an hour long, and a lead longer than a day scales for tomorrow.
PREDICTIVE_LEAD_MAX = 86400.0


@dataclass(frozen=True)
class AutoscalePolicy:
    enabled: bool = False
    target_queue_per_replica: float = 4.0
    target_in_flight_per_replica: float = 16.0
    target_p99_ms: float | None = None
    target_p99_ttft_ms: float | None = None
    cooldown_seconds: float = 60.0
    scale_in_quiet_seconds: float = 300.0
    scale_in_utilisation: float = 0.5
    max_step: int | None = None
    predictive: bool = False
    predictive_lead_seconds: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AutoscalePolicy:
        """The policy ``data`` describes; InvalidInput naming the first key that is wrong."""
        if not isinstance(data, Mapping):
            raise InvalidInput("autoscale", "Must be an object.")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise InvalidInput(f"autoscale.{key}", f"Unknown key; known: {', '.join(sorted(known))}.")
        values: dict[str, Any] = {}
        for key in ("enabled", "predictive"):
            if key in data:
                if not isinstance(data[key], bool):
                    raise InvalidInput(f"autoscale.{key}", "Must be true or false.")
                values[key] = data[key]
        for key in ("target_queue_per_replica", "target_in_flight_per_replica", "target_p99_ms", "target_p99_ttft_ms"):
            if key in data:
                values[key] = _number(key, data[key], nullable=key.startswith("target_p99"), positive=True)
        for key in ("cooldown_seconds", "scale_in_quiet_seconds"):
            if key in data:
                values[key] = _number(key, data[key], positive=False)
        if "predictive_lead_seconds" in data:
            lead = _number("predictive_lead_seconds", data["predictive_lead_seconds"], positive=False, nullable=True)
            if lead is not None and lead > PREDICTIVE_LEAD_MAX:
                raise InvalidInput("autoscale.predictive_lead_seconds", f"Must be at most {PREDICTIVE_LEAD_MAX:g}.")
            values["predictive_lead_seconds"] = lead
        if "scale_in_utilisation" in data:
            value = _number("scale_in_utilisation", data["scale_in_utilisation"], positive=True)
            if value is not None and value > 1:
                raise InvalidInput("autoscale.scale_in_utilisation", "Must be at most 1.")
            values["scale_in_utilisation"] = value
        if "max_step" in data and data["max_step"] is not None:
            step = data["max_step"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise InvalidInput("autoscale.max_step", "Must be a whole number of at least 1.")
            values["max_step"] = step
        return cls(**values)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _number(key: str, value: object, *, positive: bool, nullable: bool = False) -> float | None:
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"autoscale.{key}", "Must be a number.")
    if value < 0 or (positive and value == 0):
        raise InvalidInput(f"autoscale.{key}", "Must be greater than 0." if positive else "Must not be negative.")
    return float(value)


@dataclass(frozen=True)
class DeploymentConfig:
    replicas: int
    min_replicas: int
    max_replicas: int
    policy: AutoscalePolicy

    @classmethod
    def of(cls, deployment: Deployment, policy: AutoscalePolicy) -> DeploymentConfig:
        return cls(deployment.replicas, deployment.min_replicas, deployment.max_replicas, policy)


@dataclass(frozen=True)
class Observations:
    """What a deployment's replicas are doing now, and did lately."""

    ready: int  # replicas routable now
    scraped: int  # of which /metrics answered
    waiting: float = 0.0  # vllm:num_requests_waiting, summed over the scraped replicas
    running: float = 0.0  # vllm:num_requests_running, summed
    p99_ms: float | None = None  # whole-request latency over the window; None: too few samples
    p99_ttft_ms: float | None = None
    samples: int = 0  # requests in the latency window
    # The busiest stretch of the quiet period: average requests in flight (usage records).
    peak_in_flight: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Forecast:
    """What a deployment's demand profile expects (``rollout.predictive``): requests in flight
    on average now and at the busiest moment between now and the lead time."""

    now_in_flight: float
    in_flight: float
    at: datetime  # when the busiest moment ahead is
    lead_seconds: float  # how far ahead it looked
    basis: str  # what the figures come from, for people

    @property
    def rise(self) -> float:
        """How much more the profile expects at its busiest ahead than now (never below 0)."""
        return max(0.0, self.in_flight - self.now_in_flight)

    def as_json(self) -> dict[str, Any]:
        return {
            "now_in_flight": round(self.now_in_flight, 3),
            "in_flight": round(self.in_flight, 3),
            "at": self.at.isoformat(),
            "lead_seconds": round(self.lead_seconds, 1),
            "basis": self.basis,
        }


@dataclass(frozen=True)
class Decision:
    target_replicas: int
    reasons: tuple[str, ...]


def decide(
    config: DeploymentConfig,
    observations: Observations,
    now: datetime,
    last_change_at: datetime | None,
    forecast: Forecast | None = None,
) -> Decision:
    """How many replicas the deployment should want, and why: the reactive rule
    (``decide_reactive``), raised to what ``forecast`` needs when the policy is predictive.

    The forecast adds the rise its profile expects by the lead time to the load now (the
    larger of in flight now and the quiet period's busiest stretch) and needs
    ceil(that ÷ ``target_in_flight_per_replica``) within the bounds: the load now carries
    today's level and its bursts, the profile only says how much more is coming. A flat or
    falling profile needs no more than the reactive rule. Above the reactive target the
    forecast wins: a scale-out to it at once (a count, not a step, so no cooldown or
    max_step: the next pass asks for the same count), or a scale-in held.
    """
    reactive = decide_reactive(config, observations, now, last_change_at)
    policy = config.policy
    if forecast is None or not policy.predictive or forecast.rise <= 0:
        return reactive
    floor = max(1, config.min_replicas)
    ceiling = max(floor, config.max_replicas)
    load = max(observations.running + observations.waiting, observations.peak_in_flight)
    expected = load + forecast.rise
    needed = min(ceiling, max(floor, math.ceil(expected / policy.target_in_flight_per_replica)))
    if needed <= reactive.target_replicas:
        return reactive
    reason = (
        f"forecast: {forecast.in_flight:.3g} in flight at {forecast.at:%a %H:%M} UTC, "
        f"{forecast.rise:.3g} more than now ({forecast.basis}; {forecast.lead_seconds:.0f} s ahead); "
        f"{load:.3g} in flight now + {forecast.rise:.3g} needs {needed}"
    )
    if needed > config.replicas:
        return Decision(needed, (reason,))
    return Decision(config.replicas, (f"held: {reason}",))


def decide_reactive(
    config: DeploymentConfig, observations: Observations, now: datetime, last_change_at: datetime | None
) -> Decision:
    """How many replicas the deployment should want now, and why, from its load alone.

    Out: on queue depth, in-flight per replica or p99 above target, to the count that would
    bring the worst of them to its target (HPA's ceil(current * observed / target); +1 for
    p99), at most ``max_step`` (default: double) at once; held while a replica is still
    starting (the last change has not landed) and during the cooldown. In: one replica at a
    time, only after ``scale_in_quiet_seconds`` without a change, with every replica scraped,
    nothing queued and the period's busiest stretch fitting in one replica fewer at
    ``scale_in_utilisation`` of the in-flight target. Always within [max(1, min), max].
    """
    policy = config.policy
    current = config.replicas
    floor = max(1, config.min_replicas)
    ceiling = max(floor, config.max_replicas)
    if current < floor:
        return Decision(floor, (f"{counted(current, 'replica')} is below min_replicas ({floor})",))
    if current > ceiling:
        return Decision(ceiling, (f"{counted(current, 'replica')} is above max_replicas ({ceiling})",))
    since_change = math.inf if last_change_at is None else (now - last_change_at).total_seconds()
    obs = observations

    wanted: list[tuple[int, str]] = []
    if obs.scraped:
        queue = obs.waiting / obs.scraped
        if queue > policy.target_queue_per_replica:
            wanted.append(
                (
                    math.ceil(obs.waiting / policy.target_queue_per_replica),
                    f"queue {queue:g} per replica > target {policy.target_queue_per_replica:g}",
                )
            )
        in_flight = (obs.waiting + obs.running) / obs.scraped
        if in_flight > policy.target_in_flight_per_replica:
            wanted.append(
                (
                    math.ceil((obs.waiting + obs.running) / policy.target_in_flight_per_replica),
                    f"in flight {in_flight:g} per replica > target {policy.target_in_flight_per_replica:g}",
                )
            )
    for label, value, target in (
        ("p99", obs.p99_ms, policy.target_p99_ms),
        ("p99 TTFT", obs.p99_ttft_ms, policy.target_p99_ttft_ms),
    ):
        if value is not None and target is not None and value > target:
            wanted.append((current + 1, f"{label} {value:.0f} ms > target {target:.0f} ms ({obs.samples} requests)"))

    if wanted:
        reasons = tuple(reason for _, reason in wanted)
        step = policy.max_step if policy.max_step is not None else current
        target = min(ceiling, current + step, max(current + 1, *(n for n, _ in wanted)))
        if target <= current:
            return Decision(current, (*reasons, f"at max_replicas ({ceiling})"))
        if obs.ready < current:
            return Decision(current, (*reasons, f"held: {counted(current - obs.ready, 'replica')} not ready yet"))
        if since_change < policy.cooldown_seconds:
            left = policy.cooldown_seconds - since_change
            return Decision(current, (*reasons, f"held: cooldown, {left:.0f} s left"))
        return Decision(target, reasons)

    if current <= floor:
        return Decision(current, ("load within targets",))
    if since_change < policy.scale_in_quiet_seconds:
        left = policy.scale_in_quiet_seconds - since_change
        return Decision(current, (f"load within targets; quiet period, {left:.0f} s left before scaling in",))
    if obs.scraped < current:
        return Decision(current, (f"load within targets; only {obs.scraped} of {current} replicas answered",))
    if obs.waiting > 0:
        return Decision(current, ("load within targets; requests are queued",))
    busiest = max(obs.peak_in_flight, obs.running)
    room = policy.target_in_flight_per_replica * policy.scale_in_utilisation * (current - 1)
    if busiest > room:
        return Decision(current, (f"load within targets; {busiest:g} in flight at the busiest needs {current}",))
    for label, value, target in (
        ("p99", obs.p99_ms, policy.target_p99_ms),
        ("p99 TTFT", obs.p99_ttft_ms, policy.target_p99_ttft_ms),
    ):
        if value is not None and target is not None and value > target * policy.scale_in_utilisation:
            return Decision(current, (f"load within targets; {label} {value:.0f} ms too close to target",))
    return Decision(
        current - 1,
        (
            f"quiet for {policy.scale_in_quiet_seconds:.0f} s: at most {busiest:g} in flight, "
            f"fits {counted(current - 1, 'replica')} at {policy.scale_in_utilisation:.0%} of the target",
        ),
    )


def last_change_at(deployment: Deployment) -> datetime:
    """When the deployment's replica count last changed (by the autoscaler or by hand), else
    when it was created: a new deployment is not scaled in before a quiet period."""
    latest = AuditEntry.objects.filter(
        action__in=SCALE_ACTIONS, target_type="deployment", target=str(deployment.pk)
    ).aggregate(at=Max("created_at"))["at"]
    return latest if latest is not None and latest > deployment.created_at else deployment.created_at


Observer = Callable[[Deployment, AutoscalePolicy], Observations]
Forecaster = Callable[[Deployment, AutoscalePolicy, datetime], Forecast | None]


@dataclass(frozen=True)
class Change:
    deployment_id: int
    before: int
    after: int
    reasons: tuple[str, ...]


def autoscale_deployments(
    *, observe: Observer, forecast: Forecaster | None = None, now: datetime | None = None
) -> list[Change]:
    """One autoscaler pass over every running deployment whose policy is enabled; the changes
    made. ``forecast`` is asked only for a deployment whose policy is predictive; a forecast that
    fails is logged and the pass goes on reactively."""
    changes: list[Change] = []
    candidates = Deployment.objects.filter(status=Deployment.Status.RUNNING, autoscale__enabled=True)
    for deployment in candidates.select_related("version__model").order_by("id"):
        try:
            policy = AutoscalePolicy.from_json(deployment.autoscale)
        except InvalidInput as exc:
            logger.warning("deployment %s: autoscale policy ignored: %s: %s", deployment.pk, exc.field, exc.message)
            continue
        observations = observe(deployment, policy)
        at = now or timezone.now()
        expected = _forecast(forecast, deployment, policy, at)
        decision = decide(
            DeploymentConfig.of(deployment, policy), observations, at, last_change_at(deployment), expected
        )
        if decision.target_replicas == deployment.replicas:
            logger.debug("deployment %s: %s", deployment.pk, "; ".join(decision.reasons))
            continue
        before = deployment.replicas
        scaled = deployment_scale(
            actor=AUTOSCALER,
            deployment=deployment,
            replicas=decision.target_replicas,
            reasons=list(decision.reasons),
            observations=observations.as_json() | ({"forecast": expected.as_json()} if expected else {}),
            expected=before,
        )
        if scaled is not None:
            logger.info(
                "deployment %s scaled %d → %d: %s",
                deployment.pk,
                before,
                decision.target_replicas,
                "; ".join(decision.reasons),
            )
            changes.append(Change(deployment.pk, before, decision.target_replicas, decision.reasons))
    return changes


def _forecast(
    forecast: Forecaster | None, deployment: Deployment, policy: AutoscalePolicy, at: datetime
) -> Forecast | None:
    if forecast is None or not policy.predictive:
        return None
    try:
        return forecast(deployment, policy, at)
    except Exception:  # one deployment's broken history must not stop the pass; reactive still runs
        logger.exception("deployment %s: no forecast this pass", deployment.pk)
        return None


def deployment_autoscale_set(*, actor: Actor, deployment: Deployment, autoscale: dict[str, Any]) -> Deployment:
    """Set a deployment's autoscaling policy (the keys of ``AutoscalePolicy``),
    checked first: a bad value is an InvalidInput naming the key. Audited."""
    policy = AutoscalePolicy.from_json(autoscale)
    if policy.enabled and is_adapter_framework(deployment.version.framework):
        raise InvalidInput("enabled", "A LoRA adapter runs on its base's replicas: autoscale the base's deployment.")
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        before = {"autoscale": locked.autoscale}
        Deployment.objects.filter(pk=locked.pk).update(autoscale=policy.as_json())
        locked.autoscale = policy.as_json()
        audit_record(
            actor=actor,
            action="deployment.autoscale",
            target_type="deployment",
            target=str(locked.pk),
            before=before,
            after={"autoscale": locked.autoscale},
        )
    deployment.autoscale = locked.autoscale
    return locked
