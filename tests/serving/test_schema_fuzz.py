"""schemathesis over the whole OpenAPI schema (management API and data plane) against a real
gateway and a fake engine, as a platform admin, an org admin and an API key.

Each identity runs the coverage and fuzzing phases over every operation; the run must find
no server error, no answer that breaks the schema, and no status code the schema does not
document. Every object a path names (organisation, key, member, invoice, deployment,
replica, model) is pinned to this test's own, so the platform admin's writes cannot reach
another test's rows; bodies naming a model mostly name this test's fake models, so valid
requests reach the engine.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway import committed, register_fake_replica, start_fake_engine
from tests.support.processes import Gateway, start_gateway

pytestmark = pytest.mark.django_db

PASSWORD = "fuzz-password-1"
# Cases per operation in the fuzzing phase; the coverage phase adds its own, one per
# boundary and per kind of invalid value. Together about a minute per identity.
MAX_EXAMPLES = 5
SEED = 18
# A request that never answers is a finding, not a reason to wait.
REQUEST_TIMEOUT = 20
# Checks that judge the API by its schema. positive_data_acceptance is left out: a request
# the schema allows may still break a business rule (an unknown model, an org admin above
# the plan), which is a 4xx by design.
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "missing_required_header",
    "unsupported_method",
    "ignored_auth",
)
# Every /api/ path but the data plane's /api/v1 aliases.
MANAGEMENT_PATHS = r"^/api/(?!v1/(chat/|completions|embeddings|usage))"


@dataclass
class FuzzWorld:
    chat_model: str
    embedding_model: str
    engine: str
    platform_admin: str
    org_admin: str
    api_key: str
    organization_id: int
    victim_key_id: int
    victim_membership_id: int
    invoice_id: int
    invitation_id: int
    deployment_id: int
    replica_id: int


@pytest.fixture(scope="module")
def fuzz_gateway(django_db_setup, tmp_path_factory) -> Iterator[Gateway]:
    """A gateway like fault_gateway (fake replicas' heartbeats never age) whose sign-in lockout
    never trips: schemathesis checks that wrong HTTP Basic credentials are refused, once per
    operation, and a locked address would answer 429 to the right ones too. The failures it
    counted are cleared afterwards, so no later test finds 127.0.0.1 locked."""
    from core import keys
    from core.redis import sync_redis

    gateway = start_gateway(
        tmp_path_factory.mktemp("fuzz-gateway"),
        REPLICA_STALE_AFTER="86400",
        ROUTING_REFRESH_SECONDS="0.2",
        ENGINE_FIRST_TOKEN_TIMEOUT="5",
        ENGINE_REQUEST_TIMEOUT="15",
        LOGIN_MAX_FAILURES="1000000",
    )
    yield gateway
    gateway.stop()
    client = sync_redis()
    for key in client.scan_iter(match=keys.namespaced("login", "failures", "*")):
        client.delete(key)


@pytest.fixture(scope="module")
def fuzz_world(django_db_setup, django_db_blocker) -> Iterator[FuzzWorld]:
    """Users with passwords, an organisation with keys, a member, an invoice and an invitation,
    and two fake models (chat, embeddings) on one fake engine, all committed."""
    process, endpoint = start_fake_engine()
    tag = uuid.uuid4().hex[:8]

    def make() -> FuzzWorld:
        from django.contrib.auth import get_user_model
        from django.utils import timezone

        from accounts.models import Role
        from accounts.services import api_key_create, invitation_create, membership_set, organization_create
        from billing.invoicing import parse_period
        from billing.services import invoice_draft
        from registry.models import Replica

        users = get_user_model().objects
        ml = users.create_user(f"fuzz-ml-{tag}", password=PASSWORD)
        admin = users.create_user(f"fuzz-admin-{tag}", password=PASSWORD)
        member = users.create_user(f"fuzz-member-{tag}")
        membership_set(user=ml, organization=organization_create(name=f"Fuzz platform {tag}"), role=Role.PLATFORM_ADMIN)
        org = organization_create(name=f"Fuzz tenant {tag}")
        membership_set(user=admin, organization=org, role=Role.ORG_ADMIN)
        victim_membership = membership_set(user=member, organization=org, role=Role.ORG_MEMBER)
        issued = api_key_create(organization=org, name="fuzz", rate_limit_rpm=100_000, rate_limit_tpm=10**9)
        victim = api_key_create(organization=org, name="victim").api_key
        elsewhere = organization_create(name=f"Fuzz elsewhere {tag}")
        invitation = invitation_create(organization=elsewhere, username=admin.username)
        last_month = timezone.now().date().replace(day=1) - timedelta(days=1)
        invoice = invoice_draft(organization=org, period=parse_period(last_month.strftime("%Y-%m")))
        chat_model, embedding_model = f"fuzz-chat-{tag}", f"fuzz-embed-{tag}"
        replica_id = register_fake_replica(chat_model, endpoint)
        register_fake_replica(embedding_model, endpoint, task="embedding")
        return FuzzWorld(
            chat_model=chat_model,
            embedding_model=embedding_model,
            engine=endpoint,
            platform_admin=ml.username,
            org_admin=admin.username,
            api_key=issued.secret,
            organization_id=org.pk,
            victim_key_id=victim.pk,
            victim_membership_id=victim_membership.pk,
            invoice_id=invoice.pk,
            invitation_id=invitation.pk,
            deployment_id=Replica.objects.get(pk=replica_id).deployment_id,
            replica_id=replica_id,
        )

    try:
        yield committed(django_db_blocker, make)
    finally:
        process.kill()
        process.wait(5)


def schemathesis_config(world: FuzzWorld) -> str:
    """schemathesis.toml: path parameters pinned to the world's objects, model names drawn
    mostly from the world's models."""
    pinned = {
        r"^/api/invitations/\{id\}/": world.invitation_id,
        r"^/api/orgs/\{id\}/$": world.organization_id,
        r"^/api/orgs/\{org_pk\}/invoices/\{id\}/": world.invoice_id,
        r"^/api/orgs/\{org_pk\}/keys/\{id\}/": world.victim_key_id,
        r"^/api/orgs/\{org_pk\}/members/\{id\}/": world.victim_membership_id,
        r"^/api/v1/deployments/\{id\}/": world.deployment_id,
        r"^/api/v1/replicas/\{id\}/": world.replica_id,
    }
    models = json.dumps([world.chat_model, world.embedding_model])
    lines = [
        f"[dictionaries.models]\nvalues = {models}\n",
        f"[dictionaries.organizations]\nvalues = [{world.organization_id}]\n",
        "[parameters]",
        f'"path.org_pk" = {world.organization_id}',
        '"path.name" = { dictionary = "models", probability = 0.9 }',
        '"path.model" = { dictionary = "models", probability = 0.9 }',
        '"body.model" = { dictionary = "models", probability = 0.8 }',
        '"body.organization" = { dictionary = "organizations", probability = 1.0 }',
        "",
        "[checks]\nenabled = false",
        *(f"{check}.enabled = true" for check in CHECKS),
        "",
        # No values from earlier answers: a platform admin's body could name another test's
        # model version (deploying it) where only this test's objects may be touched.
        "[phases.coverage.extra-data-sources]\nresponses = false\n",
        "[phases.fuzzing.extra-data-sources]\nresponses = false\n",
        # Error feedback learns "name is required" from PUT /api/orgs/{id}/ and applies it to
        # PATCH on the same path, whose body has no required field (a false rejection finding).
        "[phases.fuzzing.error-feedback]\nenabled = false\n",
    ]
    for regex, pk in pinned.items():
        lines += ["[[operations]]", f"include-path-regex = '{regex}'", f'parameters = {{ "path.id" = {pk} }}', ""]
    # The management API is DRF, whose fields take what the schema's types do not say: a
    # number for a string ("name": 0 is "0"), "" for a nullable decimal (null). Those readings
    # are DRF's, not defects, so only the data plane (strict pydantic) is held to rejecting
    # every schema-violating request.
    lines += [
        "[[operations]]",
        f"include-path-regex = '{MANAGEMENT_PATHS}'",
        "checks.negative_data_rejection.enabled = false",
        "",
    ]
    return "\n".join(lines)


def run_schemathesis(gateway: Gateway, world: FuzzWorld, identity: str, workdir: Path) -> SchemathesisRun:
    """One identity over the whole schema, in schemathesis's own process (its CLI, which runs
    the phases; the NDJSON report is what the test reads)."""
    config = workdir / f"{identity}.toml"
    config.write_text(schemathesis_config(world))
    report = workdir / f"{identity}.ndjson"
    if identity == "api-key":
        auth = ["-H", f"Authorization: Bearer {world.api_key}"]
    else:
        user = world.platform_admin if identity == "platform-admin" else world.org_admin
        auth = ["--auth", f"{user}:{PASSWORD}"]
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color", "run",
        f"{gateway.base_url}/api/schema/?format=json", "--url", gateway.base_url,
        "--phases", "coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
        "--generation-database", "none", "--request-timeout", str(REQUEST_TIMEOUT),
        # One worker: Hypothesis parsing lambdas in two threads at once trips a CPython 3.11
        # bug ("AST constructor recursion depth mismatch"), reported as a schemathesis error.
        "--workers", "1", "--continue-on-failure", "--warnings", "off",
        "--report", "ndjson", "--report-ndjson-path", str(report), *auth,
    ]  # fmt: skip
    started = time.monotonic()
    # Its own folder: schemathesis and Hypothesis leave caches in the working directory.
    result = subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_COLOR": "1"}
    )
    return SchemathesisRun(
        identity=identity,
        returncode=result.returncode,
        output=result.stdout + result.stderr,
        seconds=time.monotonic() - started,
        findings=findings(report) if report.exists() else [],
    )


