"""Usage records and the money: prices, rollups, invoices, budget alerts and reconciliation
(organisations, keys and plans are ``accounts``')."""

from __future__ import annotations

import uuid
from decimal import Decimal

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from accounts.models import MONEY_DECIMAL_PLACES, MONEY_MAX_DIGITS, ApiKey, Organization

# Money is Decimal: prices per million tokens with 6 decimals, a request's cost exact,
# invoice amounts in cents (billing.invoicing rounds once per line).
PRICE_MAX_DIGITS, PRICE_DECIMAL_PLACES = 18, 6  # per million tokens
EXACT_MAX_DIGITS, EXACT_DECIMAL_PLACES = 28, 12  # a request's cost, and sums of them


class CacheOutcome(models.TextChoices):
    """How a request was answered: by an engine, or from the cache (exact or semantic)."""

    MISS = "miss", "Engine"
    HIT = "hit", "Exact cache hit"
    SEMANTIC_HIT = "semantic-hit", "Semantic cache hit"


class UsageRecord(models.Model):
    """What one admitted request consumed. ``request_id`` is unique: one record per request.

    A request answered from the cache has ``cache`` set: its prompt tokens are all cached
    tokens, and all of its tokens are priced at the cached input price.
    """

    request_id = models.UUIDField(unique=True, default=uuid.uuid4)
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="usage_records")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="usage_records")
    model = models.CharField(max_length=255)
    model_version = models.CharField(max_length=50)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    total_tokens = models.PositiveIntegerField(default=0)
    latency_ms = models.PositiveIntegerField(default=0)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    status_code = models.PositiveSmallIntegerField()
    created_at = models.DateTimeField(help_text="when the request was admitted (UTC)")
    cache = models.CharField(max_length=12, choices=CacheOutcome.choices, default=CacheOutcome.MISS)
    # A hit's tier and entry (serving.semcache): what the request log shows and feedback names.
    cache_tier = models.CharField(
        max_length=12, blank=True, default="", db_default="",
        help_text="a cache hit's tier: exact, same, typo, reordered or paraphrase",
    )  # fmt: skip
    cache_entry = models.BigIntegerField(null=True, blank=True, help_text="the cache entry a hit was served from")
    # The engine's own words, not choices: engines add reasons ("abort", "tool_calls", ...).
    finish_reason = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="why generation stopped (stop, length, ...); with several choices, length if any was cut, "
        "else the first choice's; empty: unknown or not applicable (embeddings, failed before an answer)",
    )
    error_code = models.CharField(
        max_length=40,
        blank=True,
        default="",
        help_text="why it failed, as its client was told (engine_unavailable, engine_timeout, the engine's own "
        "code, client_closed, ...); empty for a success",
    )
    revision = models.PositiveSmallIntegerField(
        default=0, help_text="1 when the gateway's own settlement corrected the sweeper's (billing.ledger)"
    )
    batch = models.BooleanField(default=False, help_text="a line of a batch job, at the batch price")
    inferences = models.PositiveIntegerField(
        default=0, help_text="items a predict request carried (its batch size); 0 for a token model's request"
    )
    # What it cost: at the price in effect when it was admitted, exact (no rounding here;
    # invoices round once per line). Null price: the model had no price (cost 0).
    price = models.ForeignKey("Price", null=True, blank=True, on_delete=models.PROTECT, related_name="usage_records")
    cost = models.DecimalField(max_digits=24, decimal_places=EXACT_DECIMAL_PLACES, default=Decimal(0))
    # The invoice that bills it; records of a finalized period that arrive later keep this
    # empty until the next invoice takes them as an adjustment.
    invoice = models.ForeignKey(
        "Invoice", null=True, blank=True, on_delete=models.PROTECT, related_name="usage_records"
    )

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["api_key", "created_at"], name="usage_key_time"),
            models.Index(fields=["model", "created_at"], name="usage_model_time"),
            models.Index(fields=["organization", "created_at"], name="usage_org_time"),
            # Rollups and reconciliation read a time range across every key.
            models.Index(fields=["created_at"], name="usage_time"),
            models.Index(fields=["organization", "invoice", "created_at"], name="usage_org_uninvoiced"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.total_tokens} tokens"

    @property
    def input_tokens(self) -> int:
        """Prompt tokens that were not served from a cache (priced as input)."""
        return self.prompt_tokens - self.cached_tokens


