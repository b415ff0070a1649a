"""Fixtures shared by the search's tests: a local OpenAI-compatible endpoint (test_llm.py asks it for one reply at
a time; test_search.py feeds a whole search its replies, in order)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeEndpoint:
    """POST /v1/chat/completions answers with the next of ``replies`` (texts, used up in order), then with ``reply``
    (status, text, delay seconds); requests are recorded."""

    def __init__(self):
        self.reply: tuple[int, str, float] = (200, "", 0.0)
        self.replies: list[str] = []
        self.requests: list[dict] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with endpoint.lock:
                    endpoint.requests.append({"path": self.path, "body": body})
                    status, text, delay = (200, endpoint.replies.pop(0), 0.0) if endpoint.replies else endpoint.reply
                if delay:
                    endpoint.stop.wait(delay)  # woken at teardown, so a slow reply never holds the session
                if self.path != "/v1/chat/completions":
                    status, payload = 404, {"error": {"message": f"no route {self.path}"}}
                elif status != 200:
                    payload = {"error": {"message": text, "type": "server_error"}}
                else:
                    payload = {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body.get("model", "test-model"),
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
                    }
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (the timeout case)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def endpoint():
    server = FakeEndpoint()
    yield server
    server.close()
