"""Prices: effective periods that never overlap, validated amounts, the API's roles."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from accounts.models import Membership, Role
from accounts.services import platform_organization
from billing.models import Price
from billing.pricing import PriceQuote, micros_up, price_in_effect, request_cost
from billing.services import price_set
from core.errors import InvalidInput
from registry.models import AuditEntry, Model, ModelVersion
from tests.support.api import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def model() -> Model:
    return Model.objects.create(name="priced-chat", task="chat")


@pytest.fixture
def version(model) -> ModelVersion:
    return ModelVersion.objects.create(
        model=model, version="2", framework="x", artifact_uri="local://x/2", artifact_sha256="0" * 64, artifact_size=0
    )


class TestPriceSet:
    def test_a_new_price_ends_the_one_in_effect(self, model):
        first = price_set(model=model, input_per_million="0.10", output_per_million="0.30")
        changed_at = timezone.now() + timedelta(hours=1)
        second = price_set(model=model, input_per_million="0.20", output_per_million="0.60", effective_from=changed_at)
        first.refresh_from_db()
        assert first.effective_to == changed_at == second.effective_from
        assert second.effective_to is None
        assert second.cached_input_per_million == Decimal("0.20")  # defaults to the input price

    def test_each_price_change_is_audited_with_the_price_it_replaces(self, model, version):
        admin = get_user_model().objects.create_user(username="pricer")
        first = price_set(model=model, input_per_million="0.10", output_per_million="0.30", actor=admin)
        second = price_set(model=model, version=version, input_per_million="1", output_per_million="2")
        third = price_set(model=model, input_per_million="0.25", output_per_million="0.30",
                          effective_from=timezone.now() + timedelta(hours=1))  # fmt: skip
        entries = list(AuditEntry.objects.filter(action="price.set", target="priced-chat").order_by("id"))
        assert [(e.actor_name, e.target_type) for e in entries] == [("pricer", "model"), ("", "model"), ("", "model")]
        assert entries[0].before is None
        assert entries[0].after == {
            "version": None, "effective_from": first.effective_from.isoformat(), "input_per_million": "0.1",
            "output_per_million": "0.3", "cached_input_per_million": "0.1", "per_thousand_inferences": "0",
            "cached_per_thousand_inferences": "0", "batch_percent": "50",
        }  # fmt: skip
        assert entries[1].before is None  # the version had no price of its own
        assert entries[1].after["version"] == "2"
        assert entries[1].after["effective_from"] == second.effective_from.isoformat()
        assert entries[2].before == entries[0].after  # the model's price it ends
        assert entries[2].after["input_per_million"] == "0.25"
        assert entries[2].after["effective_from"] == third.effective_from.isoformat()

    def test_a_refused_price_leaves_no_audit_entry(self, model):
        with pytest.raises(InvalidInput):
            price_set(model=model, input_per_million="-1", output_per_million="0.30")
        assert not AuditEntry.objects.filter(action="price.set").exists()

    def test_a_later_scheduled_price_must_be_changed_first(self, model):
        price_set(model=model, input_per_million="1", output_per_million="1",
                  effective_from=timezone.now() + timedelta(days=1))  # fmt: skip
        with pytest.raises(InvalidInput) as excinfo:
            price_set(model=model, input_per_million="2", output_per_million="2")
        assert excinfo.value.field == "effective_from"

    def test_a_versions_price_comes_before_the_models(self, model, version):
        model_price = price_set(model=model, input_per_million="1", output_per_million="1")
        own = price_set(model=model, version=version, input_per_million="3", output_per_million="3")
        quotes = tuple(PriceQuote.of(p) for p in (model_price, own))
        now = timezone.now().timestamp() + 1
        assert price_in_effect(quotes, version_id=version.pk, when=now) == PriceQuote.of(own)
        assert price_in_effect(quotes, version_id=version.pk + 1000, when=now) == PriceQuote.of(model_price)
        assert price_in_effect(quotes, version_id=version.pk, when=now - 3600) is None  # before either began

    def test_a_request_admitted_just_before_a_switch_is_never_unpriced(self, model):
        """Issue 18: the gateway prices a request at its admission time from a routing table
        it may reload just after a scheduled switch; the price that just ended must be there."""
        from registry.models import Deployment
        from serving.gateway.routing import load_routing_table

        version = ModelVersion.objects.create(
            model=model, version="1", framework="x", artifact_uri="local://x/1", artifact_sha256="0" * 64,
            artifact_size=0, status="active",
        )  # fmt: skip
        Deployment.objects.create(version=version, status="running", traffic_weight=100)
        switch = timezone.now() - timedelta(seconds=2)
        old = Price.objects.create(
            model=model, input_per_million="1", output_per_million="1", cached_input_per_million="1",
            effective_from=switch - timedelta(days=1), effective_to=switch,
        )  # fmt: skip
        new = Price.objects.create(
            model=model, input_per_million="2", output_per_million="2", cached_input_per_million="2",
            effective_from=switch,
        )  # fmt: skip
        old.refresh_from_db()
        new.refresh_from_db()
        [route] = load_routing_table().models[model.name].versions  # reloaded after the switch
        assert route.price_at(switch.timestamp() - 0.5) == PriceQuote.of(old)
        assert route.price_at(switch.timestamp() + 0.5) == PriceQuote.of(new)

    @pytest.mark.parametrize(
        ("changes", "field"),
        [
            ({"input_per_million": "-1"}, "input_per_million"),
            ({"output_per_million": "0.0000001"}, "output_per_million"),  # more than 6 decimals
            ({"output_per_million": "1e12"}, "output_per_million"),  # above the column
            ({"input_per_million": "NaN"}, "input_per_million"),
            ({"input_per_million": "abc"}, "input_per_million"),
            ({"currency": "EUR"}, "currency"),
        ],
    )
    def test_bad_input_is_refused_naming_the_field(self, model, changes, field):
        values = {"input_per_million": "1", "output_per_million": "1", **changes}
        with pytest.raises(InvalidInput) as excinfo:
            price_set(model=model, **values)
        assert excinfo.value.field == field
        assert not Price.objects.filter(model=model).exists()

    def test_a_version_of_another_model_is_refused(self, model, version):
        other = Model.objects.create(name="other", task="chat")
        with pytest.raises(InvalidInput):
            price_set(model=other, version=version, input_per_million="1", output_per_million="1")


class TestCosts:
    def test_costs_are_exact_and_the_limiter_rounds_up(self):
        cost = request_cost(
            input_per_million=Decimal("0.15"), output_per_million=Decimal("0.60"),
            cached_input_per_million=Decimal("0.075"), input_tokens=7, output_tokens=11, cached_tokens=5,
        )  # fmt: skip
        assert cost == Decimal("0.000008025")  # (7 * 0.15 + 11 * 0.60 + 5 * 0.075) / 10^6
        assert micros_up(cost) == 9
        assert micros_up(Decimal("0.000008")) == 8


class TestPricesApi:
    def test_anyone_signed_in_reads_platform_admins_set(self, people, model):
        platform = platform_organization()
        Membership.objects.create(user=people["ml"], organization=platform, role=Role.PLATFORM_ADMIN)
        body = {"model": model.name, "input_per_million": "0.5", "output_per_million": "1.5"}
        assert client_for(people["alice"]).post("/api/prices/", body, format="json").status_code == 403
        created = client_for(people["ml"]).post("/api/prices/", body, format="json")
        assert created.status_code == 201, created.content
        assert (created.json()["model"], created.json()["input_per_million"]) == (model.name, "0.500000")
        listed = client_for(people["alice"]).get(f"/api/prices/?model={model.name}").json()
        assert [p["id"] for p in listed] == [created.json()["id"]]
        unknown = client_for(people["ml"]).post("/api/prices/", {**body, "model": "nope"}, format="json")
        assert (unknown.status_code, list(unknown.json())) == (400, ["model"])
        negative = client_for(people["ml"]).post("/api/prices/", {**body, "input_per_million": "-1"}, format="json")
        assert negative.status_code == 400


class TestSetPriceCommand:
    def test_it_prices_a_model_and_names_a_bad_option(self, model):
        from io import StringIO

        from django.core.management import call_command
        from django.core.management.base import CommandError

        out = StringIO()
        call_command("set_price", "--model", model.name, "--input", "0.1", "--output", "0.3", stdout=out)
        assert Price.objects.get(model=model).output_per_million == Decimal("0.3")
        with pytest.raises(CommandError, match="--output: must be zero or more"):
            call_command("set_price", "--model", model.name, "--input", "0.1", "--output", "-3")
        with pytest.raises(CommandError, match="no model named"):
            call_command("set_price", "--model", "nope", "--input", "1", "--output", "1")
