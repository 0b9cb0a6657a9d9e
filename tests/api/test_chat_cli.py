"""`tansy chat` on a terminal (a pseudo-terminal here) with the tiny model: whole lines of any
length, a bracketed multi-line paste as one message, unknown /commands answered locally."""
import os
import pty
import re
import select
import subprocess
import time

from api_support import TANSY

PASTE_ON, PASTE_OFF = "\x1b[200~", "\x1b[201~"


class Chat:
    def __init__(self, model):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([TANSY, "chat", "--model", model, "--backend", "cpu", "--threads", "1",
                                      "--max-seq", "4096", "--max-tokens", "2", "--no-think"],
                                     stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.out = ""
        self.wait_for(r"> ")

    def read(self, timeout):
        r, _, _ = select.select([self.master], [], [], timeout)
        if r:
            try:
                self.out += os.read(self.master, 65536).decode("utf-8", "replace")
            except OSError:
                pass

    def wait_for(self, pattern, start=0, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.out[start:])
            if m:
                return m
            self.read(0.2)
        raise AssertionError(f"no {pattern!r} in the chat's output:\n{self.out[-3000:]}")

    def send(self, text):
        start = len(self.out)
        data = text.encode()
        for i in range(0, len(data), 1024):  # the pty's input buffer is small
            os.write(self.master, data[i:i + 1024])
            self.read(0.01)
        return start

    def close(self):
        self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def turns(text):
    return [int(x) for x in re.findall(r"\[(\d+) prompt tokens", text)]


def test_long_line_is_one_whole_message(tiny_model, hf_tokenizer):
    c = Chat(tiny_model)
    try:
        words = " ".join(["hello"] * 3000)  # 18 KB, over the terminal's 4,095-byte line
        start = c.send(words + "\r")
        c.wait_for(r"prompt tokens", start)
        n = turns(c.out[start:])
        assert len(n) == 1, c.out[-2000:]
        assert n[0] > len(hf_tokenizer.encode(words[:4095]).ids) + 100, n
        assert n[0] >= len(hf_tokenizer.encode(words).ids), n
    finally:
        c.close()


def test_multi_line_paste_is_one_message(tiny_model):
    c = Chat(tiny_model)
    try:
        start = c.send(PASTE_ON + "first line\nsecond line\nthird line" + PASTE_OFF + "\r")
        c.wait_for(r"prompt tokens", start)
        time.sleep(1)
        c.read(0.5)
        assert len(turns(c.out[start:])) == 1, c.out[start:]
    finally:
        c.close()


def test_unknown_command_is_answered_locally(tiny_model):
    c = Chat(tiny_model)
    try:
        start = c.send("/frobnicate now\r")
        c.wait_for(r"unknown command /frobnicate", start)
        start2 = c.send("hello\r")
        c.wait_for(r"prompt tokens", start2)
        assert turns(c.out[start:]) and len(turns(c.out[start:])) == 1, c.out[start:]
    finally:
        c.close()
