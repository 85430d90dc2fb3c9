"""The WebSocket API against real replicas: interleaved streams, cancel, usage per id."""

from __future__ import annotations

import json
import time

import pytest
from websockets.sync.client import connect

from tests.support.gateway import persisted

pytestmark = [pytest.mark.engine, pytest.mark.django_db]

CHAT = "smollm2-135m-instruct"
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


def ws_url(gateway) -> str:
    return gateway.base_url.replace("http://", "ws://") + "/ws/v1/chat/completions"


def receive_until(socket, done, timeout=120.0):
    frames = []
    deadline = time.monotonic() + timeout
    while not done(frames):
        frames.append(json.loads(socket.recv(timeout=max(0.1, deadline - time.monotonic()))))
    return frames


class TestWebSocket:
    def test_two_interleaved_streams_one_cancelled(self, gateway, api_key):
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        with connect(ws_url(gateway), additional_headers=headers) as socket:
            for client_id in ("a", "b"):
                # ignore_eos: the token count must not depend on where this CPU's greedy answer ends.
                body = {"model": CHAT, "messages": STORY, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
                socket.send(json.dumps({"type": "chat.completion", "id": client_id, "body": body}))
            frames = receive_until(socket, lambda fs: sum(f["id"] == "b" and f["type"] == "chunk" for f in fs) >= 3)
            socket.send(json.dumps({"type": "cancel", "id": "b"}))
            frames += receive_until(socket, lambda fs: sum(f["type"] == "usage" for f in fs) == 2)

        chunks = [f for f in frames if f["type"] == "chunk"]
        order = [f["id"] for f in chunks]
        # Both ran at once: b's first chunk arrived before a's last one.
        assert order.index("b") < len(order) - 1 - order[::-1].index("a")
        usage = {f["id"]: f for f in frames if f["type"] == "usage"}
        assert usage["a"]["status"] == "completed"
        assert usage["a"]["usage"]["completion_tokens"] == 80
        assert usage["b"]["status"] == "cancelled"
        assert 2 <= usage["b"]["usage"]["completion_tokens"] < 80  # the first chunk carries only the role
        a_ids = {f["data"]["id"] for f in chunks if f["id"] == "a"}
        assert len(a_ids) == 1
        assert all(f["data"]["model"] == CHAT for f in chunks)

        records = persisted([usage["a"]["request_id"], usage["b"]["request_id"]])
        assert records[usage["a"]["request_id"]].status_code == 200
        assert records[usage["a"]["request_id"]].completion_tokens == 80
        cancelled = records[usage["b"]["request_id"]]
        assert cancelled.status_code == 499
        assert cancelled.completion_tokens == usage["b"]["usage"]["completion_tokens"]

    def test_a_socket_idle_for_a_minute_still_streams(self, gateway, api_key):
        """The channel layer blocks in Redis for 5 s at a time: its socket timeout must be longer."""
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        with connect(ws_url(gateway), additional_headers=headers) as socket:
            time.sleep(65)
            body = {"model": CHAT, "messages": STORY, "max_tokens": 5, "ignore_eos": True}
            socket.send(json.dumps({"type": "chat.completion", "id": "late", "body": body}))
            frames = receive_until(socket, lambda fs: any(f["type"] in {"usage", "error"} for f in fs))
        assert frames[-1]["type"] == "usage", frames[-1]
        assert (frames[-1]["status"], frames[-1]["usage"]["completion_tokens"]) == ("completed", 5)

    def test_a_stream_of_400_tokens(self, gateway, api_key):
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        started = time.monotonic()
        with connect(ws_url(gateway), additional_headers=headers) as socket:
            body = {"model": CHAT, "messages": STORY, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
            socket.send(json.dumps({"type": "chat.completion", "id": "long", "body": body}))
            frames = receive_until(socket, lambda fs: any(f["type"] in {"usage", "error"} for f in fs), timeout=300)
        assert frames[-1]["type"] == "usage", frames[-1]
        assert (frames[-1]["status"], frames[-1]["usage"]["completion_tokens"]) == ("completed", 400)
        # Streamed, not buffered: vLLM merges the deltas a busy consumer has not yet taken, so on a
        # loaded machine a few chunks carry two tokens; far fewer chunks would mean buffering.
        chunks = [f for f in frames if f["type"] == "chunk"]
        assert len(chunks) >= 300, len(chunks)
        record = persisted([frames[-1]["request_id"]])[frames[-1]["request_id"]]
        assert (record.status_code, record.completion_tokens) == (200, 400)
        print(f"400 tokens over the socket in {time.monotonic() - started:.1f} s")

    def test_auth_message_for_browsers(self, gateway, api_key):
        with connect(ws_url(gateway)) as socket:
            socket.send(json.dumps({"type": "chat.completion", "id": "x", "body": {"model": CHAT, "messages": STORY}}))
            refused = json.loads(socket.recv(timeout=10))
            assert refused["type"] == "error"
            assert refused["error"]["code"] == "missing_api_key"
            socket.send(json.dumps({"type": "auth", "api_key": api_key.secret}))
            assert json.loads(socket.recv(timeout=10)) == {"type": "auth", "ok": True}
            body = {"model": CHAT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}
            socket.send(json.dumps({"type": "chat.completion", "id": "x", "body": body}))
            frames = receive_until(socket, lambda fs: any(f["type"] == "usage" for f in fs))
        assert frames[-1]["status"] == "completed"
        assert frames[-1]["usage"]["completion_tokens"] == 3

    def test_a_bad_key_on_the_handshake_is_refused(self, gateway):
        from websockets.exceptions import ConnectionClosed, InvalidStatus

        headers = {"Authorization": "Bearer sk-wrong"}
        with (
            pytest.raises((InvalidStatus, ConnectionClosed)),
            connect(ws_url(gateway), additional_headers=headers) as ws,
        ):
            ws.recv(timeout=10)

    def test_invalid_requests_get_error_frames(self, gateway, api_key):
        headers = {"Authorization": f"Bearer {api_key.secret}"}
        with connect(ws_url(gateway), additional_headers=headers) as socket:
            socket.send("not json")
            assert json.loads(socket.recv(timeout=10))["error"]["code"] is None
            socket.send(json.dumps({"type": "chat.completion", "id": "v", "body": {"model": CHAT}}))
            error = json.loads(socket.recv(timeout=10))
            assert (error["type"], error["id"], error["error"]["param"]) == ("error", "v", "messages")
            socket.send(json.dumps({"type": "dance", "id": "w"}))
            assert json.loads(socket.recv(timeout=10))["error"]["param"] == "type"
