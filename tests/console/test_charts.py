"""One colour per model on every chart (its versions in shades of it)."""

from __future__ import annotations

from console.pages import charts


def test_a_model_has_one_colour_and_its_versions_shades_of_it():
    assert charts.model_colour("smollm2") == charts.model_colour("smollm2")
    colours = charts.version_colours([("smollm2", "2"), ("smollm2", "1"), ("minilm", "1")])
    assert colours[("smollm2", "1")] == charts.model_colour("smollm2")
    assert colours[("smollm2", "2")] == charts.model_colour("smollm2", shade=1) != colours[("smollm2", "1")]
    assert colours[("minilm", "1")] == charts.model_colour("minilm")
    assert all(c.startswith("#") and len(c) == 7 for c in colours.values())


def test_the_overview_and_the_portal_draw_a_model_in_its_colour(db):
    from datetime import UTC, date, datetime, timedelta
    from decimal import Decimal

    from accounts.services import api_key_create, organization_create
    from billing.models import UsageRollup
    from billing.usage_selectors import DailyUsage
    from console.pages.overview_data import dashboard
    from console.pages.portal_usage import figures

    key = api_key_create(organization=organization_create(name="Colours"), name="k").api_key
    now = datetime(2031, 1, 15, 12, 30, tzinfo=UTC)
    UsageRollup.objects.create(period=UsageRollup.Period.HOUR, start=now.replace(minute=0) - timedelta(hours=1),
                               organization_id=key.organization_id, api_key=key, model="paint", model_version="1",
                               requests=10, cost=Decimal("0.01"))  # fmt: skip
    overview = dashboard(range_key="day", now=now)
    assert {t["line"]["color"] for t in overview["figures"]["requests"]["data"]} == {charts.model_colour("paint")}
    day = date(2031, 1, 14)
    row = DailyUsage(date=day, model="paint", requests=3, errors=0, input_tokens=1, output_tokens=1, cached_tokens=0,
                     cost=Decimal("0.02"))  # fmt: skip
    cost = figures([row], start=day, end=day, currency="USD")["cost"]
    assert [t["marker"]["color"] for t in cost["data"]] == [charts.model_colour("paint")]
    # Every chart's axes grow their margin to fit their labels and titles: never clipped.
    for figure in (*overview["figures"].values(), cost):
        axes = [value for name, value in figure["layout"].items() if name.startswith(("xaxis", "yaxis"))]
        assert axes
        assert all(axis.get("automargin") is True for axis in axes)


def test_models_drawn_together_never_share_a_colour():
    # Twelve names: the palette's size, so a name's own place must sometimes be taken already.
    models = [f"model-{i}" for i in range(12)]
    assert len({charts.model_colour(m) for m in models}) < 12  # the hash alone collides here
    colours = charts.model_colours(models)
    assert len(set(colours.values())) == 12
    assert charts.model_colours(list(reversed(models))) == colours  # the same set: the same colours
    versions = charts.version_colours([(m, "1") for m in models])
    assert len(set(versions.values())) == 12
