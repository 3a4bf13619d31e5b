"""Unit tests of the SDK's protocol logic (no HTTP): replay, paging,
mismatch, ends, tools, signatures. ``python -m unittest discover sdks/python/tests``."""

import hashlib
import hmac
import socket
import threading
import time
import unittest

from leasehold import NOT_FOUND, App, Ctx, Fail, Found, Retry, ToolCall, ToolError
from leasehold._server import Replays, _Handler, _HTTPServer, check_signature, signed_message

app = App(version="7")


@app.kind("k")
def k(ctx: Ctx):
    a = ctx.step("a", lambda: 1)
    b = ctx.step("a", lambda: a + 1)
    inv = ctx.effect("book", {"n": b}, business_key=f"book:{b}")
    answer = ctx.park("approval", "ok?")
    if ctx.input.get("fail"):
        raise Fail("no")
    if ctx.input.get("retry"):
        raise Retry("later", delay_ms=5)
    return {"a": a, "b": b, "inv": inv, "answer": answer}


@app.tool("book")
def book(args, call: ToolCall):
    if args.get("boom"):
        raise ToolError("down")
    return {"key": call.idempotency_key, "args": args}


@book.find_existing
def find(args, call: ToolCall):
    return Found({"found": True}) if args.get("there") else NOT_FOUND


def invoke(job_id, entries, start=0, total=None, inp=None, epoch=1):
    body = {
        "protocol": 1,
        "type": "invoke",
        "job": {"id": job_id, "kind": "k", "input": inp or {}, "epoch": epoch, "attempt": 1, "deadline": None},
        "journal": {"from": start, "total": len(entries) + start if total is None else total, "entries": entries, "next_cursor": None},
    }
    return app.invoke(body)[1]


def e(i, sid, r):
    return {"index": i, "id": sid, "result": r}


