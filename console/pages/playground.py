"""The playground (streams over the WebSocket API), the small models' "try it" page (the
predict API, as the signed-in member) and the quickstart."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, URLPattern, URLResolver, path, reverse

from billing.pricing import PriceQuote, price_in_effect
from billing.selectors import prices_in_effect_or_later
from console.pages.access import OrgRequest, org_member_required
from console.pages.nav import PORTAL, NavItem
from core import formats
from registry.models import Task
from registry.selectors import serving_deployments
from registry.signatures import is_predict_framework
from serving.gateway.routing import CacheRules
from serving.semcache.selectors import cache_policies_by_model

WEBSOCKET_PATH = "/ws/v1/chat/completions"
# What the playground starts with; the engine's own limit is the model's context length.
DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_CEILING = 4096


@dataclass(frozen=True)
class PublicAddress:
    """Where customers reach this platform, as every snippet the portal shows names it."""

    base_url: str  # "https://api.example.com": a scheme, a host, a path if any; no trailing slash

    @property
    def api_base(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def secure(self) -> bool:
        return self.base_url.startswith("https:")

    @property
    def socket_url(self) -> str:
        return f"{'wss' if self.secure else 'ws'}://{self.base_url.split('://', 1)[1]}{WEBSOCKET_PATH}"

    @property
    def http_host(self) -> str:
        """What tritonclient's HTTP client takes: the host and port, without a scheme or path."""
        return urlsplit(self.base_url).netloc

    @property
    def grpc_address(self) -> str:
        """The gRPC listener (GRPC_PORT) on the same host."""
        host = urlsplit(self.base_url).hostname or ""
        return f"[{host}]:{settings.GRPC_PORT}" if ":" in host else f"{host}:{settings.GRPC_PORT}"


def public_address(request: HttpRequest) -> PublicAddress:
    """PUBLIC_BASE_URL when it is set; else the scheme and host the request came with (https
    behind a balancer trusted with X-Forwarded-Proto: TRUST_PROXY_HEADERS)."""
    return PublicAddress(settings.PUBLIC_BASE_URL or request.build_absolute_uri("/").rstrip("/"))


@dataclass
class ServedModel:
    """A model the gateways serve, with the versions a request may be pinned to."""

    name: str
    task: str
    model_id: int = 0
    versions: list[str] = field(default_factory=list)  # served versions, oldest deployment first
    weighted: list[str] = field(default_factory=list)  # those taking unpinned traffic


def served_models() -> list[ServedModel]:
    """Every model with a serving deployment (what the router can route to), by name.

    Organisations are not restricted to models (keys are), and the playground's key has no
    restriction, so every served chat model is the org's to try; any served version may be
    pinned (``model_version``, as ``X-Model-Version``), a weight-0 candidate included.
    """
    models: dict[str, ServedModel] = {}
    for deployment in serving_deployments():
        version = deployment.version
        entry = models.setdefault(
            version.model.name, ServedModel(version.model.name, version.model.task, version.model_id)
        )
        if version.version not in entry.versions:
            entry.versions.append(version.version)
        if deployment.traffic_weight > 0 and version.version not in entry.weighted:
            entry.weighted.append(version.version)
    return sorted(models.values(), key=lambda m: m.name)


@dataclass
class SmallModel:
    """A served small model as the "try it" page shows it: the version taking traffic first."""

    name: str
    version: str
    signature: dict[str, Any]
    labels: list[str]
    example: dict[str, Any] | None
    try_it: dict[str, Any] | None
    heldout_accuracy: float | None
    # What a thousand inferences cost now (the version's price, else the model's); "" unpriced.
    price_per_1k: str = ""
    # The names of a tabular model's features, in order, when its config gives them.
    feature_names: list[str] | None = None


def served_small_models() -> list[SmallModel]:
    found: dict[str, SmallModel] = {}
    versions: dict[str, tuple[int, int]] = {}  # model name → (model id, version id)
    for deployment in sorted(serving_deployments(), key=lambda d: -d.traffic_weight):
        version = deployment.version
        if not is_predict_framework(version.framework) or version.model.name in found:
            continue
        config = version.config
        names = config.get("feature_names")
        found[version.model.name] = SmallModel(
            name=version.model.name,
            version=version.version,
            signature=config.get("signature") or {},
            labels=list(config.get("labels") or []),
            example=config.get("example"),
            try_it=config.get("try_it"),
            heldout_accuracy=config.get("heldout_accuracy"),
            feature_names=[str(n) for n in names] if isinstance(names, list) else None,
        )
        versions[version.model.name] = (version.model_id, version.pk)
    now = time.time()
    for name, (model_id, version_id) in versions.items():
        quotes = tuple(PriceQuote.of(p) for p in prices_in_effect_or_later(model_ids=[model_id]))
        quote = price_in_effect(quotes, version_id=version_id, when=now)
        if quote is not None:
            found[name].price_per_1k = formats.unit_price(quote.per_thousand_inferences, quote.currency)
    return sorted(found.values(), key=lambda m: m.name)


@org_member_required()
def try_small_models(request: OrgRequest, org_id: int) -> HttpResponse:
    """Draw a digit, or edit an instance, and see the model's prediction (metered to the
    member's playground key, like the playground)."""
    models = served_small_models()
    config = {
        "organization": org_id,
        "baseUrl": public_address(request).base_url,
        "models": [
            {"name": m.name, "version": m.version, "signature": m.signature, "labels": m.labels,
             "example": m.example, "tryIt": m.try_it, "featureNames": m.feature_names,
             "pricePer1k": m.price_per_1k}
            for m in models
        ],
    }  # fmt: skip
    return render(
        request,
        "console/playground/predict.html",
        {"organization": request.organization, "models": models, "config": config},
    )


def cache_terms(models: list[ServedModel]) -> dict[str, dict[str, Any]]:
    """When each model's semantic cache can answer a playground request, by model name:
    ``off`` says why it never can (else empty), ``maxTemperature`` is the hottest sampling it
    takes. These are the gateway's own rules (``serving.gateway.routing`` builds its ``CacheRules``
    from the same policy rows, ``serving.semcache.policy.intent_of`` applies them); the
    playground always sends a temperature, so the model's default temperature never decides.
    What else could keep one request out (a prompt over ``max_prompt_tokens``) is said, not
    checked: only the gateway counts tokens exactly."""
    policies = cache_policies_by_model()
    terms: dict[str, dict[str, Any]] = {}
    for model in models:
        rules = CacheRules.of(policies.get(model.model_id))
        if not settings.SEMANTIC_CACHE_ENABLED:
            off = "The semantic cache is turned off on this platform."
        elif not rules.enabled:
            off = f"The cache is off for {model.name} (its cache policy)."
        else:
            off = ""
        terms[model.name] = {
            "off": off,
            "maxTemperature": rules.max_temperature,
            "maxPromptTokens": rules.max_prompt_tokens,
        }
    return terms


@org_member_required()
def playground(request: OrgRequest, org_id: int) -> HttpResponse:
    chat_models = [m for m in served_models() if m.task == Task.CHAT]
    cache = cache_terms(chat_models)
    address = public_address(request)
    config: dict[str, Any] = {
        "organization": org_id,
        "socketPath": WEBSOCKET_PATH,
        # For "View code": the same request through the API, as any client would send it.
        "apiBase": address.api_base,
        "socketUrl": address.socket_url,
        "models": [
            {"name": m.name, "versions": m.versions, "weighted": m.weighted, "cache": cache[m.name]}
            for m in chat_models
        ],
        "initial": _initial(chat_models, request.GET.get("model", ""), request.GET.get("version", "")),
    }
    return render(
        request,
        "console/playground/playground.html",
        {
            "organization": request.organization,
            "chat_models": chat_models,
            "config": config,
            "default_max_tokens": DEFAULT_MAX_TOKENS,
            "max_tokens_ceiling": MAX_TOKENS_CEILING,
        },
    )


def _initial(models: list[ServedModel], model: str, version: str) -> dict[str, str]:
    """The model and version a link asks the playground to start on, when they are served
    (a version not served starts on the model, routed); nothing otherwise."""
    served = next((m for m in models if m.name == model), None)
    if served is None:
        return {}
    return {"model": served.name, "version": version if version in served.versions else ""}


def _keys_url(org_id: int) -> str:
    """The portal's keys page (another area builds it); its path if it is not installed yet."""
    try:
        return reverse("console:portal-keys", kwargs={"org_id": org_id})
    except NoReverseMatch:
        return f"/portal/{org_id}/keys/"


def quickstart_snippets(*, api_base: str, ws_url: str, chat_model: str, embedding_model: str) -> dict[str, str]:
    """Copy-paste examples for this server and these models (the key comes from $OPENAI_API_KEY)."""
    question = '[{"role": "user", "content": "What is the capital of Japan?"}]'
    python_client = (
        f'from openai import OpenAI\n\nclient = OpenAI(base_url="{api_base}")  # the key is read from $OPENAI_API_KEY\n'
    )
    return {
        "curl_chat": (
            f"curl {api_base}/chat/completions \\\n"
            '  -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
            '  -H "Content-Type: application/json" \\\n'
            f'  -d \'{{"model": "{chat_model}", "messages": {question}}}\''
        ),
        "curl_stream": (
            f"curl -N {api_base}/chat/completions \\\n"
            '  -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
            '  -H "Content-Type: application/json" \\\n'
            f'  -d \'{{"model": "{chat_model}", "stream": true, '
            '"stream_options": {"include_usage": true}, '
            '"messages": [{"role": "user", "content": "Tell me a story"}]}\''
        ),
        "curl_embeddings": (
            f"curl {api_base}/embeddings \\\n"
            '  -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
            '  -H "Content-Type: application/json" \\\n'
            f'  -d \'{{"model": "{embedding_model}", "input": ["hello", "world"]}}\''
        ),
        "python_chat": (
            python_client + "response = client.chat.completions.create(\n"
            f'    model="{chat_model}",\n'
            '    messages=[{"role": "user", "content": "What is the capital of Japan?"}],\n'
            ")\n"
            "print(response.choices[0].message.content)"
        ),
        "python_stream": (
            python_client + "stream = client.chat.completions.create(\n"
            f'    model="{chat_model}",\n'
            '    messages=[{"role": "user", "content": "Tell me a story"}],\n'
            "    stream=True,\n"
            '    stream_options={"include_usage": True},\n'
            ")\n"
            "for chunk in stream:\n"
            "    if chunk.choices:\n"
            '        print(chunk.choices[0].delta.content or "", end="", flush=True)\n'
            "    if chunk.usage:\n"
            '        print("\\n", chunk.usage)'
        ),
        "python_embeddings": (
            python_client + f'result = client.embeddings.create(model="{embedding_model}", input=["hello", "world"])\n'
            "print(len(result.data), len(result.data[0].embedding))"
        ),
        "python_websocket": (
            "import json\n"
            "import os\n\n"
            "from websockets.sync.client import connect\n\n"
            'headers = {"Authorization": f"Bearer {os.environ[\'OPENAI_API_KEY\']}"}\n'
            f'with connect("{ws_url}", additional_headers=headers) as ws:\n'
            "    ws.send(json.dumps({\n"
            '        "type": "chat.completion",\n'
            '        "id": "a",\n'
            f'        "body": {{"model": "{chat_model}",\n'
            '                 "messages": [{"role": "user", "content": "Tell me a story"}]},\n'
            "    }))\n"
            "    while True:\n"
            "        frame = json.loads(ws.recv())\n"
            '        if frame["type"] == "chunk":\n'
            '            print(frame["data"]["choices"][0]["delta"].get("content") or "", end="", flush=True)\n'
            '        elif frame["type"] in ("usage", "error"):  # a request\'s last frame\n'
            "            print()\n"
            "            print(frame)\n"
            "            break"
        ),
    }


