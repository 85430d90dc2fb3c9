"""One rule for what a request is charged (billing.pricing): the gateway's charge, the SQL the
rollups and invoices sum, and the savings of a cache hit agree on every kind of record."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.db import connection

from accounts.models import ApiKey
from accounts.services import api_key_create
from billing.models import CacheOutcome, UsageRecord
from billing.pricing import ChargedTokens, PriceQuote, charged_tokens_sql, saved_sql
from tests.support.usage_records import make_record

QUOTE = PriceQuote(
    price_id=0, version_id=None, input_per_million=Decimal("3"), output_per_million=Decimal("7"),
    cached_input_per_million=Decimal("0.5"), currency="USD", effective_from=0.0, effective_to=None,
    per_thousand_inferences=Decimal("0.2"), cached_per_thousand_inferences=Decimal("0.05"),
)  # fmt: skip

# (prompt, completion, cached reported, cache outcome, inferences)
CASES = [
    (100, 20, 0, CacheOutcome.MISS, 0),  # nothing cached
    (100, 20, 60, CacheOutcome.MISS, 0),  # an engine's prefix cache served 60 prompt tokens
    (10, 5, 25, CacheOutcome.MISS, 0),  # an engine reporting more cached than the prompt
    (0, 0, 0, CacheOutcome.MISS, 0),  # a request no engine ran
    (40, 12, 40, CacheOutcome.HIT, 0),  # a semantic-cache hit: every prompt token cached
    (0, 0, 0, CacheOutcome.MISS, 16),  # a small model's request of 16 items
    (0, 0, 0, CacheOutcome.HIT, 3),  # one answered from the exact result cache
]


def test_the_rule():
    assert ChargedTokens.of(prompt=100, completion=20, cached=60, cache_hit=False) == ChargedTokens(40, 20, 60)
    assert ChargedTokens.of(prompt=10, completion=5, cached=25, cache_hit=False) == ChargedTokens(0, 5, 10)
    assert ChargedTokens.of(prompt=40, completion=12, cached=40, cache_hit=True) == ChargedTokens(0, 0, 52)
    # A hit costs its prompt and answer at the cached price, and saved the rest.
    charged = QUOTE.charge(prompt=40, completion=12, cached=40, cache_hit=True)
    assert charged == Decimal(52 * Decimal("0.5")) / 1_000_000
    assert QUOTE.saved(prompt=40, completion=12, charged=charged) == (40 * 3 + 12 * 7 - 26) / Decimal(1_000_000)
    # A small model's items: at the price per thousand, or the cached price per thousand on a hit.
    assert ChargedTokens.of(prompt=0, completion=0, cached=0, cache_hit=False, inferences=16) == ChargedTokens(
        0, 0, 0, inferences=16
    )
    assert QUOTE.charge(prompt=0, completion=0, cached=0, cache_hit=False, inferences=16) == Decimal("0.0032")
    hit = QUOTE.charge(prompt=0, completion=0, cached=0, cache_hit=True, inferences=3)
    assert hit == Decimal("0.00015")
    assert QUOTE.saved(prompt=0, completion=0, charged=hit, inferences=3) == Decimal("0.00045")
    # A reservation is the most the request may cost: no prefix cache assumed.
    assert QUOTE.reservation(prompt_tokens=100, output_tokens=20) >= QUOTE.charge(
        prompt=100, completion=20, cached=60, cache_hit=False
    )


@pytest.fixture
def key(alice_org) -> ApiKey:
    return api_key_create(organization=alice_org, name="rule").api_key


@pytest.mark.django_db
def test_the_sql_agrees_with_the_gateway(key):
    at = datetime(2026, 11, 1, tzinfo=UTC)
    records = []
    for prompt, completion, cached, outcome, inferences in CASES:
        cost = QUOTE.charge(
            prompt=prompt, completion=completion, cached=cached, cache_hit=outcome != "miss", inferences=inferences
        )
        records.append(
            make_record(key, at=at, prompt=prompt, completion=completion, cached=cached, cache=outcome, cost=cost,
                        inferences=inferences)
        )  # fmt: skip
    table = UsageRecord._meta.db_table
    charged = charged_tokens_sql("u")
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT u.id, {charged['input']}, {charged['output']}, {charged['cached']}, {charged['inferences']},"
            f" {charged['cached_inferences']}, {saved_sql('u', 'p')} FROM {table} u CROSS JOIN (SELECT"
            " %s::numeric AS input_per_million, %s::numeric AS output_per_million,"
            " %s::numeric AS per_thousand_inferences) p WHERE u.id = ANY(%s)",
            [
                QUOTE.input_per_million,
                QUOTE.output_per_million,
                QUOTE.per_thousand_inferences,
                [r.pk for r in records],
            ],
        )
        by_id = {row[0]: row[1:] for row in cursor.fetchall()}
    for record, (prompt, completion, cached, outcome, inferences) in zip(records, CASES, strict=True):
        hit = outcome != "miss"
        tokens = ChargedTokens.of(
            prompt=prompt, completion=completion, cached=cached, cache_hit=hit, inferences=inferences
        )
        input_, output, cached_sql, inferences_sql, cached_inferences_sql, saved = by_id[record.pk]
        assert (input_, output, cached_sql, inferences_sql, cached_inferences_sql) == (
            tokens.input, tokens.output, tokens.cached, tokens.inferences, tokens.cached_inferences
        ), (prompt, cached, outcome, inferences)  # fmt: skip
        expected_saved = (
            QUOTE.saved(prompt=prompt, completion=completion, charged=record.cost, inferences=inferences) if hit else 0
        )
        assert Decimal(saved) == expected_saved
