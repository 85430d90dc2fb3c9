"""Canaries: their writes (start, pause, resume, promote, roll back) and the controller that
judges each running one at its interval boundaries and moves it a step on, holds, or rolls it back.

State machine (``Canary.TRANSITIONS``)::

    running → paused → running;  running|paused → promoted | rolled_back;
    running → completed (every step passed, no auto_promote) → promoted | rolled_back

Every move locks the canary's row (``SELECT … FOR UPDATE``) and checks it against the stored
status, so a beat that overlaps another, or a person acting while the controller decides,
changes nothing twice. Weights move only through ``registry.services.traffic_set``, which
publishes the routing change when the transaction commits.

The controller reads the requests each arm served through a function it is given
(``SampleLoader``), so tests and benchmarks can feed it samples of their own;
``rollout.tasks`` hands it ``rollout.served_requests.served_requests`` (billing's usage
records). The statistics are ``rollout.canary_stats``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any, Protocol

from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import InvalidInput
from core.transitions import check_transition
from registry.models import Deployment, Model, ModelVersion
from registry.services import CANARY_CONTROLLER, Actor, audit_record, traffic_set
from rollout.canary_stats import CRITERIA, Judgement, RequestSample, Verdict, judge
from rollout.models import Canary, CanaryDecision

logger = logging.getLogger(__name__)

DEFAULT_STEPS = (5, 25, 50, 100)
DEFAULT_MIN_SAMPLES = 50
MAX_STEPS = 20
MAX_INTERVAL_SECONDS = 7 * 24 * 3600


class SampleLoader(Protocol):
    """The requests ``model``:``version`` answered through an engine since ``since``."""

    def __call__(self, *, model: str, version: str, since: datetime) -> Sequence[RequestSample]: ...


class CanaryConflict(Exception):
    """The model has an active canary already (running, paused or completed)."""

    def __init__(self, model: Model) -> None:
        super().__init__(f"{model.name} has an active canary already; promote or roll it back first.")


def _steps_from(steps: object, canary_percentage: object) -> list[int]:
    def whole(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if canary_percentage is not None and not (
        isinstance(canary_percentage, int) and not isinstance(canary_percentage, bool) and 1 <= canary_percentage <= 99
    ):
        raise InvalidInput("canary_percentage", "Must be an integer percentage from 1 to 99.")
    if steps is None:
        if canary_percentage is None:
            return list(DEFAULT_STEPS)
        return [canary_percentage, *(step for step in DEFAULT_STEPS if step > canary_percentage)]
    if not isinstance(steps, list) or not steps or len(steps) > MAX_STEPS:
        raise InvalidInput("steps", f"Must be a list of 1 to {MAX_STEPS} percentages, e.g. [5, 25, 50, 100].")
    if not all(whole(step) and 1 <= step <= 100 for step in steps):
        raise InvalidInput("steps", "Each step must be an integer percentage from 1 to 100.")
    if any(later <= earlier for earlier, later in pairwise(steps)):
        raise InvalidInput("steps", "Steps must increase.")
    if steps[0] == 100:
        raise InvalidInput("steps", "The first step must be below 100: at 100 % there is no base to compare with.")
    if canary_percentage is not None and canary_percentage != steps[0]:
        raise InvalidInput("canary_percentage", f"Must be the first step ({steps[0]}) when steps are given.")
    return [int(step) for step in steps]


def _criteria_from(criteria: object) -> dict[str, float]:
    if criteria is None:
        return {}
    if not isinstance(criteria, Mapping):
        raise InvalidInput("success_criteria", f"Must be an object with any of {', '.join(CRITERIA)}.")
    out: dict[str, float] = {}
    for key, value in criteria.items():
        field = f"success_criteria.{key}"
        if key not in CRITERIA:
            raise InvalidInput(field, f"Unknown criterion; known: {', '.join(CRITERIA)}.")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInput(field, "Must be a number.")
        if key == "min_success_rate" and not 0 <= value <= 1:
            raise InvalidInput(field, "Must be a share between 0 and 1 (0.99 is 99 %).")
        if key != "min_success_rate" and value <= 0:
            raise InvalidInput(field, "Must be positive.")
        out[key] = float(value)
    return out


def _serving_version(model: Model, version: str, field: str) -> ModelVersion:
    found = ModelVersion.objects.filter(model=model, version=version).first()
    if found is None:
        raise InvalidInput(field, f"{model.name} has no version {version!r}.")
    serving = Deployment.objects.filter(
        version=found, status__in=(Deployment.Status.PENDING, Deployment.Status.RUNNING)
    ).exists()
    if not serving:
        raise InvalidInput(field, f"{model.name}:{version} has no pending or running deployment.")
    return found


def _weights(canary: Canary, canary_percent: int) -> dict[str, int]:
    """The split for ``canary_percent``; a version at 0 is left out (it need not be serving)."""
    split = {canary.base_version.version: 100 - canary_percent, canary.canary_version.version: canary_percent}
    return {version: weight for version, weight in split.items() if weight > 0}


def _snapshot(canary: Canary) -> dict[str, Any]:
    return {
        "id": canary.pk,
        "model": canary.model.name,
        "base_version": canary.base_version.version,
        "canary_version": canary.canary_version.version,
        "status": canary.status,
        "steps": canary.steps,
        "current_step": canary.current_step,
        "canary_percent": canary.canary_percent,
        "interval_seconds": canary.interval_seconds,
        "min_samples": canary.min_samples,
        "success_criteria": canary.success_criteria,
        "auto_promote": canary.auto_promote,
    }


def canary_create(
    *,
    actor: Actor,
    model: Model,
    base_version: str,
    canary_version: str,
    interval_seconds: object,
    steps: object = None,
    canary_percentage: object = None,
    success_criteria: object = None,
    auto_promote: bool = False,
    min_samples: object = DEFAULT_MIN_SAMPLES,
    now: datetime | None = None,
) -> Canary:
    """Start a canary: ``canary_version`` takes the first step's share of ``model``'s traffic
    from ``base_version`` at once (the gateways reload on commit), judged every ``interval_seconds``.

    Without ``steps``, ``canary_percentage`` (default 5) is the first step, then 25, 50, 100 above
    it. Both versions need a pending or running deployment. Raises ``InvalidInput`` naming the
    field, or ``CanaryConflict`` when the model has an active canary.
    """
    step_list = _steps_from(steps, canary_percentage)
    criteria = _criteria_from(success_criteria)
    if isinstance(interval_seconds, bool) or not isinstance(interval_seconds, int):
        raise InvalidInput("interval_seconds", "Must be a whole number of seconds.")
    if not 1 <= interval_seconds <= MAX_INTERVAL_SECONDS:
        raise InvalidInput("interval_seconds", f"Must be between 1 and {MAX_INTERVAL_SECONDS}.")
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
        raise InvalidInput("min_samples", "Must be a whole number of requests, at least 1.")
    if base_version == canary_version:
        raise InvalidInput("canary_version", f"Must be another version than base_version: {canary_version!r} is both.")
    base = _serving_version(model, base_version, "base_version")
    candidate = _serving_version(model, canary_version, "canary_version")
    now = now or timezone.now()
    try:
        with transaction.atomic():
            # The model's row serialises canary starts; the constraint is the backstop.
            Model.objects.select_for_update().get(pk=model.pk)
            if Canary.objects.filter(model=model, status__in=Canary.ACTIVE_STATUSES).exists():
                raise CanaryConflict(model)
            canary = Canary.objects.create(
                model=model,
                base_version=base,
                canary_version=candidate,
                steps=step_list,
                interval_seconds=interval_seconds,
                min_samples=min_samples,
                success_criteria=criteria,
                auto_promote=auto_promote,
                step_started_at=now,
                next_decision_at=now + timedelta(seconds=interval_seconds),
                created_by_id=actor.pk if actor is not None and actor.is_authenticated else None,
            )
            traffic_set(actor=actor, model=model, weights=_weights(canary, step_list[0]))
            audit_record(
                actor=actor,
                action="canary.create",
                target_type="canary",
                target=model.name,
                before=None,
                after=_snapshot(canary),
            )
    except IntegrityError as exc:
        raise CanaryConflict(model) from exc
    return canary


def active_canary(*, model: Model) -> Canary | None:
    """The model's running, paused or completed canary, if any."""
    return (
        Canary.objects.select_related("model", "base_version", "canary_version")
        .filter(model=model, status__in=Canary.ACTIVE_STATUSES)
        .first()
    )


def _locked(canary: Canary) -> Canary:
    """The canary's row, locked. Call inside transaction.atomic."""
    return (
        Canary.objects.select_for_update(of=("self",))
        .select_related("model", "base_version", "canary_version")
        .get(pk=canary.pk)
    )


def _audit(actor: Actor, action: str, before: dict[str, Any], canary: Canary, **extra: Any) -> None:
    audit_record(
        actor=actor,
        action=action,
        target_type="canary",
        target=canary.model.name,
        before=before,
        after={**_snapshot(canary), **extra},
    )


def canary_pause(*, actor: Actor, canary: Canary) -> Canary:
    """Stop judging; the split stays as it is until resumed, promoted or rolled back."""
    with transaction.atomic():
        locked = _locked(canary)
        before = _snapshot(locked)
        check_transition(locked, Canary.Status.PAUSED)
        locked.save(update_fields=["status", "updated_at"])
        _audit(actor, "canary.pause", before, locked)
    return locked


def canary_resume(*, actor: Actor, canary: Canary, now: datetime | None = None) -> Canary:
    """Judge again, from a fresh window of the current step (what came before the pause is not counted)."""
    now = now or timezone.now()
    with transaction.atomic():
        locked = _locked(canary)
        before = _snapshot(locked)
        check_transition(locked, Canary.Status.RUNNING)
        locked.step_started_at = now
        locked.next_decision_at = now + timedelta(seconds=locked.interval_seconds)
        locked.save(update_fields=["status", "step_started_at", "next_decision_at", "updated_at"])
        _audit(actor, "canary.resume", before, locked)
    return locked