@dataclass
class SchemathesisRun:
    identity: str
    returncode: int
    output: str
    seconds: float
    findings: list[str]

    def summary(self) -> str:
        if self.findings:
            return f"{self.identity}: {len(self.findings)} finding(s)\n" + "\n".join(self.findings)
        # A non-zero exit with no finding: the run itself failed (schema not loaded, an error).
        return f"{self.identity}: schemathesis exited {self.returncode}\n{self.output[-4000:]}"


def _text(payload: Any) -> str:
    if isinstance(payload, dict) and "$base64" in payload:
        return base64.b64decode(payload["$base64"]).decode(errors="replace")
    return "" if payload is None else str(payload)


def findings(report: Path) -> list[str]:
    """Each distinct failure in an NDJSON report: the check, the operation, the request and the answer."""
    seen: dict[tuple[str, str, str], str] = {}
    for line in report.read_text().splitlines():
        finished = json.loads(line).get("ScenarioFinished")
        if not finished:
            continue
        recorder = finished["recorder"]
        for case_id, checks in recorder["checks"].items():
            for check in checks:
                if check["status"] != "failure":
                    continue
                failure = check["failure_info"]["failure"]
                message = failure["message"].strip()
                key = (failure["code"], recorder["label"], message.splitlines()[0] if message else "")
                if key in seen:
                    continue
                interaction = recorder["interactions"].get(case_id) or {}
                request, response = interaction.get("request") or {}, interaction.get("response") or {}
                seen[key] = (
                    f"- {failure['code']} {failure['title']} on {recorder['label']}\n"
                    f"    {request.get('method')} {request.get('uri')} {_text(request.get('body'))[:300]}\n"
                    f"    -> {response.get('status_code')} {_text(response.get('content'))[:300]}\n"
                    + "".join(f"    {line}\n" for line in message.splitlines()[:8])
                )
    return list(seen.values())


