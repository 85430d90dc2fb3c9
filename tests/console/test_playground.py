"""The playground and the quickstart pages (who may open them, what they offer), the member's
playground key, and the WebSocket API's signed-in-session path (against a real daphne)."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from websockets.sync.client import connect

from accounts.models import ApiKey, Membership, Organization, Role, Tier
from accounts.services import (
    api_key_create,
    api_key_hash,
    api_key_revoke,
    organization_create,
    playground_key_get_or_create,
    playground_key_hash,
)
from registry.models import Model
from serving.models import CachePolicy
from tests.support.browser import PASSWORD
from tests.support.gateway import committed, register_fake_replica

CHAT = "smollm2-135m-instruct"


def user(name: str, *, org: Organization | None = None, role: str = Role.ORG_MEMBER) -> Any:
    made = get_user_model().objects.create_user(username=name, password=PASSWORD)
    if org is not None:
        Membership.objects.create(user=made, organization=org, role=role)
    return made


def signed_in(who: Any) -> Client:
    client = Client()
    client.force_login(who)
    return client


@pytest.fixture
def served(db: None) -> dict[str, str]:
    """A chat model with two served versions (2 takes no unpinned traffic) and an embedding model."""
    tag = uuid.uuid4().hex[:6]
    chat, embedding = f"chat-{tag}", f"embed-{tag}"
    register_fake_replica(chat, "http://127.0.0.1:9", version="1")
    register_fake_replica(chat, "http://127.0.0.1:9", version="2", weight=0)
    register_fake_replica(embedding, "http://127.0.0.1:9", task="embedding")
    return {"chat": chat, "embedding": embedding}


@pytest.mark.django_db
class TestWhoMayOpen:
    @pytest.mark.parametrize("page", ["playground", "quickstart"])
    def test_anonymous_visitors_are_sent_to_log_in(self, alice_org, page):
        response = Client().get(f"/portal/{alice_org.pk}/{page}/")
        assert response.status_code == 302
        assert response["Location"].startswith("/accounts/login/")

    @pytest.mark.parametrize("page", ["playground", "quickstart"])
    def test_another_organisations_member_gets_404(self, alice_org, bob_org, page):
        response = signed_in(user("bob", org=bob_org)).get(f"/portal/{alice_org.pk}/{page}/")
        assert response.status_code == 404

    @pytest.mark.parametrize("role", [Role.ORG_MEMBER, Role.ORG_ADMIN])
    @pytest.mark.parametrize("page", ["playground", "quickstart"])
    def test_members_and_admins_open_them(self, alice_org, page, role):
        response = signed_in(user("ann", org=alice_org, role=role)).get(f"/portal/{alice_org.pk}/{page}/")
        assert response.status_code == 200

    def test_a_platform_admin_opens_any_organisations(self, alice_org):
        admin = get_user_model().objects.create_superuser(username="root", password=PASSWORD)
        assert signed_in(admin).get(f"/portal/{alice_org.pk}/playground/").status_code == 200

    def test_members_see_both_in_the_navigation(self, alice_org):
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/quickstart/").content.decode()
        assert f'href="/portal/{alice_org.pk}/playground/"' in page
        assert f'href="/portal/{alice_org.pk}/quickstart/" aria-current="page"' in page


def config_of(response: Any) -> dict[str, Any]:
    page = response.content.decode()
    found: dict[str, Any] = json.loads(page.split('id="playground-config" type="application/json">')[1]
                                       .split("</script>")[0])  # fmt: skip
    return found


@pytest.mark.django_db
class TestPlaygroundPage:
    def test_it_offers_the_served_chat_models_and_their_versions(self, alice_org, served):
        response = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/playground/")
        config = config_of(response)
        assert config["organization"] == alice_org.pk
        assert config["socketPath"] == "/ws/v1/chat/completions"
        # For "View code": the same request through the API of this server.
        assert config["apiBase"] == "http://testserver/v1"
        assert config["socketUrl"] == "ws://testserver/ws/v1/chat/completions"
        models = {m["name"]: m for m in config["models"]}
        assert models[served["chat"]] == {
            "name": served["chat"], "versions": ["1", "2"], "weighted": ["1"],
            "cache": {"off": "", "maxTemperature": settings.SEMANTIC_CACHE_MAX_TEMPERATURE,
                      "maxPromptTokens": settings.SEMANTIC_CACHE_MAX_PROMPT_TOKENS},
        }  # fmt: skip
        assert served["embedding"] not in models  # not a chat model
        page = response.content.decode()
        for label in ("System prompt", "Message", "Temperature", "Max tokens", "Compare side by side"):
            assert f">{label}</label>" in page
        for button in ("Send", "Stop", "New conversation", "View code"):
            assert f">{button}</button>" in page

    def test_a_link_may_name_the_model_and_version_to_start_on(self, alice_org, served):
        client = signed_in(user("ann", org=alice_org))
        page = f"/portal/{alice_org.pk}/playground/"
        chat = served["chat"]
        assert config_of(client.get(page, {"model": chat, "version": "2"}))["initial"] == {
            "model": chat,
            "version": "2",
        }
        # A version not served starts on the model, routed; a model not served (or none asked) on nothing.
        assert config_of(client.get(page, {"model": chat, "version": "9"}))["initial"] == {"model": chat, "version": ""}
        assert config_of(client.get(page, {"model": served["embedding"]}))["initial"] == {}
        assert config_of(client.get(page))["initial"] == {}

    def test_the_model_and_version_pickers_sit_above_send(self, alice_org, served):
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/playground/").content.decode()
        form = page.split('id="playground-form"')[1].split("</form>")[0]
        send = form.index('id="pg-send"')
        for picker in ("pg-model-a", "pg-version-a", "pg-model-b", "pg-version-b"):
            assert f'<label for="{picker}">' in form
            assert form.index(f'id="{picker}"') < send

    def test_behind_https_the_code_names_https_and_wss(self, alice_org, served):
        client = signed_in(user("ann", org=alice_org))
        config = config_of(client.get(f"/portal/{alice_org.pk}/playground/", secure=True))
        assert config["apiBase"] == "https://testserver/v1"
        assert config["socketUrl"] == "wss://testserver/ws/v1/chat/completions"

    def test_the_cache_option_follows_the_models_policy(self, alice_org, served):
        """The gateway's rules (serving.semcache.policy.intent_of): a policy that turns the cache
        off is a reason; one that allows hotter sampling moves the limit the page checks live."""
        model = Model.objects.get(name=served["chat"])
        CachePolicy.objects.create(model=model, enabled=True, max_temperature=Decimal("0.8"), max_prompt_tokens=500)
        client = signed_in(user("ann", org=alice_org))
        terms = {m["name"]: m["cache"] for m in config_of(client.get(f"/portal/{alice_org.pk}/playground/"))["models"]}
        assert terms[served["chat"]] == {"off": "", "maxTemperature": 0.8, "maxPromptTokens": 500}

        CachePolicy.objects.filter(model=model).update(enabled=False)
        terms = {m["name"]: m["cache"] for m in config_of(client.get(f"/portal/{alice_org.pk}/playground/"))["models"]}
        assert terms[served["chat"]]["off"] == f"The cache is off for {served['chat']} (its cache policy)."

    def test_with_the_cache_off_on_the_platform_every_model_says_so(self, alice_org, served, settings):
        settings.SEMANTIC_CACHE_ENABLED = False
        config = config_of(signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/playground/"))
        assert {m["cache"]["off"] for m in config["models"]} == {"The semantic cache is turned off on this platform."}

    def test_no_secret_is_in_the_page(self, alice_org, served):
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/playground/").content.decode()
        assert "sk-" not in page
        # The key is made on first use, by the socket (other modules' committed keys may exist).
        assert not ApiKey.objects.filter(organization=alice_org).exists()

    def test_with_no_chat_model_served_it_says_so(self, alice_org):
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/playground/").content.decode()
        assert "No chat model is being served right now" in page
        assert "playground.js" not in page


@pytest.mark.django_db
class TestQuickstart:
    def test_snippets_use_this_servers_address_and_the_organisations_models(self, alice_org, served):
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/quickstart/").content.decode()
        assert "curl http://testserver/v1/chat/completions" in page
        assert "OpenAI(base_url=&quot;http://testserver/v1&quot;)" in page
        assert "ws://testserver/ws/v1/chat/completions" in page
        assert f"&quot;model&quot;: &quot;{served['chat']}&quot;" in page
        assert f"model=&quot;{served['embedding']}&quot;" in page
        assert page.count('<button type="button" class="qs-copy"') == 7
        assert f'href="/portal/{alice_org.pk}/keys/"' in page
        assert 'href="/api/docs/"' in page

    def test_behind_https_the_socket_is_wss(self, alice_org, served):
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/quickstart/", secure=True)
        assert "wss://testserver/ws/v1/chat/completions" in page.content.decode()

    def test_behind_the_trusted_proxy_the_public_host_and_https_are_named(self, alice_org, served, settings):
        """No PUBLIC_BASE_URL: the request's own scheme and host, as the balancer passes them."""
        settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")  # TRUST_PROXY_HEADERS
        settings.ALLOWED_HOSTS = ["api.example.com"]
        page = signed_in(user("ann", org=alice_org)).get(
            f"/portal/{alice_org.pk}/quickstart/", HTTP_HOST="api.example.com", HTTP_X_FORWARDED_PROTO="https"
        )
        html = page.content.decode()
        assert "curl https://api.example.com/v1/chat/completions" in html
        assert "wss://api.example.com/ws/v1/chat/completions" in html