class Replay(unittest.TestCase):
    def test_steps_replay_in_order_and_the_first_new_one_is_the_answer(self):
        self.assertEqual(invoke("j1", [])["op"], "step")
        op = invoke("j2", [e(0, "a#0", 1)])
        self.assertEqual((op["op"], op["index"], op["id"], op["result"]), ("step", 1, "a#1", 2))
        op = invoke("j3", [e(0, "a#0", 1), e(1, "a#1", 2)])
        self.assertEqual((op["op"], op["tool"], op["business_key"], op["id"]), ("effect", "book", "book:2", "effect:book#0"))
        op = invoke("j4", [e(0, "a#0", 1), e(1, "a#1", 2), e(2, "effect:book#0", {"x": 1})])
        self.assertEqual((op["op"], op["reason"], op["id"]), ("park", "approval", "park#0"))
        full = [e(0, "a#0", 1), e(1, "a#1", 2), e(2, "effect:book#0", {"x": 1}), e(3, "park#0", {"approve": True})]
        op = invoke("j5", full)
        self.assertEqual(op["op"], "complete")
        self.assertEqual(op["output"]["answer"], {"approve": True})
        self.assertEqual(op["version"], "7")
        self.assertEqual(invoke("j6", full, inp={"fail": True})["op"], "fail")
        r = invoke("j7", full, inp={"retry": True})
        self.assertEqual((r["op"], r["delay_ms"]), ("retry", 5))

    def test_sleep_asks_for_a_durable_timer_once_and_returns_once_recorded(self):
        import datetime

        sleepy = App(version="1")

        @sleepy.kind("k")
        def nap(ctx: Ctx):
            ctx.sleep(1.5)
            ctx.sleep_until(datetime.datetime(2030, 1, 2, 3, 4, 5, 6000, tzinfo=datetime.timezone.utc))
            return {"done": True}

        def call(entries):
            body = {
                "protocol": 1,
                "type": "invoke",
                "job": {"id": "s1", "kind": "k", "input": {}, "epoch": 1, "attempt": 1, "deadline": None},
                "journal": {"from": 0, "total": len(entries), "entries": entries, "next_cursor": None},
            }
            return sleepy.invoke(body)[1]

        op = call([])
        self.assertEqual((op["op"], op["index"], op["id"], op["ms"]), ("sleep", 0, "sleep#0", 1500))
        s0 = e(0, "sleep#0", "2026-12-06T10:00:00.000Z")
        op = call([s0])
        self.assertEqual((op["op"], op["id"], op["until"]), ("sleep", "sleep#1", "2030-01-02T03:04:05.006Z"))
        self.assertNotIn("ms", op)
        op = call([s0, e(1, "sleep#1", "2030-01-02T03:04:05.006Z")])
        self.assertEqual((op["op"], op["output"]), ("complete", {"done": True}))
        with self.assertRaises(TypeError):
            Ctx.sleep(None, -1)  # type: ignore[arg-type]
        with self.assertRaises(TypeError):
            Ctx.sleep_until(None, datetime.datetime(2030, 1, 1))  # type: ignore[arg-type]

    def test_wait_for_asks_for_a_signal_once_and_returns_what_was_recorded(self):
        waiting = App(version="1")

        @waiting.kind("k")
        def hark(ctx: Ctx):
            first = ctx.wait_for("confirmation")
            second = ctx.wait_for("confirmation", timeout=2.5)
            return {"first": first, "second": second}

        def call(entries):
            body = {
                "protocol": 1,
                "type": "invoke",
                "job": {"id": "w1", "kind": "k", "input": {}, "epoch": 1, "attempt": 1, "deadline": None},
                "journal": {"from": 0, "total": len(entries), "entries": entries, "next_cursor": None},
            }
            return waiting.invoke(body)[1]

        op = call([])
        self.assertEqual((op["op"], op["index"], op["id"], op["name"]), ("wait_for", 0, "wait:confirmation#0", "confirmation"))
        self.assertNotIn("timeout_ms", op)
        got = {"name": "confirmation", "data": {"ok": True}, "seq": 7, "sent_at": "2026-12-06T10:00:00.000Z"}
        w0 = e(0, "wait:confirmation#0", got)
        op = call([w0])
        self.assertEqual((op["op"], op["id"], op["timeout_ms"]), ("wait_for", "wait:confirmation#1", 2500))
        op = call([w0, e(1, "wait:confirmation#1", None)])
        self.assertEqual((op["op"], op["output"]), ("complete", {"first": got, "second": None}))
        with self.assertRaises(TypeError):
            Ctx.wait_for(None, "no.dots")  # type: ignore[arg-type]
        with self.assertRaises(TypeError):
            Ctx.wait_for(None, "ok", timeout=-1)  # type: ignore[arg-type]

    def test_spawn_and_join_ask_the_worker_once_and_return_what_was_recorded(self):
        brood = App(version="1")

        @brood.kind("k")
        def fan(ctx: Ctx):
            kids = ctx.spawn_many("echo", [{"i": 0}, {"i": 1}], detach=True)
            return {"outcomes": ctx.join(kids)}

        def call(entries):
            body = {
                "protocol": 1,
                "type": "invoke",
                "job": {"id": "b1", "kind": "k", "input": {}, "epoch": 1, "attempt": 1, "deadline": None},
                "journal": {"from": 0, "total": len(entries), "entries": entries, "next_cursor": None},
            }
            return brood.invoke(body)[1]

        op = call([])
        self.assertEqual(
            (op["op"], op["index"], op["id"], op["kind"], op["inputs"], op["on_cancel"]),
            ("spawn", 0, "spawn:echo#0", "echo", [{"i": 0}, {"i": 1}], "detach"),
        )
        s0 = e(0, "spawn:echo#0", {"children": ["b1_x_0", "b1_x_1"], "on_cancel": "detach"})
        op = call([s0])
        self.assertEqual((op["op"], op["id"], op["children"]), ("join", "join#0", ["b1_x_0", "b1_x_1"]))
        outcomes = [{"id": "b1_x_0", "kind": "echo", "status": "completed", "result": {"i": 0}},
                    {"id": "b1_x_1", "kind": "echo", "status": "failed", "error": {"class": "terminal", "message": "no"}}]
        op = call([s0, e(1, "join#0", outcomes)])
        self.assertEqual((op["op"], op["output"]), ("complete", {"outcomes": outcomes}))
        with self.assertRaises(TypeError):
            Ctx.spawn_many(None, "no.dots", [{}])  # type: ignore[arg-type]
        with self.assertRaises(TypeError):
            Ctx.spawn_many(None, "echo", [1])  # type: ignore[arg-type, list-item]
        with self.assertRaises(TypeError):
            Ctx.join(None, [])  # type: ignore[arg-type]
        with self.assertRaises(TypeError):
            Ctx.wait_for(None, "lh-child")  # type: ignore[arg-type]

    def test_a_recorded_step_under_another_name_is_a_mismatch_naming_both(self):
        op = invoke("m1", [e(0, "x#0", 1)])
        self.assertEqual(op["op"], "journal_mismatch")
        self.assertIn("x#0", op["message"])
        self.assertIn("a#0", op["message"])

    def test_pages_accumulate_and_a_gap_asks_for_the_journal(self):
        op = invoke("p1", [e(0, "a#0", 1)], start=0, total=3)
        self.assertEqual(op, {"protocol": 1, "op": "journal", "from": 1})
        op = invoke("p1", [e(1, "a#1", 2), e(2, "effect:book#0", {})], start=1, total=3)
        self.assertEqual(op["op"], "park")
        # Another process (no cache) gets a delta: it asks from 0.
        op = invoke("p2", [e(3, "park#0", True)], start=3, total=4)
        self.assertEqual(op["op"], "journal")
        self.assertEqual(op["from"], 0)
        # A new epoch starts over.
        self.assertEqual(invoke("p1", [], epoch=2)["op"], "step")

    def test_unknown_kind_and_bad_requests_are_errors(self):
        st, out = app.invoke({"protocol": 1, "job": {"id": "x", "kind": "nope", "epoch": 1}, "journal": {}})
        self.assertEqual((st, out["error"]["code"]), (404, "unknown_kind"))
        st, out = app.invoke({"protocol": 1})
        self.assertEqual((st, out["error"]["code"]), (400, "bad_request"))


