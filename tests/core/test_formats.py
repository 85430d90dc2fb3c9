"""The house formats (core.formats): one money format and one time format everywhere."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from django.template import Context, Template

from core import formats


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        (Decimal("1234.56"), "$1,234.56"),
        (Decimal("1234.565"), "$1,234.57"),
        (Decimal("0"), "$0.00"),
        (Decimal("0.01"), "$0.01"),
        (Decimal("0.0099"), "$0.0099"),
        # Under a cent: two significant digits, never "$0.00" nor "< $0.01".
        (Decimal("0.0043"), "$0.0043"),
        (Decimal("0.00431"), "$0.0043"),
        (Decimal("0.004"), "$0.004"),  # no trailing zero
        (Decimal("0.000598"), "$0.0006"),
        (Decimal("0.00023"), "$0.00023"),
        (Decimal("0.0000015"), "$0.000002"),  # at most six decimals
        (Decimal("0.000001"), "$0.000001"),
        (Decimal("0.0000009"), "< $0.000001"),  # below a millionth
        (Decimal("0.00996"), "$0.01"),  # rounds up to a cent
        (Decimal("-0.000598"), "-$0.0006"),
        (Decimal("-0.0000001"), "> -$0.000001"),
        (0.0043, "$0.0043"),  # a chart's float reads as the Decimal would
        (Decimal("-5"), "-$5.00"),
        (Decimal("1000000"), "$1,000,000.00"),
        (None, "—"),
        (3, "$3.00"),
    ],
)
def test_money(amount, text):
    assert formats.money(amount, "USD") == text


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        (Decimal("0.0006"), "$0.0006"),
        (Decimal("0.000598"), "$0.000598"),
        (Decimal("0.0000004"), "$0.00"),
        (Decimal("2.5"), "$2.50"),
        (Decimal("0.15"), "$0.15"),
        (Decimal("1234.56"), "$1,234.56"),
        (Decimal("-0.0006"), "-$0.0006"),
    ],
)
def test_unit_price(amount, text):
    assert formats.unit_price(amount, "USD") == text


def test_caps_read_as_configured_and_spend_against_them_as_money():
    # A cap of 0.0002 is shown as set, never "< $0.01"; what is spent against it has its digits.
    assert formats.unit_price(Decimal("0.000200"), "USD") == "$0.0002"
    assert formats.unit_price(Decimal("25.000000"), "USD") == "$25.00"
    assert formats.unit_price(Decimal("0.123456"), "USD") == "$0.123456"
    assert formats.money(Decimal("0.000194"), "USD") == "$0.00019"


def test_currencies_with_and_without_a_sign():
    assert formats.money(Decimal("12.3"), "EUR") == "€12.30"
    assert formats.money(Decimal("12.3"), "gbp") == "£12.30"
    assert formats.money(Decimal("12.3"), "CHF") == "12.30 CHF"
    assert formats.money(Decimal("0.001"), "CHF") == "0.001 CHF"
    assert formats.money(Decimal("0.0000001"), "CHF") == "< 0.000001 CHF"
    assert formats.unit_price(Decimal("0.0006"), "CHF") == "0.0006 CHF"


def test_times_are_utc_in_one_format():
    moment = datetime(2026, 11, 26, 23, 54, 7, tzinfo=UTC)
    east = moment.astimezone(timezone(timedelta(hours=5, minutes=30)))  # the same instant
    assert formats.utc(east) == "2026-11-26 23:54"
    assert formats.utc(moment, seconds=True) == "2026-11-26 23:54:07"
    assert formats.utc_date(datetime(2026, 11, 27, 1, 0, tzinfo=timezone(timedelta(hours=3)))) == "2026-11-26"
    assert formats.utc_month(date(2026, 11, 1)) == "2026-11"
    assert formats.utc(None) == "—"


def test_the_filters_are_in_every_template(settings):
    settings.BILLING_CURRENCY = "EUR"
    template = Template("{{ a|money }} {{ a|money:'USD' }} {{ p|unit_price }} {{ t|utc }} {{ t|utc_date }}")
    text = template.render(Context({"a": Decimal("1234.5"), "p": Decimal("0.0006"),
                                    "t": datetime(2026, 11, 26, 23, 54, tzinfo=UTC)}))  # fmt: skip
    assert text == "€1,234.50 $1,234.50 €0.0006 2026-11-26 23:54 2026-11-26"


@pytest.mark.parametrize(
    ("number", "text"),
    [(60, "60"), (1500, "1,500"), (9999, "9,999"), (10_000, "10k"), (100_000, "100k"), (150_000, "150k"),
     (1_000_000, "1M"), (2_500_000, "2.5M"), (1_250_000_000, "1.25B"), (12_345, "12.3k"), (None, "—")],
)  # fmt: skip
def test_quantity(number, text):
    assert formats.quantity(number) == text


@pytest.mark.parametrize(
    ("count", "noun", "plural", "text"),
    [(1, "replica", "", "1 replica"), (0, "replica", "", "0 replicas"), (3, "replica", "", "3 replicas"),
     (1, "entry", "entries", "1 entry"), (2, "entry", "entries", "2 entries"), (1500, "file", "", "1,500 files")],
)  # fmt: skip
def test_counted(count, noun, plural, text):
    assert formats.counted(count, noun, plural) == text