class TestTheSchema:
    """What the fuzzing relies on, checked in a moment without a gateway."""

    @pytest.fixture
    def schema(self, client) -> dict[str, Any]:
        return client.get("/api/schema/", {"format": "json"}).json()

    def test_it_describes_the_data_plane(self, schema):
        paths = schema["paths"]
        for prefix in ("/v1/", "/api/v1/"):
            for path, body in (("chat/completions", "ChatCompletionRequest"), ("completions", "CompletionRequest"),
                               ("embeddings", "EmbeddingRequest")):  # fmt: skip
                post = paths[prefix + path]["post"]
                assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + body)
                assert post["security"] == [{"bearerAuth": []}]
                statuses = {400, 401, 403, 404, 405, 413, 429, 502, 503, 504}
                assert statuses | {200} == {int(s) for s in post["responses"]}
                error = post["responses"]["429"]["content"]["application/json"]["schema"]
                assert error == {"$ref": "#/components/schemas/OpenAIError"}
            assert "get" in paths[prefix + "usage"]
        assert "text/event-stream" in paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
        assert {"get"} == set(paths["/v1/models"]) == set(paths["/v1/models/{model}"])
        chat = schema["components"]["schemas"]["ChatCompletionRequest"]
        assert {"model", "messages"} <= set(chat["required"])
        assert chat["additionalProperties"] is False
        assert chat["properties"]["temperature"]["nullable"] is True  # OpenAPI 3.0's null, not JSON Schema's
        assert schema["components"]["securitySchemes"]["bearerAuth"] == {
            "type": "http", "scheme": "bearer", "description": "an API key: `Authorization: Bearer sk-…`",
        }  # fmt: skip

    def test_every_data_plane_route_is_in_it(self, schema):
        import re

        from serving.urls import urlpatterns

        for pattern in urlpatterns:
            path = "/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(pattern.pattern))
            assert path in schema["paths"], path
        infer = schema["paths"]["/v2/models/{model}/versions/{version}/infer"]["post"]
        assert set(infer["requestBody"]["content"]) == {"application/json", "application/octet-stream"}
        refused = infer["responses"]["400"]["content"]["application/json"]["schema"]
        assert {"$ref": "#/components/schemas/ProtocolError"} in refused["oneOf"]  # the protocol's error body
        assert schema["paths"]["/v2/health/ready"]["get"]["security"] == []  # no key, as KServe's probes
        predict = schema["paths"]["/api/v1/predict"]["post"]
        assert predict["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/PredictRequest")
        assert set(schema["components"]["schemas"]["PredictAnswer"]["required"]) >= {"prediction", "confidence"}

    def test_fields_that_can_be_null_say_so(self, schema):
        components = schema["components"]["schemas"]
        assert components["ApiKey"]["properties"]["rotated_to"]["nullable"] is True
        assert components["CanaryDecision"]["properties"]["actor"]["nullable"] is True
        assert components["Canary"]["properties"]["created_by"]["nullable"] is True

    def test_every_management_operation_documents_its_refusals(self, schema):
        for path, item in schema["paths"].items():
            for method, operation in item.items():
                if "inference" in operation.get("tags", []):
                    continue
                assert {"basicAuth": []} in operation["security"], (method, path)
                assert {"403", "429"} <= set(operation["responses"]), (method, path)
                if "{" in path:
                    assert "404" in operation["responses"], (method, path)
                if "requestBody" in operation:
                    assert "400" in operation["responses"], (method, path)
                    assert set(operation["requestBody"]["content"]) == {"application/json"}


# The API key first: the admins' writes (the organisation's limits, its keys) come after it.
IDENTITIES = ("api-key", "org-admin", "platform-admin")


@pytest.mark.parametrize("identity", IDENTITIES)
def test_the_schema_holds_for(identity, fuzz_gateway, fuzz_world, tmp_path):
    """No server error, no answer outside the schema, no undocumented status, no invalid
    data-plane request accepted."""
    engine_before = engine_requests(fuzz_world)
    run = run_schemathesis(fuzz_gateway, fuzz_world, identity, tmp_path)
    print(f"schemathesis as {identity}: {run.seconds:.1f} s")
    assert not run.findings, run.summary()
    assert run.returncode == 0, run.summary()
    if identity == "api-key":
        # Valid requests got through to the engine: the data plane was fuzzed past validation.
        assert engine_requests(fuzz_world) > engine_before


def engine_requests(world: FuzzWorld) -> int:
    return int(httpx.get(f"{world.engine}/_stats", timeout=5).json()["requests"])
