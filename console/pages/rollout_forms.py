"""The forms of the console's deployment and canary pages; each maps a service's refusal onto its field."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django import forms

from registry.services import MAX_ADAPTERS_PER_BATCH
from rollout.autoscaler import AutoscalePolicy
from rollout.canary import DEFAULT_MIN_SAMPLES, DEFAULT_STEPS, MAX_INTERVAL_SECONDS

SMALLINT = 32767


def _choices(values: Iterable[str]) -> list[tuple[str, str]]:
    return [(value, value) for value in values]


def _set_choices(form: forms.Form, name: str, choices: list[tuple[str, str]]) -> None:
    field = form.fields[name]
    assert isinstance(field, forms.ChoiceField)
    field.choices = choices


class DeployForm(forms.Form):
    """Deploy one of a model's versions."""

    version = forms.ChoiceField()
    traffic_percent = forms.IntegerField(
        min_value=0, max_value=100, initial=0, label="Traffic %",
        help_text="its weight at once; set the whole split in the editor",
    )  # fmt: skip
    replicas = forms.IntegerField(
        min_value=1, max_value=SMALLINT, initial=1, help_text="ignored for a LoRA adapter: it runs on its base's"
    )  # fmt: skip
    max_adapters = forms.IntegerField(
        min_value=0, max_value=MAX_ADAPTERS_PER_BATCH, initial=0, required=False, label="LoRA adapters per batch",
        help_text="0: its engines take none; a chat or completion model only",
    )  # fmt: skip

    def __init__(self, *args: Any, versions: Iterable[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _set_choices(self, "version", _choices(versions))


class TrafficSplitForm(forms.Form):
    """One whole percentage per serving version; the service checks that they sum to 100."""

    PREFIX = "weight-"

    def __init__(self, *args: Any, split: Mapping[str, int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for version, weight in sorted(split.items()):
            self.fields[self.PREFIX + version] = forms.IntegerField(
                label=version, min_value=0, max_value=100, initial=weight,
                widget=forms.NumberInput(attrs={"data-weight": version, "inputmode": "numeric"}),
            )  # fmt: skip

    def weights(self) -> dict[str, object]:
        return {name.removeprefix(self.PREFIX): value for name, value in self.cleaned_data.items()}


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=1, max_value=SMALLINT, help_text="wanted now")
    min_replicas = forms.IntegerField(min_value=1, max_value=SMALLINT, label="Min")
    max_replicas = forms.IntegerField(min_value=1, max_value=SMALLINT, label="Max")


class AdaptersForm(forms.Form):
    """A deployment's LoRA adapters per batch, after deploy (``registry.services.deployment_adapters_set``)."""

    max_adapters = forms.IntegerField(
        min_value=0, max_value=MAX_ADAPTERS_PER_BATCH, label="LoRA adapters per batch",
        help_text="vLLM's --max-loras; 0 turns LoRA off. Its engines restart one replica at a time to take it",
    )  # fmt: skip


class AutoscaleForm(forms.Form):
    """The autoscaling policy (``rollout.autoscaler.AutoscalePolicy``); a blank field is its default."""

    enabled = forms.BooleanField(required=False)
    target_queue_per_replica = forms.FloatField(required=False, label="Queue per replica")
    target_in_flight_per_replica = forms.FloatField(required=False, label="In flight per replica")
    target_p99_ms = forms.FloatField(required=False, label="p99 latency ms", help_text="blank: not a target")
    target_p99_ttft_ms = forms.FloatField(required=False, label="p99 TTFT ms", help_text="blank: not a target")
    cooldown_seconds = forms.FloatField(required=False, label="Cooldown s")
    scale_in_quiet_seconds = forms.FloatField(required=False, label="Quiet before scale-in s")
    scale_in_utilisation = forms.FloatField(required=False, label="Scale-in utilisation (0-1]")
    max_step = forms.IntegerField(required=False, min_value=1, label="Max step", help_text="blank: double")
    predictive = forms.BooleanField(
        required=False, label="Predictive", help_text="also scale ahead of the weekly profile's expected rise"
    )
    predictive_lead_seconds = forms.FloatField(
        required=False, label="Predictive lead s", help_text="blank: the model's measured load time plus a tick"
    )

    NULLABLE = ("target_p99_ms", "target_p99_ttft_ms", "max_step", "predictive_lead_seconds")

    @classmethod
    def initial_from(cls, autoscale: Mapping[str, Any]) -> dict[str, Any]:
        defaults = AutoscalePolicy().as_json()
        return {name: autoscale.get(name, defaults.get(name)) for name in cls.base_fields}

    def policy(self) -> dict[str, Any]:
        """The policy to set: a blank default-able field is left out, a blank target cleared."""
        policy: dict[str, Any] = {}
        for name, value in self.cleaned_data.items():
            if value is not None or name in self.NULLABLE:
                policy[name] = value
        return policy


class SwapForm(forms.Form):
    version = forms.ChoiceField(label="Swap to version")

    def __init__(self, *args: Any, versions: Iterable[str], current: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The current version stays a choice, marked: the service says why it cannot be swapped to.
        others = [(v, v) for v in versions if v != current]
        _set_choices(self, "version", [*others, (current, f"{current} (serving now)")])


class CanaryStartForm(forms.Form):
    """The canary wizard; the service (``rollout.canary.canary_create``) has the last word."""

    base_version = forms.ChoiceField(help_text="the version serving now")
    canary_version = forms.ChoiceField(help_text="the candidate; both need a pending or running deployment")
    steps = forms.CharField(
        initial=",".join(str(step) for step in DEFAULT_STEPS),
        help_text="the canary's percentage at each step, increasing, e.g. 5,25,50,100",
    )
    interval_seconds = forms.IntegerField(
        min_value=1, max_value=MAX_INTERVAL_SECONDS, initial=300, label="Interval (seconds)",
        help_text="how long each judgement's window lasts",
    )  # fmt: skip
    min_samples = forms.IntegerField(
        min_value=1,
        initial=DEFAULT_MIN_SAMPLES,
        help_text="requests each arm needs before any verdict (those their clients cancelled do not count)",
    )
    max_p99_latency_ms = forms.FloatField(required=False, label="Max p99 latency (ms)")
    min_success_rate = forms.FloatField(
        required=False, min_value=0, max_value=100, label="Min success rate (%)",
        help_text="e.g. 99: the canary fails a window where more than 1 request in 100 ends in a server error",
    )  # fmt: skip
    max_ttft_p99_ms = forms.FloatField(required=False, label="Max p99 TTFT (ms)")
    auto_promote = forms.BooleanField(required=False, help_text="promote without a person once every step passed")

    CRITERIA = ("max_p99_latency_ms", "min_success_rate", "max_ttft_p99_ms")

    def __init__(self, *args: Any, serving: Iterable[str], deployed: Iterable[str], **kwargs: Any) -> None:
        """Only valid choices: the base is a version serving now, the candidate another deployed one."""
        super().__init__(*args, **kwargs)
        serving, deployed = list(serving), list(deployed)
        _set_choices(self, "base_version", _choices(serving))
        _set_choices(self, "canary_version", _choices([v for v in deployed if v not in serving] or deployed))

    def clean(self) -> dict[str, Any] | None:
        cleaned = super().clean()
        base, candidate = self.cleaned_data.get("base_version"), self.cleaned_data.get("canary_version")
        if base and base == candidate:
            self.add_error("canary_version", f"The candidate must be another version than the base: {base} is both.")
        return cleaned

    def clean_steps(self) -> list[int]:
        raw = [part.strip().rstrip("%") for part in str(self.cleaned_data["steps"]).split(",")]
        try:
            return [int(part) for part in raw if part]
        except ValueError:
            raise forms.ValidationError("Give whole percentages separated by commas, e.g. 5,25,50,100.") from None

    def criteria(self) -> dict[str, float]:
        """The success criteria as the service takes them (the success rate as a share)."""
        found = {key: self.cleaned_data[key] for key in self.CRITERIA if self.cleaned_data.get(key) is not None}
        if "min_success_rate" in found:
            found["min_success_rate"] = round(found["min_success_rate"] / 100, 6)
        return found

    def schedule(self) -> list[tuple[int, int, int]] | None:
        """(percent, from second, to second) of each step at the fastest (a window each), for
        the steps and interval entered (or the initial ones); None while they do not parse."""
        data = self.cleaned_data if self.is_bound and hasattr(self, "cleaned_data") else {}
        steps = data.get("steps") if self.is_bound else [int(p) for p in str(self["steps"].initial).split(",")]
        interval = data.get("interval_seconds") if self.is_bound else self["interval_seconds"].initial
        if not steps or not interval:
            return None
        return [(percent, i * int(interval), (i + 1) * int(interval)) for i, percent in enumerate(steps)]


class ShadowForm(forms.Form):
    version = forms.ChoiceField(
        label="Candidate version",
        help_text="where the copies go: it answers them while it has a running deployment (its weight may be 0)",
    )
    percent = forms.DecimalField(
        min_value=0, max_value=100, max_digits=5, decimal_places=2, initial=10,
        label="Mirror %", help_text="share of the model's requests copied to it",
    )  # fmt: skip

    def __init__(self, *args: Any, versions: Iterable[tuple[str, str]], **kwargs: Any) -> None:
        """``versions``: (version, what it is now, e.g. "deployed, no traffic") of each version."""
        super().__init__(*args, **kwargs)
        _set_choices(self, "version", [(version, f"{version} ({now})") for version, now in versions])
