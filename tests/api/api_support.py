"""Helpers for the API tests: starting the real `tansy serve` on a tiny random-weight model (CPU backend).

The model comes from tools/make_tiny_model.py: random weights, plus two scripted bigram
continuations (see that file) so that reasoning, tool calls and stop strings can be tested end to
end. The tokenizer and chat template come from tests/fixtures (TANSY_FIXTURES overrides).
The binary is build/tansy (TANSY_BIN overrides).
"""
import os
import socket
import subprocess
import time

import requests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.environ.get("TANSY_FIXTURES", os.path.join(REPO, "tests", "fixtures"))
TANSY = os.environ.get("TANSY_BIN", os.path.join(REPO, "build", "tansy"))
MODEL_ID = "tiny"
MAX_SEQ = 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir, log_path, *extra, backend="cpu"):
        """model_dir None: the server's default model, found from the repository as cwd."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        cmd = [TANSY, "serve", "--port", str(self.port), "--threads", "1"]
        # The expectations are the CPU backend's (f32), while the default, `--backend auto`, would
        # pick CUDA on a Hopper machine. backend=None leaves the flag out.
        if backend:
            cmd += ["--backend", backend]
        if model_dir:
            cmd += ["--model", model_dir, "--served-model-name", MODEL_ID, "--max-seq", str(MAX_SEQ)]
        self.proc = subprocess.Popen(cmd + list(extra), stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansy serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError("tansy serve did not become healthy:\n" + self.log_text())

    def log_text(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def metric(self, name):
        """The value of an unlabelled metric, or the sum over a labelled one's series."""
        total, found = 0.0, False
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"metric {name} missing"
        return total


