"""Fixtures of the API tests: the real `tansy serve` on a tiny random-weight model (see api_support.py)."""
import json
import os
import subprocess
import sys

import pytest

from api_support import FIXTURES, MODEL_ID, REPO, TANSY, ServerProcess


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    if not os.path.exists(TANSY):
        pytest.fail(f"{TANSY} is missing: build first (scripts/build)")
    out = str(tmp_path_factory.mktemp("tiny-model"))
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_tiny_model.py"), out,
                    "--tokenizer", os.path.join(FIXTURES, "qwen3-tokenizer"),
                    "--template", os.path.join(FIXTURES, "qwen3.6", "chat_template.jinja")], check=True)
    return out


@pytest.fixture(scope="session")
def scripts(tiny_model):
    with open(os.path.join(tiny_model, "tiny_model_scripts.json")) as f:
        return json.load(f)


def start(tiny_model, tmp_path_factory, name, *extra):
    log = str(tmp_path_factory.mktemp("logs") / f"{name}.log")
    return ServerProcess(tiny_model, log, *extra)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    s = start(tiny_model, tmp_path_factory, "main", "--max-queue", "8", "--timeout", "120")
    yield s
    alive = s.alive()
    s.stop()
    assert alive, "the server died during the tests:\n" + s.log_text()


@pytest.fixture
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def start_server(tiny_model, tmp_path_factory):
    """Starts extra servers with other flags; all are stopped at the end of the session."""
    started = []

    def go(name, *extra):
        s = start(tiny_model, tmp_path_factory, name, *extra)
        started.append(s)
        return s

    yield go
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(tiny_model, "tokenizer.json"))