def canary_promote(*, actor: Actor, canary: Canary, now: datetime | None = None) -> Canary:
    """A person promotes: the canary takes all the traffic, the base none."""
    return _finish(actor, canary, Canary.Status.PROMOTED, now=now)


def canary_rollback(*, actor: Actor, canary: Canary, now: datetime | None = None) -> Canary:
    """A person rolls back: the canary's weight is 0 at once, the base takes all the traffic."""
    return _finish(actor, canary, Canary.Status.ROLLED_BACK, now=now)


def _finish(actor: Actor, canary: Canary, target: str, *, now: datetime | None) -> Canary:
    now = now or timezone.now()
    promoted = target == Canary.Status.PROMOTED
    with transaction.atomic():
        locked = _locked(canary)
        before = _snapshot(locked)
        check_transition(locked, target)
        weights = {locked.canary_version.version: 100} if promoted else {locked.base_version.version: 100}
        split = traffic_set(actor=actor, model=locked.model, weights=weights)
        locked.save(update_fields=["status", "updated_at"])
        who = actor.get_username() if actor is not None and actor.is_authenticated else "the operator"
        decision = CanaryDecision.objects.create(
            canary=locked,
            at=now,
            step=locked.current_step,
            canary_percent=locked.canary_percent,
            verdict=CanaryDecision.Verdict.PROMOTE if promoted else CanaryDecision.Verdict.ROLLBACK,
            reasons=[f"{'promoted' if promoted else 'rolled back'} by {who}"],
            figures={"weights": split},
            actor_id=actor.pk if actor is not None and actor.is_authenticated else None,
        )
        _audit(actor, f"canary.{'promote' if promoted else 'rollback'}", before, locked, decision=decision.pk)
    return locked


def canary_tick(*, load_samples: SampleLoader, now: datetime | None = None) -> list[CanaryDecision]:
    """Judge every running canary whose interval boundary has come; the decisions made.

    Safe to run from overlapping beats: each canary is decided under its row lock, and a
    canary whose boundary another run has moved on meanwhile is left alone.
    """
    now = now or timezone.now()
    due = Canary.objects.filter(status=Canary.Status.RUNNING, next_decision_at__lte=now).values_list("pk", flat=True)
    decisions = []
    for canary_id in list(due):
        try:
            decision = canary_decide(canary_id=canary_id, load_samples=load_samples, now=now)
        except Exception:  # one canary's failure must not stop the others' judgements
            logger.exception("canary %s could not be judged", canary_id)
            continue
        if decision is not None:
            decisions.append(decision)
    return decisions


def _next_boundary(canary: Canary, now: datetime) -> datetime:
    """The first boundary of the current window after ``now`` (boundaries missed while no beat ran are skipped)."""
    interval = timedelta(seconds=canary.interval_seconds)
    passed = max(0, int((now - canary.step_started_at) / interval))
    return canary.step_started_at + (passed + 1) * interval