def predict_snippets(*, address: PublicAddress, model: SmallModel) -> dict[str, str]:
    """Copy-paste predict examples for one small model: curl, tritonclient over HTTP and gRPC."""
    example = model.example or {spec["name"]: "…" for spec in model.signature.get("inputs", [])}
    inputs = model.signature.get("inputs") or [{"name": "input", "datatype": "FP32", "shape": [-1]}]
    first = inputs[0]
    row = example.get(first["name"], [])
    width = len(row) if isinstance(row, list) else 1
    triton_body = (
        "import os\n\nimport numpy as np\n"
        "{module}\n\n"
        'headers = {{"Authorization": f"Bearer {{os.environ[\'OPENAI_API_KEY\']}}"}}\n'
        "{client}\n"
        f"rows = np.array([{row!r}], dtype=np.float32)\n"
        f'tensor = {{alias}}.InferInput("{first["name"]}", [1, {width}], "{first["datatype"]}")\n'
        "tensor.set_data_from_numpy(rows)\n"
        f'result = client.infer("{model.name}", [tensor], headers=headers)\n'
        'print(result.as_numpy("label"), result.as_numpy("probabilities"))'
    )
    http_client = f'"{address.http_host}", ssl=True' if address.secure else f'"{address.http_host}"'
    return {
        "curl_predict": (
            f"curl {address.base_url}/api/v1/models/{model.name}/predict \\\n"
            '  -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
            '  -H "Content-Type: application/json" \\\n'
            f"  -d '{json.dumps({'inputs': [example]})}'"
        ),
        "python_triton_http": triton_body.format(
            module="import tritonclient.http as httpclient", alias="httpclient",
            client=f"client = httpclient.InferenceServerClient({http_client})",
        ),
        "python_triton_grpc": triton_body.format(
            module="import tritonclient.grpc as grpcclient", alias="grpcclient",
            client=f'client = grpcclient.InferenceServerClient("{address.grpc_address}")',
        ),
    }  # fmt: skip


@org_member_required()
def quickstart(request: OrgRequest, org_id: int) -> HttpResponse:
    models = served_models()
    chat = next((m.name for m in models if m.task == Task.CHAT), "MODEL")
    embedding = next((m.name for m in models if m.task == Task.EMBEDDING), "EMBEDDING_MODEL")
    address = public_address(request)
    context: dict[str, Any] = {
        "organization": request.organization,
        "base_url": address.base_url,
        "api_base": address.api_base,
        "ws_url": address.socket_url,
        "chat_model": chat,
        "embedding_model": embedding,
        "models": models,
        "keys_url": _keys_url(org_id),
        "docs_url": reverse("api-docs"),
        "playground_url": reverse("console:playground", kwargs={"org_id": org_id}),
        **quickstart_snippets(
            api_base=address.api_base, ws_url=address.socket_url, chat_model=chat, embedding_model=embedding
        ),
    }
    small = served_small_models()
    if small:
        context |= {
            "small_model": small[0],
            "grpc_address": address.grpc_address,
            **predict_snippets(address=address, model=small[0]),
        }
    return render(request, "console/playground/quickstart.html", context)


urlpatterns: list[URLPattern | URLResolver] = [
    path("portal/<int:org_id>/playground/", playground, name="playground"),
    path("portal/<int:org_id>/quickstart/", quickstart, name="quickstart"),
    path("portal/<int:org_id>/predict/", try_small_models, name="predict"),
]
NAV: list[NavItem] = [
    NavItem("Playground", "playground", PORTAL),
    NavItem("Small models", "predict", PORTAL),
    NavItem("Quickstart", "quickstart", PORTAL),
]
