"""The playground (streams over the WebSocket API) and the quickstart."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.http import HttpResponse
from django.shortcuts import render
from django.urls import NoReverseMatch, URLPattern, URLResolver, path, reverse

from console.pages.access import OrgRequest, org_member_required
from console.pages.nav import PORTAL, NavItem
from registry.models import Task
from registry.selectors import serving_deployments

WEBSOCKET_PATH = "/ws/v1/chat/completions"
# What the playground starts with; the engine's own limit is the model's context length.
DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_CEILING = 4096


@dataclass
class ServedModel:
    """A model the gateways serve, with the versions a request may be pinned to."""

    name: str
    task: str
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
        entry = models.setdefault(version.model.name, ServedModel(version.model.name, version.model.task))
        if version.version not in entry.versions:
            entry.versions.append(version.version)
        if deployment.traffic_weight > 0 and version.version not in entry.weighted:
            entry.weighted.append(version.version)
    return sorted(models.values(), key=lambda m: m.name)


@org_member_required()
def playground(request: OrgRequest, org_id: int) -> HttpResponse:
    chat_models = [m for m in served_models() if m.task == Task.CHAT]
    config: dict[str, Any] = {
        "organization": org_id,
        "socketPath": WEBSOCKET_PATH,
        "models": [{"name": m.name, "versions": m.versions, "weighted": m.weighted} for m in chat_models],
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


@org_member_required()
def quickstart(request: OrgRequest, org_id: int) -> HttpResponse:
    models = served_models()
    chat = next((m.name for m in models if m.task == Task.CHAT), "MODEL")
    embedding = next((m.name for m in models if m.task == Task.EMBEDDING), "EMBEDDING_MODEL")
    base_url = request.build_absolute_uri("/").rstrip("/")
    ws_scheme = "wss" if request.is_secure() else "ws"
    ws_url = f"{ws_scheme}://{request.get_host()}{WEBSOCKET_PATH}"
    context: dict[str, Any] = {
        "organization": request.organization,
        "base_url": base_url,
        "api_base": f"{base_url}/v1",
        "ws_url": ws_url,
        "chat_model": chat,
        "embedding_model": embedding,
        "models": models,
        "keys_url": _keys_url(org_id),
        "docs_url": reverse("api-docs"),
        "playground_url": reverse("console:playground", kwargs={"org_id": org_id}),
        **quickstart_snippets(api_base=f"{base_url}/v1", ws_url=ws_url, chat_model=chat, embedding_model=embedding),
    }
    return render(request, "console/playground/quickstart.html", context)


urlpatterns: list[URLPattern | URLResolver] = [
    path("portal/<int:org_id>/playground/", playground, name="playground"),
    path("portal/<int:org_id>/quickstart/", quickstart, name="quickstart"),
]
NAV: list[NavItem] = [
    NavItem("Playground", "playground", PORTAL),
    NavItem("Quickstart", "quickstart", PORTAL),
]
