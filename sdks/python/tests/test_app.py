"""Unit tests of the SDK's protocol logic (no HTTP): replay, paging,
mismatch, ends, tools, signatures. ``python -m unittest discover sdks/python/tests``."""

import hashlib
import hmac
import time
import unittest

from leasehold import NOT_FOUND, App, Ctx, Fail, Found, Retry, ToolCall, ToolError
from leasehold._server import check_signature

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
        body = {"protocol": 1, "args": {"n": 1}, "idempotency_key": "ab" * 32, "job": {"id": "j", "epoch": 1}, "step": "effect:book#0"}
        st, out = app.run_tool("book", body)
        self.assertEqual(out["result"]["key"], "ab" * 32)
        st, out = app.run_tool("book", dict(body, args={"boom": True}))
        self.assertEqual(out["error"]["code"], "retryable")
        self.assertEqual(app.find_existing("book", dict(body, args={"there": True}))[1]["status"], "found")
        self.assertEqual(app.find_existing("book", body)[1]["status"], "not_found")
        self.assertEqual(app.run_tool("nope", body)[0], 404)


class Signature(unittest.TestCase):
    def test_the_workers_signature_is_checked_with_its_time(self):
        body = b'{"protocol":1}'
        t = int(time.time())
        sig = hmac.new(b"s", f"{t}.".encode() + body, hashlib.sha256).hexdigest()
        self.assertIsNone(check_signature("s", f"t={t},v1={sig}", body))
        self.assertIsNotNone(check_signature("other", f"t={t},v1={sig}", body))
        self.assertIsNotNone(check_signature("s", f"t={t},v1={sig}", body + b" "))
        self.assertIsNotNone(check_signature("s", f"t={t - 3600},v1={sig}", body))
        self.assertIsNotNone(check_signature("s", None, body))


if __name__ == "__main__":
    unittest.main()
