"""Every message shape and field OpenAI clients send, through the gateway to the real replica.

The answer must equal the replica's own answer to the same request, and the gateway's
prompt count (what it reserves) must equal the engine's, so limits and budgets charge
the truth. Never a fixed text: greedy answers differ between CPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.support.gateway import persisted
from tests.support.processes import BASE_DIR

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

CHAT = "smollm2-135m-instruct"
TPM = 10_000_000
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

SHAPES = {
    "content as text parts": [
        {"role": "system", "content": [{"type": "text", "text": "You answer briefly."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                     {"type": "text", "text": "Just one."}]},
    ],
    "assistant tool call with null content, then the tool's answer": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ],
    "tool answer as parts, developer role, names": [
        {"role": "developer", "content": "Be helpful."},
        {"role": "user", "name": "ann", "content": "Hello"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "Rain."}]},
        {"role": "user", "content": "And tomorrow?"},
    ],
}  # fmt: skip


def _post(base: str, secret: str, body: dict[str, object], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {secret}"}, timeout=120)


def _reserved(response: httpx.Response) -> int:
    """Tokens the gateway reserved at admission, read off a fresh key's TPM bucket."""
    return TPM - int(response.headers["x-ratelimit-remaining-tokens"])


class TestMessageShapes:
    @pytest.mark.parametrize("shape", list(SHAPES))
    @pytest.mark.parametrize("with_tools", [False, True])
    def test_the_shape_is_answered_like_the_replica_answers_it(
        self, gateway, make_api_key, engines, django_db_blocker, shape, with_tools
    ):
        key = make_api_key(rate_limit_rpm=1000, rate_limit_tpm=TPM)
        body = {"model": CHAT, "messages": SHAPES[shape], "max_tokens": 12, "temperature": 0}
        if with_tools:
            # "none": this engine runs without a tool-call parser (see test_what_the_engine_cannot_do).
            body |= {"tools": [WEATHER_TOOL], "tool_choice": "none", "parallel_tool_calls": False}
        ours = _post(gateway.base_url, key.secret, body)
        assert ours.status_code == 200, ours.text
        theirs = _post(engines.endpoint(CHAT, django_db_blocker), engines.key(CHAT), body)
        assert theirs.status_code == 200, theirs.text
        ours_json, theirs_json = ours.json(), theirs.json()
        assert ours_json["choices"][0]["message"]["content"] == theirs_json["choices"][0]["message"]["content"]
        assert ours_json["usage"] == theirs_json["usage"]
        # The gateway counted the prompt exactly as the engine did: prompt + max_tokens reserved.
        assert _reserved(ours) == theirs_json["usage"]["prompt_tokens"] + 12
        request_id = ours.headers["x-request-id"]
        assert persisted([request_id])[request_id].prompt_tokens == theirs_json["usage"]["prompt_tokens"]

    def test_every_optional_openai_field_is_accepted(self, gateway, api_key, engines, django_db_blocker):
        body = {
            "model": CHAT, "messages": SHAPES["content as text parts"], "max_completion_tokens": 8, "temperature": 0.8,
            "top_p": 1, "n": 2, "seed": 3, "stop": ["\n\n"], "frequency_penalty": 0, "presence_penalty": 0,
            "logit_bias": {"42": -1}, "logprobs": True, "top_logprobs": 2, "user": "u-1", "metadata": {"team": "a"},
            "store": False, "service_tier": "auto", "modalities": ["text"], "response_format": {"type": "text"},
            "reasoning_effort": "low", "prompt_cache_key": "k", "safety_identifier": "s",
            "stream_options": None, "parallel_tool_calls": True,
        }  # fmt: skip
        direct = {k: v for k, v in body.items() if k not in {"metadata", "store", "service_tier", "prompt_cache_key",
                                                             "safety_identifier", "stream_options"}}  # fmt: skip
        endpoint, engine_key = engines.endpoint(CHAT, django_db_blocker), engines.key(CHAT)

        def texts(response: httpx.Response) -> list[str]:
            assert response.status_code == 200, response.text
            return [c["message"]["content"] for c in response.json()["choices"]]

        # The seed reached the engine when the gateway's answer equals the engine's own. A CPU
        # engine's logits move in the last bits with what its prefix cache already holds (a
        # prompt computed in full or read back), and a sampled token can flip on that: the
        # prompt is cached first, and a pair may be asked again (an unseeded pair seldom matches).
        _post(endpoint, engine_key, direct | {"n": 1, "max_completion_tokens": 1})
        pairs = []
        for _ in range(3):
            response = _post(gateway.base_url, api_key.secret, body)
            ours = texts(response)
            assert len(ours) == 2
            assert response.json()["choices"][0]["logprobs"]["content"]
            pairs.append((ours, texts(_post(endpoint, engine_key, direct))))
            if pairs[-1][0] == pairs[-1][1]:
                break
        assert pairs[-1][0] == pairs[-1][1], pairs

    @pytest.mark.parametrize(
        "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
    )
    def test_what_the_engine_cannot_do_is_its_own_clear_400(
        self, gateway, make_api_key, engines, django_db_blocker, tool_choice
    ):
        """Without a tool-call parser (ENGINE_EXTRA_ARGS) vLLM refuses tool choices: the gateway
        passes its answer on as it is, never a 500, and meters the admitted request."""
        key = make_api_key(rate_limit_rpm=1000, rate_limit_tpm=TPM)
        body = {"model": CHAT, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 8,
                "tools": [WEATHER_TOOL], "tool_choice": tool_choice}  # fmt: skip
        ours = _post(gateway.base_url, key.secret, body)
        theirs = _post(engines.endpoint(CHAT, django_db_blocker), engines.key(CHAT), body)
        assert (ours.status_code, ours.json()["error"]["message"]) == (
            theirs.status_code,
            theirs.json()["error"]["message"],
        )
        assert ours.status_code == 400
        request_id = ours.headers["x-request-id"]
        assert persisted([request_id])[request_id].status_code == 400

    def test_a_streamed_shape_with_parts(self, gateway, api_key):
        body = {"model": CHAT, "messages": SHAPES["content as text parts"], "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {api_key.secret}"}) as response:  # fmt: skip
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"completion_tokens"' in lines[-2]


