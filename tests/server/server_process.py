"""A `tritonllm serve` subprocess on a free port of 127.0.0.1 (the bundled model, CPU, reference
kernels) and the raw HTTP calls the tests make beside the openai client."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai

from tritonllm.distributed import free_port

ENGINE_ARGS = ["--device", "cpu", "--kernels", "reference"]
STARTUP_TIMEOUT_S = 300


class ServerProcess:
    def __init__(self, args: list[str], log_path, port: int | None = None, cwd=None):
        """port: default a free one; 0 lets the server pick it, read from the address it prints."""
        self.port = free_port() if port is None else port
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen([sys.executable, "-m", "tritonllm", "serve", "--port", str(self.port), *ENGINE_ARGS,
                                         *args], stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.port or self.request("GET", "/health", timeout=5)[0] != 200:
            announced = None if self.port else re.search(r" on http://127\.0\.0\.1:(\d+)/v1", self.log_text())
            if announced:
                self.port = int(announced[1])
            if (announced and not self.port) or self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log_text()[-4000:]}")
            time.sleep(0.5)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        if not self.log.closed:  # stop() closes it: the text is still there
            self.log.flush()
        return open(self.log_path).read()

    def request(self, method: str, path: str, body: bytes | dict | None = None, timeout: float = 120) -> tuple[int, dict | str]:
        """(status, the JSON body or text); status 0 when nothing answers."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def send_only(self, path: str, body: dict) -> socket.socket:
        """POST body without reading the answer: the caller closes the socket to leave."""
        sock = socket.create_connection(("127.0.0.1", self.port))
        data = json.dumps(body).encode()
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        return sock

    def stats(self) -> dict:
        status, body = self.request("GET", "/stats")
        assert status == 200, body
        return body

    def wait_idle(self, timeout: float = 120) -> dict:
        """The stats once nothing runs or waits and every KV block is free (or after timeout seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats["num_running_seqs"] == stats["num_waiting_seqs"] == 0
            if (idle and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]) or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=300, **options)

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode
