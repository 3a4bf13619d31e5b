"""The protocol's logic, without HTTP: kinds, tools, the replay of a journal."""

from __future__ import annotations

import datetime
import re
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

PROTOCOL = 1

JSON = Any


class Fail(Exception):
    """Ends the job as failed (terminal: never retried)."""


class Retry(Exception):
    """Ends this attempt at once; the worker retries the job after
    ``delay_ms`` at least (the job waits queued, holding no slot, however
    long), or after the job's backoff when that is longer."""

    def __init__(self, message: str, delay_ms: int = 0) -> None:
        super().__init__(message)
        self.delay_ms = delay_ms


class ToolError(Exception):
    """A tool's failure: ``code`` is ``retryable`` (the default: the
    worker reconciles with ``find_existing`` and tries again), ``terminal``
    (the effect did not and will not happen) or ``conflict``."""

    def __init__(self, message: str, code: str = "retryable") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Found:
    """``find_existing``: the effect happened; this is its result."""

    result: JSON


class NotFound:
    """``find_existing``: the destination has no such effect."""


NOT_FOUND = NotFound()


@dataclass
class Unavailable:
    """``find_existing``: the destination cannot be asked now (ask later)."""

    message: str


@dataclass
class Unknowable:
    """``find_existing``: nobody can tell; the job parks for a person."""

    message: str


Reconcile = Union[Found, NotFound, Unavailable, Unknowable]


@dataclass
class Job:
    """The job of one call, as the worker sent it."""

    id: str
    kind: str
    input: JSON
    epoch: int
    attempt: int
    deadline: Optional[str]


@dataclass
class ToolCall:
    """What a tool execution knows of its call."""

    job_id: str
    epoch: int
    step: str
    idempotency_key: str
    business_key: Optional[str]


#: What a signal's name may be: one subject token (``lh.signal.<job>.<name>``).
_SIGNAL_NAME = re.compile(r"(?!lh-)[A-Za-z0-9_-]{1,64}")
_KIND = re.compile(r"[A-Za-z0-9_-]+")


class _Answer(Exception):
    """Unwinds the function with the one op this call answers."""

    def __init__(self, op: Dict[str, JSON]) -> None:
        super().__init__(op.get("op"))
        self.op = op


