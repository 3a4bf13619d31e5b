"""``python -m leasehold serve`` as a real process stopped by signals: the
first SIGTERM stops accepting and lets the request in flight finish, a
request outliving the drain timeout ends the process with code 1, a second
signal exits at once. ``python -m unittest discover sdks/python/tests``."""

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

APP = textwrap.dedent(
    """
    import os, time
    from leasehold import App

    app = App(version="1")

    @app.kind("slow")
    def slow(ctx):
        # Says it started (the test signals then), then takes its time.
        open(ctx.input["started"], "w").close()
        time.sleep(ctx.input["s"])
        return {"slept": ctx.input["s"]}
    """
)


def invoke_body(started: str, s: float) -> bytes:
    return json.dumps(
        {
            "protocol": 1,
            "type": "invoke",
            "job": {"id": "j1", "kind": "slow", "input": {"started": started, "s": s}, "epoch": 1, "attempt": 1, "deadline": None},
            "journal": {"from": 0, "total": 0, "entries": [], "next_cursor": None},
        }
    ).encode()


class Serve(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        with open(os.path.join(self.dir.name, "slowapp.py"), "w") as f:
            f.write(APP)
        self.started = os.path.join(self.dir.name, "started")

    def tearDown(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.dir.cleanup()

    def start(self, drain: float):
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "leasehold", "serve", "slowapp:app", "--port", "0", "--drain-timeout", str(drain)],
            cwd=self.dir.name,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        self.assertTrue(line.startswith("listening on http://"), line)
        host, port = line.strip()[len("listening on http://"):].rsplit(":", 1)
        self.addr = (host, int(port))

    def call_in_background(self, s: float):
        """Sends one invoke taking `s` seconds; returns (thread, result box)."""
        box = {}

        def call():
            c = http.client.HTTPConnection(*self.addr, timeout=30)
            try:
                c.request("POST", "/invoke", body=invoke_body(self.started, s), headers={"Content-Type": "application/json"})
                r = c.getresponse()
                box["status"], box["body"] = r.status, json.loads(r.read())
            except Exception as e:  # noqa: BLE001 - recorded for the assertion
                box["error"] = e

        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 10
        while not os.path.exists(self.started):
            self.assertLess(time.monotonic(), deadline, "the request never started")
            time.sleep(0.01)
        return t, box

    def test_sigterm_lets_the_request_in_flight_finish_and_accepts_no_more(self):
        self.start(drain=10)
        t, box = self.call_in_background(1.0)
        self.proc.send_signal(signal.SIGTERM)
        # Accepting has stopped while the request still runs.
        deadline = time.monotonic() + 5
        while True:
            try:
                c = http.client.HTTPConnection(*self.addr, timeout=1)
                c.request("GET", "/healthz")
                c.getresponse().read()
                c.close()
            except OSError:
                break
            self.assertLess(time.monotonic(), deadline, "still accepting after SIGTERM")
            time.sleep(0.02)
        t.join(10)
        self.assertEqual(box.get("status"), 200, box)
        self.assertEqual(self.proc.wait(10), 0, self.proc.stderr.read())

    def test_a_request_outliving_the_drain_timeout_ends_the_stop_with_code_1(self):
        self.start(drain=0.5)
        t, _ = self.call_in_background(20)
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(10)
        took = time.monotonic() - t0
        err = self.proc.stderr.read()
        self.assertEqual(code, 1, err)
        self.assertLess(took, 0.5 + 1, f"took {took:.2f}s")
        self.assertIn("1 request(s) still running after the drain timeout", err)
        t.join(10)

    def test_a_second_signal_exits_at_once(self):
        self.start(drain=30)
        t, _ = self.call_in_background(20)
        self.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        self.assertIsNone(self.proc.poll(), "the first signal waits for the request")
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        self.assertEqual(self.proc.wait(5), 128 + signal.SIGINT)
        self.assertLess(time.monotonic() - t0, 1)
        t.join(10)


if __name__ == "__main__":
    unittest.main()