class FailedAttempt(models.Model):
    """An engine attempt that failed before its request's first byte reached the client, and
    was retried on another replica or version (``serving.llm.call``, the fallback).

    Never billed, limited or invoiced: the request is metered once, as the attempt that
    answered. But the version that failed is judged by it (``rollout.served_requests``), so
    a failing canary is rolled back as fast as if its customers had seen the errors.
    """

    request_id = models.UUIDField(unique=True, help_text="the request it was an attempt of")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="+")
    model = models.CharField(max_length=255)
    model_version = models.CharField(max_length=50, help_text="the version that failed")
    endpoint = models.CharField(max_length=20, blank=True, default="")
    status_code = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=40, blank=True, default="")
    latency_ms = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(help_text="when the request was admitted (UTC)")

    class Meta:
        indexes = [models.Index(fields=["model", "model_version", "created_at"], name="attempt_version_time")]

    def __str__(self) -> str:
        return f"{self.model}:{self.model_version} {self.status_code} ({self.request_id})"


class BudgetAlert(models.Model):
    """A budget crossed one of its alert thresholds (50, 80, 100 % and the scope's own
    ``budget_alert_percent``): once per scope, budget, UTC month and threshold."""

    class Budget(models.TextChoices):
        TOKENS = "tokens", "Token quota"
        SPEND = "spend", "Spend cap"

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="budget_alerts")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="budget_alerts")
    budget = models.CharField(max_length=8, choices=Budget.choices)
    month = models.CharField(max_length=7, help_text="YYYY-MM, UTC")
    threshold_percent = models.PositiveSmallIntegerField()
    # Wide enough for any value a quota (a 64-bit integer: 19 digits) or a spend cap can
    # take, and for "used", which may pass the limit by a request's reservation.
    limit = models.DecimalField(max_digits=32, decimal_places=6)
    used = models.DecimalField(max_digits=32, decimal_places=6, help_text="used + reserved when crossed")
    created_at = models.DateTimeField(auto_now_add=True)
    notified_at = models.DateTimeField(null=True, blank=True, help_text="when the email went out")

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "api_key", "budget", "month", "threshold_percent"],
                name="uniq_budget_alert_threshold",
                nulls_distinct=False,
            )
        ]

    def __str__(self) -> str:
        scope = f"key {self.api_key_id}" if self.api_key_id else f"org {self.organization_id}"
        return f"{scope} {self.budget} {self.month} at {self.threshold_percent}%"


# --- Money ------------------------------------------------------------------------------
# Amounts are Decimal end to end. Prices are per million tokens with 6 decimals; a
# request's cost is exact (12 decimals); an invoice line is rounded once, half up, to the
# currency's cents (billing.invoicing documents the rule).


class Price(models.Model):
    """A model's (or one version's) price per million tokens, effective over a period.

    Periods of one model and version never overlap (``billing.services.price_set`` closes
    the current one); the price of a request is the one in effect when it was admitted:
    a version's own price first, else the model's.
    """

    model = models.ForeignKey("registry.Model", on_delete=models.PROTECT, related_name="prices")
    version = models.ForeignKey(
        "registry.ModelVersion",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="prices",
        help_text="empty: every version of the model without a price of its own",
    )
    input_per_million = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS, decimal_places=PRICE_DECIMAL_PLACES, validators=[MinValueValidator(Decimal(0))]
    )
    output_per_million = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS, decimal_places=PRICE_DECIMAL_PLACES, validators=[MinValueValidator(Decimal(0))]
    )
    cached_input_per_million = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS, decimal_places=PRICE_DECIMAL_PLACES, validators=[MinValueValidator(Decimal(0))]
    )
    # Small models are priced by the item (an image, a row, a sentence), not the token.
    per_thousand_inferences = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
    )
    cached_per_thousand_inferences = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
        default=Decimal(0),
        validators=[MinValueValidator(Decimal(0))],
        help_text="for inferences answered from the exact result cache",
    )
    batch_percent = models.DecimalField(
        max_digits=5,
        decimal_places=2,
        default=Decimal(50),
        validators=[MinValueValidator(Decimal(0)), MaxValueValidator(Decimal(100))],
        help_text="what a batch job's request pays, in percent of each of these prices",
    )
    currency = models.CharField(max_length=3, help_text="ISO 4217, the platform's billing currency")
    effective_from = models.DateTimeField()
    effective_to = models.DateTimeField(null=True, blank=True, help_text="empty: until further notice")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_id", "version_id", "-effective_from"]
        indexes = [models.Index(fields=["model", "version", "effective_from"], name="price_lookup")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(effective_to__isnull=True) | models.Q(effective_to__gt=models.F("effective_from")),
                name="price_period_not_empty",
            ),
            models.CheckConstraint(
                condition=models.Q(
                    input_per_million__gte=0, output_per_million__gte=0, cached_input_per_million__gte=0
                ),
                name="price_not_negative",
            ),
        ]

    def __str__(self) -> str:
        scope = f"{self.model}:{self.version.version}" if self.version is not None else str(self.model)
        return f"{scope} {self.input_per_million}/{self.output_per_million} {self.currency} per 1M"


class UsageRollup(models.Model):
    """Usage aggregated per hour or per UTC day and per key, model, version and price.

    Built by ``billing.tasks`` from UsageRecord rows, safe to rebuild (a period's rows are
    recomputed whole); pages and the usage APIs read these, never raw records.
    """

    class Period(models.TextChoices):
        HOUR = "hour", "Hour"
        DAY = "day", "Day"

    period = models.CharField(max_length=4, choices=Period.choices)
    start = models.DateTimeField(help_text="UTC start of the hour or day")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="rollups")
    api_key = models.ForeignKey(ApiKey, on_delete=models.PROTECT, related_name="rollups")
    model = models.CharField(max_length=255)
    model_version = models.CharField(max_length=50)
    price = models.ForeignKey(Price, null=True, blank=True, on_delete=models.PROTECT, related_name="rollups")
    batch = models.BooleanField(default=False, help_text="batch jobs' lines (at the batch price)")
    requests = models.PositiveBigIntegerField(default=0)
    # billing.outcomes: a client's cancel is not an error; it is counted on its own.
    errors = models.PositiveBigIntegerField(
        default=0, help_text="requests whose status was not 2xx, but for those their clients cancelled"
    )
    cancelled = models.PositiveBigIntegerField(
        default=0, help_text="requests their clients cancelled (status 499): in requests, not in errors"
    )
    input_tokens = models.PositiveBigIntegerField(default=0, help_text="prompt tokens not served from a cache")
    output_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    inferences = models.PositiveBigIntegerField(default=0, help_text="items of predict requests (small models)")
    cost = models.DecimalField(max_digits=EXACT_MAX_DIGITS, decimal_places=EXACT_DECIMAL_PLACES, default=Decimal(0))
    cache_hits = models.PositiveBigIntegerField(default=0, help_text="requests answered from the cache")
    saved = models.DecimalField(
        max_digits=EXACT_MAX_DIGITS,
        decimal_places=EXACT_DECIMAL_PLACES,
        default=Decimal(0),
        help_text="what the cache hits would have cost from an engine, less what they cost",
    )
    latency_p50_ms = models.PositiveIntegerField(null=True, blank=True)
    latency_p95_ms = models.PositiveIntegerField(null=True, blank=True)
    latency_p99_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_p50_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_p95_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_p99_ms = models.PositiveIntegerField(null=True, blank=True)
    # The distributions, mergeable across rows (core.sketch: {log bucket: requests}, 1 %
    # relative error): the percentiles of any grouping come from these, not from the above.
    latency_histogram = models.JSONField(default=dict, blank=True)
    ttft_histogram = models.JSONField(default=dict, blank=True, help_text="requests that produced a token")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-start"]
        constraints = [
            models.UniqueConstraint(
                fields=["period", "start", "api_key", "model", "model_version", "price", "batch"],
                name="uniq_rollup_bucket",
                nulls_distinct=False,
            )
        ]
        indexes = [
            models.Index(fields=["organization", "period", "start"], name="rollup_org_time"),
            models.Index(fields=["api_key", "period", "start"], name="rollup_key_time"),
            models.Index(fields=["period", "start"], name="rollup_time"),
        ]

    def __str__(self) -> str:
        return f"{self.period} {self.start:%Y-%m-%d %H:00} key {self.api_key_id} {self.model}:{self.model_version}"