class TestWhatCannotBeDone:
    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("audio", {"voice": "alloy", "format": "wav"}),
            ("web_search_options", {}),
            ("prediction", {"type": "content", "content": "x"}),
            ("functions", [WEATHER_TOOL["function"]]),
            ("chat_template", "{{ messages }}"),
            ("priority", -10),
        ],
    )
    def test_is_refused_naming_the_field(self, gateway, api_key, field, value):
        body = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], field: value}
        response = _post(gateway.base_url, api_key.secret, body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (field, "unsupported_parameter")
        assert field in error["message"]

    def test_audio_output_modality_is_refused(self, gateway, api_key):
        body = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}
        response = _post(gateway.base_url, api_key.secret, body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "modalities"

    def test_an_image_part_is_answered_by_the_engine_not_a_500(self, gateway, api_key):
        content = [{"type": "text", "text": "What is this?"},
                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]  # fmt: skip
        body = {"model": CHAT, "messages": [{"role": "user", "content": content}]}
        response = _post(gateway.base_url, api_key.secret, body)
        assert response.status_code == 400, response.text  # a text-only model: the engine's own refusal
        assert response.json()["error"]["message"]


def test_vllm_bench_serve_openai_chat_through_the_gateway(gateway, api_key, bundled_models, tmp_path):
    """vLLM's own benchmark client (it sends content as parts) gets no failed request."""
    from registry.artifacts import get_artifact_store

    tokenizer = get_artifact_store().local_path(bundled_models["versions"][CHAT].artifact_uri)
    result = subprocess.run(
        [
            sys.executable, str(BASE_DIR / "bench" / "vllm_bench_serve.py"), "--backend", "openai-chat",
            "--base-url", gateway.base_url, "--endpoint", "/v1/chat/completions", "--model", CHAT,
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", "32",
            "--random-output-len", "8", "--num-prompts", "24", "--max-concurrency", "8", "--seed", "1",
        ],
        env={**os.environ, "OPENAI_API_KEY": api_key.secret, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Successful requests:" in output
    successful = int(output.split("Successful requests:")[1].split()[0])
    assert successful == 24, output[-3000:]