class Ctx:
    """One replay of one job: its input, and the durable operations.

    The function runs again on every call; ``step``, ``effect`` and ``park``
    return what the journal recorded, and the first one that is not
    recorded ends the call with it.
    """

    def __init__(
        self,
        job: Job,
        entries: List[Dict[str, JSON]],
        version: str,
        tools: Optional[Dict[str, "Tool"]] = None,
    ) -> None:
        self.job = job
        self._tools = tools or {}
        self._entries = entries
        self._pos = 0
        self._occurrences: Dict[str, int] = {}
        self._version = version

    @property
    def input(self) -> JSON:
        """The submission's input."""
        return self.job.input

    def _id(self, name: str) -> str:
        n = self._occurrences.get(name, 0)
        self._occurrences[name] = n + 1
        return f"{name}#{n}"

    def _replay(self, sid: str) -> Tuple[bool, JSON, int]:
        i = self._pos
        if i < len(self._entries):
            e = self._entries[i]
            if e.get("id") != sid:
                raise _Answer(
                    {
                        "op": "journal_mismatch",
                        "index": i,
                        "recorded": e.get("id"),
                        "requested": sid,
                        "message": (
                            f"journal mismatch at step {i}: the recorded run has `{e.get('id')}`, "
                            f"the code now asks for `{sid}` (kind version {self._version!r}): the "
                            "service's code changed while the job ran; restore the code and "
                            "`leasehold review resume` the job, or end it with `leasehold review fail`"
                        ),
                    }
                )
            self._pos += 1
            return True, e.get("result"), i
        return False, None, i

    def step(self, name: str, fn: Callable[[], JSON]) -> JSON:
        """A durable step: ``fn()`` runs until its result is recorded, then
        never again for this job (the recorded result is returned). Its id
        is ``name#occurrence``. ``fn`` may run more than once if a process
        dies before the record lands: keep external writes in ``effect``."""
        sid = self._id(name)
        hit, value, i = self._replay(sid)
        if hit:
            return value
        result = fn()
        raise _Answer({"op": "step", "index": i, "id": sid, "result": result})

    def effect(
        self,
        tool: str,
        args: JSON,
        business_key: Optional[str] = None,
        timeout_ms: Optional[int] = None,
        dedupes_by_key: bool = False,
    ) -> JSON:
        """A write through the worker's effects ledger, at most once ever:
        the worker calls this service's tool ``tool`` with a stable
        idempotency key, reconciles an unknown outcome with its
        ``find_existing``, and answers a later effect with the same
        ``business_key`` with the first one's result. Returns the result.

        ``dedupes_by_key``: the destination deduplicates by the idempotency
        key, so after ``find_existing`` answers ``NOT_FOUND`` the worker may
        call the tool again; otherwise such an outcome parks the job
        (``uncertain_effect``) for a person."""
        sid = self._id(f"effect:{tool}")
        hit, value, i = self._replay(sid)
        if hit:
            return value
        op: Dict[str, JSON] = {
            "op": "effect",
            "index": i,
            "id": sid,
            "tool": tool,
            "args": args,
            "business_key": business_key,
        }
        if dedupes_by_key:
            op["dedupes_by_key"] = True
        if timeout_ms is not None:
            op["timeout_ms"] = timeout_ms
        raise _Answer(op)

    def generate(
        self,
        prompt: str,
        system: str = "",
        model: str = "main",
        schema: Optional[Dict[str, JSON]] = None,
        name: str = "generate",
        tools: Optional[List[str]] = None,
    ) -> Dict[str, JSON]:
        """A model call run by the worker with its agent runtime
        (generation retries, the breaker, the fallback model, budgets, the
        transcript journal: a kill -9 repeats at most the call in flight),
        recorded as a step ``generate:<name>#n``. Returns ``{"text",
        "json" (with ``schema``: the validated answer), "model_calls"}``.

        ``tools``: names of this app's tools the model may call. The worker
        runs a read tool (``@app.tool(name, read=True)``) by calling this
        service's ``/tools/{name}``, and a write tool through its effects
        ledger exactly as :meth:`effect` (once ever, reconciled with its
        ``find_existing``)."""
        sid = self._id(f"generate:{name}")
        hit, value, i = self._replay(sid)
        if hit:
            return value
        offered = [self._tool_spec(t) for t in (tools or [])]
        op: Dict[str, JSON] = {"op": "generate", "index": i, "id": sid, "prompt": prompt, "system": system, "model": model}
        if schema is not None:
            op["schema"] = schema
        if offered:
            op["tools"] = offered
        raise _Answer(op)

    def _tool_spec(self, name: str) -> Dict[str, JSON]:
        t = self._tools.get(name)
        if t is None:
            raise ValueError(f"generate: no tool `{name}` on this app (it has {sorted(self._tools)})")
        spec: Dict[str, JSON] = {"name": t.name, "kind": "read" if t.read else "write"}
        if t.description:
            spec["description"] = t.description
        if t.schema is not None:
            spec["schema"] = t.schema
        if t.timeout_ms is not None:
            spec["timeout_ms"] = t.timeout_ms
        if t.dedupes_by_key:
            spec["dedupes_by_key"] = True
        return spec

    def park(self, reason: str, question: str) -> JSON:
        """Stops for a person; returns their answer once the job is resumed
        (``leasehold review resume ID --answer JSON``). The op names this
        park's step (``id``, ``park#n``); the worker records as this step
        only an answer given for that id after its park, so a second park
        of the same run parks and asks again: it never gets the first
        one's answer."""
        sid = self._id("park")
        hit, value, i = self._replay(sid)
        if hit:
            return value
        raise _Answer({"op": "park", "index": i, "id": sid, "reason": reason, "question": question})

    def sleep(self, seconds: float) -> None:
        """A durable timer: waits ``seconds`` holding no worker. The first
        time, the attempt ends and the job is ``waiting`` (no slot, no
        attempt spent); at its time any worker calls the service again and
        this ``sleep`` returns (recorded as step ``sleep#n``). A kill -9, or
        a restart of the whole fleet, meanwhile changes nothing. The wait
        starts when the worker records it."""
        if not isinstance(seconds, (int, float)) or seconds < 0:
            raise TypeError(f"sleep: seconds must be a number >= 0, not {seconds!r}")
        self._sleep({"ms": int(seconds * 1000)})

    def sleep_until(self, at: "datetime.datetime") -> None:
        """:meth:`sleep` until the time ``at`` (a timezone-aware datetime);
        a time already past returns at once."""
        if not isinstance(at, datetime.datetime) or at.tzinfo is None:
            raise TypeError(f"sleep_until: a timezone-aware datetime, not {at!r}")
        utc = at.astimezone(datetime.timezone.utc)
        self._sleep({"until": utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"})

    def wait_for(self, name: str, timeout: Optional[float] = None) -> Optional[Dict[str, JSON]]:
        """Waits for the signal ``name``, holding no worker, at most
        ``timeout`` seconds (``None``: for as long as it takes). A signal
        is sent with ``leasehold signal ID NAME --data JSON``, from the
        console, or published on ``lh.signal.<job>.<name>``; one sent
        before the wait is kept for it, and two of one name are two waits'
        answers, in the order sent. Returns the signal (a dict: ``name``,
        ``data``, ``seq``, ``sent_at`` and, when the sender said,
        ``sender``), or ``None`` after the timeout; recorded as step
        ``wait:<name>#n``."""
        if not isinstance(name, str) or not _SIGNAL_NAME.fullmatch(name):
            raise TypeError(f"wait_for: a signal name is 1-64 letters, digits, '-' or '_', not starting with 'lh-', not {name!r}")
        op: Dict[str, JSON] = {"op": "wait_for", "name": name}
        if timeout is not None:
            if not isinstance(timeout, (int, float)) or timeout < 0:
                raise TypeError(f"wait_for: timeout must be a number of seconds >= 0 or None, not {timeout!r}")
            op["timeout_ms"] = int(timeout * 1000)
        sid = self._id(f"wait:{name}")
        hit, value, i = self._replay(sid)
        if hit:
            return value  # type: ignore[return-value]
        raise _Answer({**op, "index": i, "id": sid})

    def spawn(self, kind: str, input: Dict[str, JSON], detach: bool = False) -> str:
        """Starts one child job of ``kind`` with ``input``: see
        :meth:`spawn_many`. Returns the child's id."""
        return self.spawn_many(kind, [input], detach=detach)[0]

    def spawn_many(self, kind: str, inputs: List[Dict[str, JSON]], detach: bool = False) -> List[str]:
        """Starts one child job of ``kind`` per input, as one durable step
        (``spawn:<kind>#n``), and returns their ids. Each child is a job of
        its own (its own retries, budget and events), of this job's tenant
        and priority; its id is derived from this job, its incarnation and
        the step, so a job resumed after a crash never starts a second
        set. A cancel of this job cancels them, unless ``detach``."""
        if not isinstance(kind, str) or not _KIND.fullmatch(kind):
            raise TypeError(f"spawn: a kind is letters, digits, '-' or '_', not {kind!r}")
        if not isinstance(inputs, list) or not all(isinstance(i, dict) for i in inputs):
            raise TypeError("spawn: inputs is a list of dicts, one per child")
        sid = self._id(f"spawn:{kind}")
        hit, value, i = self._replay(sid)
        if hit:
            return list(value["children"])  # type: ignore[index]
        op: Dict[str, JSON] = {"op": "spawn", "index": i, "id": sid, "kind": kind, "inputs": inputs}  # type: ignore[dict-item]
        if detach:
            op["on_cancel"] = "detach"
        raise _Answer(op)

    def join(self, children: List[str]) -> List[Dict[str, JSON]]:
        """Waits for ``children`` (ids :meth:`spawn_many` returned) to end,
        holding no worker, as a durable step (``join#n``), and returns each
        one's outcome in their order: a dict with ``id``, ``kind``,
        ``status`` and ``result`` (completed) or ``error`` (``class``,
        ``message``). A child's failure is an outcome, not an exception.
        The last child's end wakes this job once, on any worker."""
        if not isinstance(children, list) or not children or not all(isinstance(c, str) for c in children):
            raise TypeError("join: children is a non-empty list of child ids")
        sid = self._id("join")
        hit, value, i = self._replay(sid)
        if hit:
            return value  # type: ignore[return-value]
        raise _Answer({"op": "join", "index": i, "id": sid, "children": children})  # type: ignore[dict-item]

    def spawn_and_wait(self, kind: str, input: Dict[str, JSON]) -> Dict[str, JSON]:
        """Starts one child and waits for its end: its outcome."""
        return self.join([self.spawn(kind, input)])[0]

    def _sleep(self, when: Dict[str, JSON]) -> None:
        sid = self._id("sleep")
        hit, _, i = self._replay(sid)
        if hit:
            return
        raise _Answer({"op": "sleep", "index": i, "id": sid, **when})


KindFn = Callable[[Ctx], JSON]
ToolFn = Callable[[JSON, ToolCall], JSON]
FindFn = Callable[[JSON, ToolCall], Reconcile]


@dataclass
class Tool:
    """A write tool the worker calls through its ledger."""

    name: str
    fn: ToolFn
    find: Optional[FindFn] = None
    #: A read (no effect on the world: called directly, maybe more than
    #: once) rather than a write (through the ledger, once ever).
    read: bool = False
    #: What the model is told of the tool (``generate``'s ``tools``).
    description: str = ""
    #: JSON Schema of the arguments the model gives it.
    schema: Optional[Dict[str, JSON]] = None
    timeout_ms: Optional[int] = None
    dedupes_by_key: bool = False

    def find_existing(self, fn: FindFn) -> FindFn:
        """Registers the lookup asked before any retry of an effect whose
        outcome is unknown: ``Found(result)``, ``NOT_FOUND``,
        ``Unavailable(msg)`` or ``Unknowable(msg)``."""
        self.find = fn
        return fn


def error(code: str, message: str) -> Dict[str, JSON]:
    return {"protocol": PROTOCOL, "error": {"code": code, "message": message}}


@dataclass
class App:
    """The kinds and tools one service serves."""

    version: str = "1"
    kinds: Dict[str, KindFn] = field(default_factory=dict)
    tools: Dict[str, Tool] = field(default_factory=dict)
    _cache: "OrderedDict[Tuple[str, int], List[Dict[str, JSON]]]" = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    cache_jobs: int = 1024

    def kind(self, name: str) -> Callable[[KindFn], KindFn]:
        """Registers a kind: ``@app.kind("invoice")``."""

        def register(fn: KindFn) -> KindFn:
            self.kinds[name] = fn
            return fn

        return register

    def tool(
        self,
        name: str,
        read: bool = False,
        description: str = "",
        schema: Optional[Dict[str, JSON]] = None,
        timeout_ms: Optional[int] = None,
        dedupes_by_key: bool = False,
    ) -> Callable[[ToolFn], Tool]:
        """Registers a tool: ``@app.tool("create_invoice")``; the function
        gets the arguments and a :class:`ToolCall` (send its
        ``idempotency_key`` to the destination). A write by default;
        ``read=True`` for one that changes nothing (a model may call it
        directly, more than once). ``description``, ``schema`` (of the
        arguments), ``timeout_ms`` and ``dedupes_by_key`` are what a
        ``generate`` offering the tool tells the model and the worker."""

        def register(fn: ToolFn) -> Tool:
            t = Tool(name, fn, read=read, description=description, schema=schema, timeout_ms=timeout_ms, dedupes_by_key=dedupes_by_key)
            self.tools[name] = t
            return t

        return register

    # -- the protocol -----------------------------------------------------

    def _journal(self, job: Job, journal: Dict[str, JSON]) -> Tuple[List[Dict[str, JSON]], Optional[int]]:
        """The whole journal, from this call's page and the cache, or the
        cursor to ask for."""
        key = (job.id, job.epoch)
        start = int(journal.get("from", 0))
        page = list(journal.get("entries") or [])
        total = int(journal.get("total", start + len(page)))
        with self._lock:
            have = self._cache.get(key, [])
            if start > len(have):
                return have, len(have)
            entries = have[:start] + page
            self._cache[key] = entries
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_jobs:
                self._cache.popitem(last=False)
        if len(entries) < total:
            return entries, len(entries)
        return entries, None

    def invoke(self, body: Dict[str, JSON]) -> Tuple[int, Dict[str, JSON]]:
        """One `invoke` call: the HTTP status and the answer."""
        bad = self._mismatch(body, "invoke") if "type" in body else None
        if bad is not None:
            return bad
        try:
            j = body["job"]
            job = Job(
                id=str(j["id"]),
                kind=str(j["kind"]),
                input=j.get("input"),
                epoch=int(j["epoch"]),
                attempt=int(j.get("attempt", 1)),
                deadline=j.get("deadline"),
            )
            journal = body.get("journal") or {}
        except (KeyError, TypeError, ValueError) as e:
            return 400, error("bad_request", f"not an invoke request: {e!r}")
        fn = self.kinds.get(job.kind)
        if fn is None:
            return 404, error("unknown_kind", f"this service has no kind `{job.kind}` (it has {sorted(self.kinds)})")
        entries, cursor = self._journal(job, journal)
        if cursor is not None:
            return 200, {"protocol": PROTOCOL, "op": "journal", "from": cursor}
        ctx = Ctx(job, entries, self.version, self.tools)
        try:
            output = fn(ctx)
            op: Dict[str, JSON] = {"op": "complete", "output": output}
        except _Answer as a:
            op = a.op
        except Fail as e:
            op = {"op": "fail", "message": str(e)}
        except Retry as e:
            op = {"op": "retry", "message": str(e), "delay_ms": e.delay_ms}
        except Exception as e:  # a bug in the kind: retried, with its trace
            tb = traceback.format_exc(limit=5)
            op = {"op": "retry", "message": f"{type(e).__name__}: {e}\n{tb}", "delay_ms": 0}
        op["protocol"] = PROTOCOL
        op["version"] = self.version
        return 200, op

    def _call(self, body: Dict[str, JSON]) -> ToolCall:
        j = body.get("job") or {}
        return ToolCall(
            job_id=str(j.get("id", "")),
            epoch=int(j.get("epoch", 0)),
            step=str(body.get("step", "")),
            idempotency_key=str(body.get("idempotency_key", "")),
            business_key=body.get("business_key"),
        )

    @staticmethod
    def _mismatch(body: Dict[str, JSON], kind: str, name: Optional[str] = None) -> Optional[Tuple[int, Dict[str, JSON]]]:
        """A request whose ``type`` (and ``tool``) is not the endpoint's: a
        body sent to another endpoint than the one it was made for."""
        if body.get("type") != kind or (name is not None and body.get("tool") != name):
            what = f"`{kind}` request" + (f" for tool `{name}`" if name is not None else "")
            return 400, error("bad_request", f"this endpoint takes a {what}; the body is a `{body.get('type')}` request for {body.get('tool')!r}")
        return None

    def run_tool(self, name: str, body: Dict[str, JSON]) -> Tuple[int, Dict[str, JSON]]:
        """One `tool` call."""
        bad = self._mismatch(body, "tool", name)
        if bad is not None:
            return bad
        t = self.tools.get(name)
        if t is None:
            return 404, error("terminal", f"this service has no tool `{name}`")
        try:
            result = t.fn(body.get("args"), self._call(body))
        except ToolError as e:
            return 200, error(e.code, str(e))
        except Exception as e:
            return 200, error("retryable", f"{type(e).__name__}: {e}")
        return 200, {"protocol": PROTOCOL, "result": result}

    def find_existing(self, name: str, body: Dict[str, JSON]) -> Tuple[int, Dict[str, JSON]]:
        """One `find_existing` call."""
        bad = self._mismatch(body, "find_existing", name)
        if bad is not None:
            return bad
        t = self.tools.get(name)
        if t is None:
            return 404, error("terminal", f"this service has no tool `{name}`")
        if t.find is None:
            return 200, {"protocol": PROTOCOL, "status": "unknowable", "message": f"`{name}` has no find_existing"}
        try:
            r = t.find(body.get("args"), self._call(body))
        except Exception as e:
            return 200, {"protocol": PROTOCOL, "status": "unavailable", "message": f"{type(e).__name__}: {e}"}
        if isinstance(r, Found):
            return 200, {"protocol": PROTOCOL, "status": "found", "result": r.result}
        if isinstance(r, Unavailable):
            return 200, {"protocol": PROTOCOL, "status": "unavailable", "message": r.message}
        if isinstance(r, Unknowable):
            return 200, {"protocol": PROTOCOL, "status": "unknowable", "message": r.message}
        return 200, {"protocol": PROTOCOL, "status": "not_found"}