class Tools(unittest.TestCase):
    def test_a_tool_gets_its_key_and_errors_have_codes(self):
        body = {"protocol": 1, "type": "tool", "tool": "book", "args": {"n": 1}, "idempotency_key": "ab" * 32, "job": {"id": "j", "epoch": 1}, "step": "effect:book#0"}
        st, out = app.run_tool("book", body)
        self.assertEqual(out["result"]["key"], "ab" * 32)
        st, out = app.run_tool("book", dict(body, args={"boom": True}))
        self.assertEqual(out["error"]["code"], "retryable")
        find = dict(body, type="find_existing")
        self.assertEqual(app.find_existing("book", dict(find, args={"there": True}))[1]["status"], "found")
        self.assertEqual(app.find_existing("book", find)[1]["status"], "not_found")
        self.assertEqual(app.run_tool("nope", dict(body, tool="nope"))[0], 404)

    def test_a_body_made_for_another_endpoint_is_refused(self):
        # G10: a find_existing body, or another tool's, posted to a tool.
        body = {"protocol": 1, "type": "find_existing", "tool": "book", "args": {"n": 1}, "idempotency_key": "ab" * 32}
        st, out = app.run_tool("book", body)
        self.assertEqual((st, out["error"]["code"]), (400, "bad_request"))
        st, out = app.run_tool("book", dict(body, type="tool", tool="other"))
        self.assertEqual((st, out["error"]["code"]), (400, "bad_request"))
        st, out = app.find_existing("book", dict(body, type="tool"))
        self.assertEqual((st, out["error"]["code"]), (400, "bad_request"))


class GenerateWithTools(unittest.TestCase):
    def test_the_op_offers_the_named_tools_with_what_the_model_and_worker_need(self):
        a = App()

        @a.tool("lookup", read=True, description="Find it.", schema={"type": "object", "required": ["q"]})
        def lookup(args, call):
            return {"q": args["q"]}

        @a.tool("file", timeout_ms=2000, dedupes_by_key=True)
        def file(args, call):
            return None

        @a.kind("g")
        def g(ctx):
            return ctx.generate("go", tools=["lookup", "file"])

        @a.kind("bad")
        def bad(ctx):
            return ctx.generate("go", tools=["nope"])

        def call(kind, entries=()):
            body = {"protocol": 1, "type": "invoke", "job": {"id": kind, "kind": kind, "input": {}, "epoch": 1}, "journal": {"from": 0, "total": len(entries), "entries": list(entries)}}
            return a.invoke(body)[1]

        op = call("g")
        self.assertEqual(op["op"], "generate")
        self.assertEqual(
            op["tools"],
            [
                {"name": "lookup", "kind": "read", "description": "Find it.", "schema": {"type": "object", "required": ["q"]}},
                {"name": "file", "kind": "write", "timeout_ms": 2000, "dedupes_by_key": True},
            ],
        )
        # Recorded: replayed without asking (no tools needed then).
        out = call("g", [e(0, "generate:generate#0", {"text": "t", "json": None, "model_calls": 2})])
        self.assertEqual(out["output"]["model_calls"], 2)
        # A tool the app does not have is the kind's bug: retried, named.
        op = call("bad")
        self.assertEqual(op["op"], "retry")
        self.assertIn("no tool `nope`", op["message"])