def canary_decide(*, canary_id: int, load_samples: SampleLoader, now: datetime | None = None) -> CanaryDecision | None:
    """Judge one canary if it is running and its boundary has come (else None, nothing written).

    The window is the current step's: the requests each arm answered since ``step_started_at``.
    ``hold`` until each arm has ``min_samples``, or while the canary looks worse without the
    evidence yet (the window keeps growing across boundaries); ``rollback`` (canary at 0 at
    once) when it is worse; otherwise the next step, or at the
    last one ``promote`` (``auto_promote``) or ``completed``, waiting for a person. A step of 100 %
    is never judged (no base traffic to compare with): reaching it is the promotion.
    """
    now = now or timezone.now()
    with transaction.atomic():
        canary = (
            Canary.objects.select_for_update(of=("self",))
            .select_related("model", "base_version", "canary_version")
            .filter(pk=canary_id)
            .first()
        )
        if canary is None or canary.status != Canary.Status.RUNNING or canary.next_decision_at > now:
            return None
        before = _snapshot(canary)
        model, since = canary.model.name, canary.step_started_at
        base = load_samples(model=model, version=canary.base_version.version, since=since)
        candidate = load_samples(model=model, version=canary.canary_version.version, since=since)
        judgement = judge(base, candidate, min_samples=canary.min_samples, criteria=canary.success_criteria)
        step, percent = canary.current_step, canary.canary_percent
        verdict, reasons = _apply(canary, judgement, now)
        decision = CanaryDecision.objects.create(
            canary=canary,
            at=now,
            step=step,
            canary_percent=percent,
            verdict=verdict,
            reasons=reasons,
            figures={**judgement.figures, "window_start": since.isoformat()},
        )
        _audit(CANARY_CONTROLLER, f"canary.{verdict}", before, canary, decision=decision.pk, reasons=reasons)
    return decision


@dataclass(frozen=True)
class Move:
    """What a judgement does to a canary; None: unchanged."""

    verdict: str
    status: str | None = None
    next_step: int | None = None
    canary_percent: int | None = None
    note: str | None = None


def plan_move(*, steps: Sequence[int], current_step: int, auto_promote: bool, judged: Verdict) -> Move:
    """The move a judgement of step ``current_step`` makes (pure: the simulation runs it too).

    ``pass`` goes to the next step; passing the last step below 100, or going to a last step
    of 100 (never judged: no base traffic is left to compare with), is the end: promoted
    with ``auto_promote``, else completed, held there for a person.
    """
    V = CanaryDecision.Verdict
    if judged == "hold":
        return Move(V.HOLD)
    if judged == "rollback":
        return Move(V.ROLLBACK, status=Canary.Status.ROLLED_BACK, canary_percent=0)
    last = current_step == len(steps) - 1
    to_last_100 = not last and current_step + 1 == len(steps) - 1 and steps[-1] == 100
    if (last or to_last_100) and auto_promote:
        return Move(V.PROMOTE, status=Canary.Status.PROMOTED, canary_percent=100, note="every step passed: promoted")
    if last:
        return Move(
            V.HOLD,
            status=Canary.Status.COMPLETED,
            note=f"every step passed: held at {steps[current_step]} % until a person promotes",
        )
    following = int(steps[current_step + 1])
    return Move(
        V.PROMOTE_STEP,
        status=Canary.Status.COMPLETED if to_last_100 else None,
        next_step=current_step + 1,
        canary_percent=following,
        note=f"step {current_step + 2} of {len(steps)}: canary at {following} %"
        + (", held there until a person promotes" if to_last_100 else ""),
    )


def _apply(canary: Canary, judgement: Judgement, now: datetime) -> tuple[str, list[str]]:
    """Carry out a judgement on the locked canary: weights, status, step and next boundary.
    Call inside transaction.atomic with the canary's row locked."""
    move = plan_move(
        steps=canary.steps, current_step=canary.current_step, auto_promote=canary.auto_promote, judged=judgement.verdict
    )
    reasons = [*judgement.reasons, *([move.note] if move.note else [])]
    if move.canary_percent is not None:
        weights = _weights(canary, move.canary_percent)
        try:
            with transaction.atomic():
                traffic_set(actor=CANARY_CONTROLLER, model=canary.model, weights=weights)
        except InvalidInput as exc:
            logger.error("canary %s: the split %s could not be set: %s", canary.pk, weights, exc)
            reasons.append(f"the split {weights} could not be set ({exc.message}); holding")
            move = Move(CanaryDecision.Verdict.HOLD)
    if move.status is not None:
        check_transition(canary, move.status)
    if move.next_step is not None:
        canary.current_step = move.next_step
        canary.step_started_at = now
    canary.next_decision_at = _next_boundary(canary, now)
    canary.save(update_fields=["status", "current_step", "step_started_at", "next_decision_at", "updated_at"])
    return move.verdict, reasons