@pytest.fixture
def small_model(db: None) -> str:
    """A served ONNX classifier, as the quickstart's predict snippets need one."""
    name = f"digits-{uuid.uuid4().hex[:6]}"
    register_fake_replica(name, "http://127.0.0.1:9", task="classification")
    Model.objects.get(name=name).versions.update(
        framework="onnx",
        config={"signature": {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 2]}]},
                "example": {"pixels": [0.0, 1.0]}},
    )  # fmt: skip
    return name


@pytest.mark.django_db
class TestPublicBaseUrl:
    """PUBLIC_BASE_URL names the platform in every snippet, whatever host the page was asked on
    (a console reached at 127.0.0.1:8000 shows customers their own address)."""

    def test_the_quickstart_names_it_everywhere(self, alice_org, served, small_model, settings):
        settings.PUBLIC_BASE_URL = "https://api.example.com"
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/quickstart/").content.decode()
        assert '<code data-field="api-base">https://api.example.com/v1</code>' in page
        assert "curl https://api.example.com/v1/chat/completions" in page
        assert "OpenAI(base_url=&quot;https://api.example.com/v1&quot;)" in page
        assert "wss://api.example.com/ws/v1/chat/completions" in page
        assert f"curl https://api.example.com/api/v1/models/{small_model}/predict" in page
        assert "https://api.example.com/v2/models/{name}/infer" in page
        # tritonclient takes the host alone, and TLS as its own flag.
        assert "httpclient.InferenceServerClient(&quot;api.example.com&quot;, ssl=True)" in page
        assert f"grpcclient.InferenceServerClient(&quot;api.example.com:{settings.GRPC_PORT}&quot;)" in page
        assert "testserver" not in page

    def test_the_playgrounds_code_names_it(self, alice_org, served, settings):
        settings.PUBLIC_BASE_URL = "http://gpu-box.internal:8000"
        config = config_of(signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/playground/"))
        assert config["apiBase"] == "http://gpu-box.internal:8000/v1"
        assert config["socketUrl"] == "ws://gpu-box.internal:8000/ws/v1/chat/completions"
        assert config["socketPath"] == "/ws/v1/chat/completions"  # the page's own socket stays on its host

    def test_a_plain_http_address_keeps_its_port_and_no_tls(self, alice_org, served, small_model, settings):
        settings.PUBLIC_BASE_URL = "http://gpu-box.internal:8000"
        page = signed_in(user("ann", org=alice_org)).get(f"/portal/{alice_org.pk}/quickstart/").content.decode()
        assert "httpclient.InferenceServerClient(&quot;gpu-box.internal:8000&quot;)" in page
        assert f"grpcclient.InferenceServerClient(&quot;gpu-box.internal:{settings.GRPC_PORT}&quot;)" in page

    @pytest.mark.parametrize(
        ("value", "expected"),
        [("", ""), ("https://api.example.com/", "https://api.example.com"),
         (" http://10.0.0.5:8000 ", "http://10.0.0.5:8000"), ("https://example.com/inference/", "https://example.com/inference")],
    )  # fmt: skip
    def test_the_setting_is_read_without_its_trailing_slash(self, value, expected):
        from console.settings.security import public_base_url

        assert public_base_url(value) == expected

    @pytest.mark.parametrize("value", ["api.example.com", "ftp://api.example.com", "https://", "https://a.b/?x=1"])
    def test_a_value_that_is_no_http_url_is_refused(self, value):
        from django.core.exceptions import ImproperlyConfigured

        from console.settings.security import public_base_url

        with pytest.raises(ImproperlyConfigured, match="PUBLIC_BASE_URL"):
            public_base_url(value)


@pytest.mark.django_db
class TestPlaygroundKey:
    def test_one_key_per_member_and_organisation_made_on_first_use(self, alice_org, bob_org):
        ann, bea = user("ann", org=alice_org), user("bea", org=alice_org)
        first = playground_key_get_or_create(organization=alice_org, user=ann)
        assert playground_key_get_or_create(organization=alice_org, user=ann).pk == first.pk
        assert playground_key_get_or_create(organization=alice_org, user=bea).pk != first.pk
        assert playground_key_get_or_create(organization=bob_org, user=ann).pk != first.pk
        assert (first.name, first.prefix, first.organization_id) == ("Playground (ann)", "playground", alice_org.pk)
        assert first.key_hash == playground_key_hash(organization_id=alice_org.pk, user_id=ann.pk)

    def test_it_stays_within_the_organisations_plan(self):
        free = organization_create(name="Free Co", tier=Tier.FREE)
        key = playground_key_get_or_create(organization=free, user=user("ann", org=free))
        assert key.tier == Tier.FREE
        assert key.max_concurrent == 4  # the free plan's ceiling, not "no limit"
        assert key.rate_limit_rpm == 60

    def test_no_bearer_secret_opens_it(self, alice_org):
        """Its hash is an HMAC, not the SHA-256 of a secret: not even the hash itself, sent as a key, works."""
        ann = user("ann", org=alice_org)
        key = playground_key_get_or_create(organization=alice_org, user=ann)
        assert api_key_hash(key.key_hash) != key.key_hash
        assert not ApiKey.objects.filter(key_hash=api_key_hash(f"playground-key:{alice_org.pk}:{ann.pk}")).exists()

    def test_platform_staff_are_metered_to_the_platform_not_the_customer(self, alice_org):
        """Defect 9 of issue 18: a platform admin acts as admin of every organisation, but what
        they run in a customer's playground must not land on that customer's invoice."""
        from accounts.models import Membership, Role
        from accounts.services import platform_organization

        staff = user("mona")
        Membership.objects.create(user=staff, organization=platform_organization(), role=Role.PLATFORM_ADMIN)
        key = playground_key_get_or_create(organization=alice_org, user=staff)
        assert key.organization_id == platform_organization().pk != alice_org.pk
        assert playground_key_get_or_create(organization=alice_org, user=staff).pk == key.pk
        # A member is still metered to the organisation they use.
        assert playground_key_get_or_create(organization=alice_org, user=user("ann", org=alice_org)).organization_id \
            == alice_org.pk  # fmt: skip

    def test_a_revoked_one_stays_revoked(self, alice_org):
        ann = user("ann", org=alice_org)
        api_key_revoke(api_key=playground_key_get_or_create(organization=alice_org, user=ann))
        assert not playground_key_get_or_create(organization=alice_org, user=ann).is_active


# --- The WebSocket API's session path, against a real daphne process ---------------------


@pytest.fixture(scope="module")
def sessions(committed_users, django_db_blocker) -> dict[str, str]:
    """A committed session cookie for each role (the daphne process reads the same database)."""

    def log_in(who: Any) -> str:
        client = Client()
        client.force_login(who)
        return client.cookies[settings.SESSION_COOKIE_NAME].value

    names = ("platform_admin", "org_admin", "org_member", "outsider")
    return committed(django_db_blocker, lambda: {name: log_in(committed_users[name]) for name in names})


def ws_url(gateway: Any) -> str:
    return gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"


def open_socket(gateway: Any, *, session: str | None = None, origin: str | None = "same", **headers: str) -> Any:
    if session is not None:
        headers["Cookie"] = f"{settings.SESSION_COOKIE_NAME}={session}"
    if origin == "same":
        origin = gateway.base_url
    return connect(ws_url(gateway), additional_headers=headers, origin=origin)


def auth_answer(socket: Any, **message: Any) -> dict[str, Any]:
    socket.send(json.dumps({"type": "auth", **message}))
    answer: dict[str, Any] = json.loads(socket.recv(timeout=10))
    return answer


def first_answer_to_a_request(socket: Any, model: str = "no-such-model") -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    socket.send(json.dumps({"type": "chat.completion", "id": "r", "body": body}))
    answer: dict[str, Any] = json.loads(socket.recv(timeout=10))
    return answer


@pytest.mark.django_db  # only so that pytest-django sets the test database up when these run alone
class TestSessionSocket:
    def test_a_member_signs_in_by_session_and_requests_run_under_their_playground_key(
        self, console_gateway, committed_users, sessions, django_db_blocker
    ):
        org = committed_users["org"]
        with open_socket(console_gateway, session=sessions["org_member"]) as socket:
            assert auth_answer(socket, organization=org.pk) == {"type": "auth", "ok": True}
            # Past authentication: refused for the model, as any key would be.
            answer = first_answer_to_a_request(socket)
        assert answer["type"] == "error"
        assert answer["error"]["code"] == "model_not_found"
        member = committed_users["org_member"]
        key = committed(
            django_db_blocker,
            lambda: ApiKey.objects.get(key_hash=playground_key_hash(organization_id=org.pk, user_id=member.pk)),
        )
        assert key.organization_id == org.pk

    def test_a_platform_admin_may_use_any_organisation(self, console_gateway, committed_users, sessions):
        with open_socket(console_gateway, session=sessions["platform_admin"]) as socket:
            assert auth_answer(socket, organization=committed_users["org"].pk)["ok"] is True

    def test_a_platform_admin_runs_on_the_platforms_key(
        self, console_gateway, committed_users, sessions, django_db_blocker
    ):
        from accounts.services import platform_organization

        with open_socket(console_gateway, session=sessions["platform_admin"]) as socket:
            assert auth_answer(socket, organization=committed_users["org"].pk)["ok"] is True
            first_answer_to_a_request(socket)
        admin = committed_users["platform_admin"]

        def playground_keys() -> list[int]:
            return list(ApiKey.objects.filter(prefix="playground", name__contains=admin.username)
                        .values_list("organization_id", flat=True))  # fmt: skip

        assert committed(django_db_blocker, playground_keys) == [committed(django_db_blocker, platform_organization).pk]

    def test_a_non_member_cannot_stream_for_the_organisation(self, console_gateway, committed_users, sessions):
        with open_socket(console_gateway, session=sessions["outsider"]) as socket:
            refused = auth_answer(socket, organization=committed_users["org"].pk)
            assert refused["ok"] is False
            assert refused["error"]["code"] == "organization_not_found"
            assert first_answer_to_a_request(socket, CHAT)["error"]["code"] == "missing_api_key"
            # An organisation that does not exist reads the same.
            assert auth_answer(socket, organization=10**9)["error"]["code"] == "organization_not_found"
            assert auth_answer(socket, organization="x")["error"]["param"] == "organization"

    def test_a_foreign_origin_is_refused(self, console_gateway, committed_users, sessions):
        with open_socket(console_gateway, session=sessions["org_member"], origin="http://evil.example") as socket:
            refused = auth_answer(socket, organization=committed_users["org"].pk)
        assert refused["ok"] is False
        assert refused["error"]["code"] == "origin_not_allowed"

    def test_no_origin_is_refused_too(self, console_gateway, committed_users, sessions):
        with open_socket(console_gateway, session=sessions["org_member"], origin=None) as socket:
            assert auth_answer(socket, organization=committed_users["org"].pk)["error"]["code"] == "origin_not_allowed"

    def test_without_a_session_the_socket_is_not_signed_in(self, console_gateway, committed_users):
        with open_socket(console_gateway) as socket:
            refused = auth_answer(socket, organization=committed_users["org"].pk)
        assert refused["error"]["code"] == "not_signed_in"

    def test_a_forged_or_ended_session_is_not_signed_in(self, console_gateway, committed_users, django_db_blocker):
        member = committed_users["org_member"]

        def session_then_log_out() -> str:
            client = Client()
            client.force_login(member)
            cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
            client.logout()
            return cookie

        ended = committed(django_db_blocker, session_then_log_out)
        for cookie in (ended, "forged-session-key"):
            with open_socket(console_gateway, session=cookie) as socket:
                assert auth_answer(socket, organization=committed_users["org"].pk)["error"]["code"] == "not_signed_in"

    def test_a_revoked_playground_key_stops_the_member(self, console_gateway, committed_users, django_db_blocker):
        admin, org = committed_users["org_admin"], committed_users["org"]

        def revoked_session() -> str:
            api_key_revoke(api_key=playground_key_get_or_create(organization=org, user=admin))
            client = Client()
            client.force_login(admin)
            return client.cookies[settings.SESSION_COOKIE_NAME].value

        cookie = committed(django_db_blocker, revoked_session)
        with open_socket(console_gateway, session=cookie) as socket:
            assert auth_answer(socket, organization=org.pk)["error"]["code"] == "revoked_api_key"

    def test_the_api_key_path_is_unchanged(self, console_gateway, committed_users, django_db_blocker):
        secret = committed(
            django_db_blocker, lambda: api_key_create(organization=committed_users["other_org"], name="ws").secret
        )
        # From anywhere: a key is its own credential, whatever page opened the socket.
        with open_socket(console_gateway, origin="http://elsewhere.example") as socket:
            assert auth_answer(socket, api_key=secret) == {"type": "auth", "ok": True}
            assert first_answer_to_a_request(socket)["error"]["code"] == "model_not_found"
        with open_socket(console_gateway, origin=None, Authorization=f"Bearer {secret}") as socket:
            assert first_answer_to_a_request(socket)["error"]["code"] == "model_not_found"


@pytest.mark.django_db
class TestSmallModelsPage:
    """Issue 40, item 9: the predict page knows each model's price, its features' names and the
    address the code it shows calls."""

    def predict_config(self, client, org) -> dict[str, Any]:
        response = client.get(f"/portal/{org.pk}/predict/")
        return json.loads(response.content.decode().split('id="predict-config" type="application/json">')[1]
                          .split("</script>")[0])  # fmt: skip

    def test_the_price_per_thousand_and_the_feature_names(self, alice_org, small_model, settings):
        from billing.services import price_set

        settings.PUBLIC_BASE_URL = "https://api.example.com"
        model = Model.objects.get(name=small_model)
        model.versions.update(config={**model.versions.get().config, "feature_names": ["left", "right"]})
        client = signed_in(user("ann", org=alice_org))
        [unpriced] = [m for m in self.predict_config(client, alice_org)["models"] if m["name"] == small_model]
        assert unpriced["pricePer1k"] == ""
        price_set(model=model, input_per_million="0", output_per_million="0", per_thousand_inferences="0.125")
        config = self.predict_config(client, alice_org)
        [priced] = [m for m in config["models"] if m["name"] == small_model]
        assert priced["pricePer1k"] == "$0.125"
        assert priced["featureNames"] == ["left", "right"]
        assert config["baseUrl"] == "https://api.example.com"