class Signature(unittest.TestCase):
    def test_the_workers_signature_is_checked_with_its_time(self):
        body = b'{"protocol":1}'
        t = int(time.time())
        sig = hmac.new(b"s", signed_message(t, "n1", "POST", "/invoke", body), hashlib.sha256).hexdigest()
        h = f"t={t},n=n1,v2={sig}"
        self.assertIsNone(check_signature("s", h, body))
        self.assertIsNotNone(check_signature("other", h, body))
        self.assertIsNotNone(check_signature("s", h, body + b" "))
        self.assertIsNotNone(check_signature("s", h.replace(f"t={t}", f"t={t - 3600}"), body))
        self.assertIsNotNone(check_signature("s", None, body))

    def test_a_signature_binds_its_endpoint_and_is_served_once(self):
        # G10: the signature of a find_existing call replayed to a tool,
        # or to the same endpoint again, is refused.
        body = b'{"protocol":1,"type":"find_existing","tool":"a"}'
        t = int(time.time())
        path = "/tools/a/find_existing"
        sig = hmac.new(b"s", signed_message(t, "n2", "POST", path, body), hashlib.sha256).hexdigest()
        h = f"t={t},n=n2,v2={sig}"
        seen = Replays()
        self.assertIn("does not match", check_signature("s", h, body, path="/tools/b", seen=seen))
        self.assertIn("does not match", check_signature("s", h, body, path="/tools/a", seen=seen))
        self.assertIsNone(check_signature("s", h, body, path=path, seen=seen))
        self.assertIn("used before", check_signature("s", h, body, path=path, seen=seen))
        # The old scheme (t.body, no nonce) binds neither: refused.
        old = hmac.new(b"s", f"{t}.".encode() + body, hashlib.sha256).hexdigest()
        self.assertIsNotNone(check_signature("s", f"t={t},v1={old}", body, path=path))

    def test_seen_nonces_leave_with_their_window(self):
        r = Replays(tolerance_s=10)
        self.assertTrue(r.first_time("a", 100, 100))
        self.assertFalse(r.first_time("a", 100, 105))
        self.assertTrue(r.first_time("b", 120, 120))
        self.assertNotIn("a", r._seen)


class Server(unittest.TestCase):
    """The HTTP checks, against the real handler on a socket."""

    @classmethod
    def setUpClass(cls):
        handler = type("H", (_Handler,), {"app": app, "token": "tok", "secret": None, "max_body": 1024, "replays": Replays()})
        cls.httpd = _HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=cls.httpd.serve_forever, daemon=True).start()

    @classmethod
    def tearDownClass(cls):
        cls.httpd.shutdown()
        cls.httpd.server_close()

    def raw(self, head: str, body: bytes = b"") -> str:
        with socket.create_connection(self.httpd.server_address, timeout=5) as s:
            s.sendall(head.encode() + b"\r\n" + body)
            return s.recv(65536).decode(errors="replace")

    def test_a_negative_or_bad_content_length_is_refused_before_reading(self):
        # G10: rfile.read(-1) would read until the peer closes, unbounded.
        for n in ["-1", "x"]:
            out = self.raw(f"POST /invoke HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer tok\r\nContent-Length: {n}\r\n")
            self.assertTrue(out.startswith("HTTP/1.1 400"), out)
            self.assertIn("bad_request", out)

    def test_the_bearer_token_is_required(self):
        body = b'{"protocol": 1}'
        head = "POST /invoke HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n%s"
        out = self.raw(head % (len(body), "Authorization: Bearer nope\r\n"), body)
        self.assertTrue(out.startswith("HTTP/1.1 401"), out)
        out = self.raw(head % (len(body), "Authorization: Bearer tok\r\n"), body)
        self.assertTrue(out.startswith("HTTP/1.1 400"), out)


if __name__ == "__main__":
    unittest.main()
