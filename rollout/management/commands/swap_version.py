"""Hot-swap a model's deployment to another registered version, without dropping a request."""

from __future__ import annotations

import time
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from core.errors import InvalidInput
from registry.models import Deployment, Model, ModelVersion, Replica
from rollout.hotswap import (
    Swap,
    deployment_prewarm,
    deployment_swap_cancel,
    deployment_swap_version,
    open_swaps,
    swap_get,
    swap_step,
)


class Command(BaseCommand):
    help = (
        "Replace the version a model's deployment serves: the new replicas start, traffic moves once "
        "all are ready, then the old ones drain and stop. Supervisors (runworkers) carry the swap; "
        "this command starts it and follows it."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("model", help="the model's public name")
        parser.add_argument("version", nargs="?", help="the registered version to serve")
        parser.add_argument("--deployment", type=int, help="the deployment to swap (default: the model's only one)")
        parser.add_argument("--no-wait", action="store_true", help="start the swap and return")
        parser.add_argument("--timeout", type=float, default=900.0, help="stop following after this many seconds")
        parser.add_argument("--cancel", action="store_true", help="give up the model's swap (before traffic moves)")
        parser.add_argument(
            "--prewarm",
            action="store_true",
            help="do not swap yet: start the version's replicas as warm standbys (never routed); "
            "the swap to it run later promotes them instead of waiting for cold starts",
        )
        parser.add_argument("--standby", type=int, help="with --prewarm: how many (default: the deployment's replicas)")

    def handle(self, *args: Any, **options: Any) -> None:
        model = Model.objects.filter(name=options["model"]).first()
        if model is None:
            raise CommandError(f"There is no model {options['model']!r}.")
        if options["cancel"]:
            self._cancel(model)
            return
        if not options["version"]:
            raise CommandError("Name the version to swap to (or --cancel).")
        version = ModelVersion.objects.filter(model=model, version=options["version"]).first()
        if version is None:
            raise CommandError(f"{model.name} has no version {options['version']!r}; register it first.")
        deployment = self._deployment(model, version, options["deployment"])
        if options["prewarm"]:
            self._prewarm(deployment, version, options)
            return
        try:
            new = deployment_swap_version(actor=None, deployment=deployment, version=version)
        except InvalidInput as exc:
            raise CommandError(exc.message) from exc
        swap = next(s for s in open_swaps() if s.old_id == deployment.pk)
        self._say(
            f"{swap} started: deployment {deployment.pk} → deployment {new.pk}, "
            f"{new.replicas} replica(s) of {version.version} starting"
        )
        if not options["no_wait"]:
            self._follow(swap, options["timeout"])

    def _prewarm(self, deployment: Deployment, version: ModelVersion, options: dict[str, Any]) -> None:
        try:
            pool = deployment_prewarm(actor=None, deployment=deployment, version=version, standby=options["standby"])
        except InvalidInput as exc:
            raise CommandError(exc.message) from exc
        self._say(f"warm pool of {version}: deployment {pool.pk}, {pool.standby} standby replica(s) starting")
        if options["no_wait"]:
            return
        deadline = time.monotonic() + options["timeout"]
        last = -1
        while time.monotonic() < deadline:
            ready = Replica.objects.filter(deployment_id=pool.pk, state=Replica.State.READY, standby=True).count()
            if ready != last:
                self._say(f"warm pool of {version}: {ready}/{pool.standby} standby replica(s) ready")
                last = ready
            if ready >= pool.standby:
                self.stdout.write(self.style.SUCCESS(f"{version} is warm: swap_version {version.model.name} "
                                                     f"{version.version} now promotes its standbys"))  # fmt: skip
                return
            time.sleep(1)
        self._say(f"warm pool of {version}: still starting; the supervisors carry on.")

    def _deployment(self, model: Model, version: ModelVersion, pk: int | None) -> Deployment:
        serving = Deployment.objects.filter(
            version__model=model, status__in=[Deployment.Status.PENDING, Deployment.Status.RUNNING]
        ).select_related("version")
        if pk is not None:
            found = serving.filter(pk=pk).first()
            if found is None:
                raise CommandError(f"Deployment {pk} is not a serving deployment of {model.name}.")
            return found
        candidates = [d for d in serving.exclude(version=version) if not d.is_canary]
        if len(candidates) != 1:
            listed = ", ".join(f"{d.pk} ({d.version.version}, weight {d.traffic_weight})" for d in candidates) or "none"
            raise CommandError(f"Choose the deployment to swap with --deployment; serving: {listed}.")
        return candidates[0]

    def _follow(self, swap: Swap, timeout: float) -> None:
        """Print the swap's progress until it is done; steps it too (harmless beside supervisors)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for message in swap_step():
                if message.startswith(f"{swap}:"):
                    self._say(message)
            current = swap_get(swap_id=swap.entry.pk)
            if current is None:
                raise CommandError(f"{swap} disappeared from the audit log.")
            ready = Replica.objects.filter(deployment_id=swap.new_id, state=Replica.State.READY, standby=False).count()
            status = f"{current.phase}; new replicas ready: {ready}"
            if status != last:
                self._say(f"{swap}: {status}")
                last = status
            if current.outcome is not None:
                if current.outcome != "completed":
                    raise CommandError(f"{swap} {current.outcome}.")
                self.stdout.write(self.style.SUCCESS(f"{swap} completed"))
                return
            time.sleep(1)
        self._say(f"{swap} is still under way ({last}); the supervisors carry it on.")

    def _cancel(self, model: Model) -> None:
        swaps = [s for s in open_swaps() if s.model == model.name]
        if not swaps:
            raise CommandError(f"No swap of {model.name} is under way.")
        for swap in swaps:
            try:
                deployment_swap_cancel(actor=None, swap=swap.entry)
            except InvalidInput as exc:
                raise CommandError(f"{swap}: {exc.message}") from exc
            self._say(f"{swap} cancelled; deployment {swap.new_id} stops, deployment {swap.old_id} serves on")

    def _say(self, message: str) -> None:
        self.stdout.write(message)
        self.stdout.flush()