class RollupProgress(models.Model):
    """How far the rollup job has read UsageRecord ids, so each run rebuilds only the
    periods that received records since (late records included)."""

    name = models.CharField(max_length=50, unique=True)
    last_record_id = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name}: up to record {self.last_record_id}"


class Invoice(models.Model):
    """An organisation's invoice for one UTC calendar month.

    Moves only through ``billing.services`` (guarded transitions, row locked): draft →
    finalized → paid, and draft or finalized → void. A finalized invoice never changes;
    a correction is a void and a reissue. Numbers are sequential without gaps: taken
    from ``InvoiceSequence`` under a row lock when the invoice is drafted.
    """

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        FINALIZED = "finalized", "Finalized"
        PAID = "paid", "Paid"
        VOID = "void", "Void"

    TRANSITIONS: dict[str, frozenset[str]] = {
        Status.DRAFT: frozenset({Status.FINALIZED, Status.VOID}),
        Status.FINALIZED: frozenset({Status.PAID, Status.VOID}),
        Status.PAID: frozenset(),
        Status.VOID: frozenset(),
    }

    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="invoices")
    period = models.DateField(help_text="the first day of the billed UTC month")
    number = models.PositiveBigIntegerField(unique=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    currency = models.CharField(max_length=3)
    subtotal = models.DecimalField(max_digits=MONEY_MAX_DIGITS, decimal_places=MONEY_DECIMAL_PLACES, default=Decimal(0))
    credit = models.DecimalField(
        max_digits=MONEY_MAX_DIGITS,
        decimal_places=MONEY_DECIMAL_PLACES,
        default=Decimal(0),
        help_text="the plan's included usage, taken off",
    )
    tax_rate = models.DecimalField(max_digits=5, decimal_places=4, default=Decimal(0))
    tax = models.DecimalField(max_digits=MONEY_MAX_DIGITS, decimal_places=MONEY_DECIMAL_PLACES, default=Decimal(0))
    total = models.DecimalField(max_digits=MONEY_MAX_DIGITS, decimal_places=MONEY_DECIMAL_PLACES, default=Decimal(0))
    reissue_of = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="reissued_as"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finalized_at = models.DateTimeField(null=True, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    voided_at = models.DateTimeField(null=True, blank=True)
    void_reason = models.CharField(max_length=500, blank=True)
    # Who it was issued to, as it was when finalized (a finalized invoice never changes, even
    # when the organisation is renamed or moves its billing address later); empty on a draft.
    billed_name = models.CharField(max_length=255, blank=True)
    billed_email = models.EmailField(blank=True)

    class Meta:
        ordering = ["-period", "-number"]
        constraints = [
            # One live invoice per organisation and month; void ones stay beside their reissue.
            models.UniqueConstraint(
                fields=["organization", "period"], condition=~models.Q(status="void"), name="one_live_invoice_per_month"
            ),
            models.CheckConstraint(condition=models.Q(period__day=1), name="invoice_period_is_a_month"),
        ]

    def __str__(self) -> str:
        return f"#{self.number} {self.organization} {self.period:%Y-%m} ({self.status})"

    @property
    def bill_to(self) -> tuple[str, str]:
        """The organisation's name and billing email as the invoice shows them: frozen at
        finalization, the organisation's current ones on a draft."""
        if self.finalized_at is not None:
            return self.billed_name, self.billed_email
        return self.organization.name, self.organization.billing_email

    @property
    def tax_percent(self) -> str:
        """The tax rate as people read it: ``0.0750`` → ``"7.5"``."""
        text = f"{self.tax_rate * 100:f}"
        return text.rstrip("0").rstrip(".") if "." in text else text


class InvoiceLine(models.Model):
    """One line: a model's tokens of one kind at one price for the month (or, for
    ``adjustment``, usage of an earlier month that arrived after it was invoiced)."""

    class Kind(models.TextChoices):
        USAGE = "usage", "Usage"
        ADJUSTMENT = "adjustment", "Late usage of an earlier month"
        CREDIT = "credit", "Included credit"

    class TokenKind(models.TextChoices):
        INPUT = "input", "Input tokens"
        OUTPUT = "output", "Output tokens"
        CACHED = "cached", "Cached input tokens"
        INFERENCES = "inferences", "Inferences"
        CACHED_INFERENCES = "cached_inferences", "Cached inferences"

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    kind = models.CharField(max_length=10, choices=Kind.choices, default=Kind.USAGE)
    model = models.CharField(max_length=255, blank=True)
    token_kind = models.CharField(max_length=20, choices=TokenKind.choices, blank=True)
    usage_period = models.DateField(null=True, blank=True, help_text="the month the usage belongs to")
    batch = models.BooleanField(default=False, help_text="batch jobs' usage, at the price's batch percent")
    price = models.ForeignKey(Price, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    quantity = models.PositiveBigIntegerField(default=0, help_text="tokens")
    unit_price = models.DecimalField(
        max_digits=PRICE_MAX_DIGITS,
        decimal_places=PRICE_DECIMAL_PLACES,
        default=Decimal(0),
        help_text="per million tokens",
    )
    amount = models.DecimalField(
        max_digits=MONEY_MAX_DIGITS, decimal_places=MONEY_DECIMAL_PLACES, help_text="rounded once, half up, to cents"
    )
    description = models.CharField(max_length=255)

    class Meta:
        ordering = ["invoice_id", "id"]

    def __str__(self) -> str:
        return f"{self.description}: {self.amount}"


class InvoiceSequence(models.Model):
    """The next invoice number, taken under a row lock so numbers have no gaps."""

    name = models.CharField(max_length=20, unique=True, default="invoices")
    next_number = models.PositiveBigIntegerField(default=1)

    def __str__(self) -> str:
        return f"{self.name}: next #{self.next_number}"


class Reconciliation(models.Model):
    """One check of a period: metered events (Redis counters) = usage records = rollups, and
    invoice totals = priced rollups. Every delta must be zero; anything else is flagged."""

    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    stream_events = models.PositiveBigIntegerField(help_text="usage events the ledger wrote")
    records = models.PositiveBigIntegerField(help_text="UsageRecord rows")
    rollup_requests = models.PositiveBigIntegerField(help_text="requests in the hourly rollups")
    records_cost = models.DecimalField(max_digits=EXACT_MAX_DIGITS, decimal_places=EXACT_DECIMAL_PLACES)
    rollup_cost = models.DecimalField(max_digits=EXACT_MAX_DIGITS, decimal_places=EXACT_DECIMAL_PLACES)
    invoiced = models.DecimalField(
        max_digits=MONEY_MAX_DIGITS,
        decimal_places=MONEY_DECIMAL_PLACES,
        null=True,
        blank=True,
        help_text="usage lines of the invoices",
    )
    priced = models.DecimalField(
        max_digits=MONEY_MAX_DIGITS,
        decimal_places=MONEY_DECIMAL_PLACES,
        null=True,
        blank=True,
        help_text="the same, priced from rollups",
    )
    ok = models.BooleanField()
    details = models.JSONField(default=dict, blank=True, help_text="each difference, by key and model")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        return f"{self.period_start:%Y-%m-%d %H:%M} to {self.period_end:%Y-%m-%d %H:%M} {verdict}"
