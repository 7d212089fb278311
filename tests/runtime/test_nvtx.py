"""cudalab.nvtx: torch.cuda.nvtx's API, per-thread depth, and what reaches the nvtx package."""

from __future__ import annotations

import sys
import threading

import pytest

from cudalab import nvtx as cnvtx


class FakeDomain:
    """Records what cudalab would send to an enabled nvtx Domain."""

    def __init__(self):
        self.calls = []
        self.next_id = 1000

    def push_range(self, attrs):
        self.calls.append(("push", attrs))

    def pop_range(self):
        self.calls.append(("pop",))

    def mark(self, attrs):
        self.calls.append(("mark", attrs))

    def start_range(self, attrs):
        self.next_id += 1
        self.calls.append(("start", attrs, self.next_id))
        return self.next_id

    def end_range(self, rid):
        self.calls.append(("end", rid))


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Each test starts with an empty stack on this thread and its own attribute cache."""
    monkeypatch.setattr(cnvtx, "_attributes", {})
    monkeypatch.setattr(cnvtx, "_open_ranges", {})
    monkeypatch.setattr(cnvtx.thread_ranges, "messages", [], raising=False)  # never rebound
    # the pushes here must not leave the process-wide flag set for later tests (the history's
    # compact memo logging depends on it)
    monkeypatch.setattr(cnvtx, "ranges_used", cnvtx.ranges_used)
    yield


@pytest.fixture
def quiet(monkeypatch):
    """No profiler: nothing emitted, depth still tracked."""
    monkeypatch.setattr(cnvtx, "_domain", None)


@pytest.fixture
def domain(monkeypatch):
    dom = FakeDomain()
    monkeypatch.setattr(cnvtx, "_domain", dom)
    made = []

    def make(msg):
        made.append(msg)
        return ("attrs", msg)

    monkeypatch.setattr(cnvtx, "_make_attributes", make)
    dom.made = made
    return dom


# ------------------------------------------------------------------------ depth semantics
def test_push_pop_depths(quiet):
    assert cnvtx.range_push("a") == 0
    assert cnvtx.range_push("b") == 1
    assert cnvtx.range_push("c") == 2
    assert cnvtx.current_ranges() == ("a", "b", "c")
    assert cnvtx.current_range() == "c"
    assert cnvtx.range_pop() == 2
    assert cnvtx.range_pop() == 1
    assert cnvtx.current_ranges() == ("a",)
    assert cnvtx.range_pop() == 0
    assert cnvtx.range_pop() == -1  # over-pop: NVTX's error value
    assert cnvtx.range_pop() == -1
    assert cnvtx.range_push("again") == 0
    assert cnvtx.current_ranges() == ("again",)


def test_empty_thread_state(quiet):
    assert cnvtx.current_ranges() == ()
    assert cnvtx.current_range() is None
    assert cnvtx.range_pop() == -1


def test_depth_is_per_thread(quiet):
    cnvtx.range_push("main-1")
    cnvtx.range_push("main-2")
    seen = {}
    ready, release = threading.Event(), threading.Event()

    def worker():
        seen["empty"] = cnvtx.current_ranges()
        seen["push"] = cnvtx.range_push("worker")
        seen["inside"] = cnvtx.current_ranges()
        ready.set()
        release.wait(5)
        seen["pop"] = cnvtx.range_pop()
        seen["over"] = cnvtx.range_pop()

    t = threading.Thread(target=worker)
    t.start()
    assert ready.wait(5)
    assert cnvtx.current_ranges() == ("main-1", "main-2")  # untouched by the worker
    release.set()
    t.join()
    assert seen == {"empty": (), "push": 0, "inside": ("worker",), "pop": 0, "over": -1}
    assert cnvtx.range_pop() == 1


# ------------------------------------------------------------------------ range()
def test_range_context_manager(quiet):
    with cnvtx.range("outer") as value:
        assert value is None  # torch's contextmanager yields nothing
        assert cnvtx.current_ranges() == ("outer",)
        with cnvtx.range("step {} of {total}", 3, total=10):
            assert cnvtx.current_ranges() == ("outer", "step 3 of 10")
    assert cnvtx.current_ranges() == ()


def test_range_pops_on_exception(quiet):
    with pytest.raises(KeyError):
        with cnvtx.range("boom"):
            raise KeyError("x")
    assert cnvtx.current_ranges() == ()


def test_range_formats_like_torch(quiet):
    assert cnvtx.range("{{literal}}").msg == "{literal}"
    with pytest.raises(IndexError):
        cnvtx.range("needs {}")  # torch formats unconditionally too


def test_range_decorator(quiet):
    @cnvtx.range("work {}", "fn")
    def work(x, *, fail=False):
        """doc"""
        if fail:
            raise ValueError(x)
        return x * 2, cnvtx.current_ranges()

    assert work.__name__ == "work" and work.__doc__ == "doc"
    assert work(21) == (42, ("work fn",))
    assert cnvtx.current_ranges() == ()
    with pytest.raises(ValueError):
        work(1, fail=True)
    assert cnvtx.current_ranges() == ()


def test_range_decorator_recursion_and_reuse(quiet):
    r = cnvtx.range("rec")

    @r
    def rec(n):
        return cnvtx.current_ranges() if n == 0 else rec(n - 1)

    assert rec(3) == ("rec",) * 4
    with r:
        with r:
            assert cnvtx.current_ranges() == ("rec", "rec")
    assert cnvtx.current_ranges() == ()


# ------------------------------------------------------------------------ what is emitted
def test_push_pop_mark_reach_the_domain(domain):
    assert cnvtx.range_push("a") == 0
    assert cnvtx.range_push("b") == 1
    assert cnvtx.range_pop() == 1
    cnvtx.mark("m")
    assert cnvtx.range_pop() == 0
    assert cnvtx.range_pop() == -1  # not forwarded: NVTX would see an unbalanced pop
    cnvtx.range_push("a")
    assert domain.calls == [
        ("push", ("attrs", "a")), ("push", ("attrs", "b")), ("pop",),
        ("mark", ("attrs", "m")), ("pop",), ("push", ("attrs", "a")),
    ]
    assert domain.made == ["a", "b", "m"]  # attributes built once per message


def test_range_start_end(domain):
    r1 = cnvtx.range_start("load")
    r2 = cnvtx.range_start("load")
    assert isinstance(r1, int) and isinstance(r2, int) and r1 != r2
    assert cnvtx.current_ranges() == ()  # start/end ranges are not push ranges
    done = threading.Thread(target=cnvtx.range_end, args=(r1,))  # ends on another thread
    done.start()
    done.join()
    cnvtx.range_end(r2)
    cnvtx.range_end(r2)  # already ended: ignored
    cnvtx.range_end(123456789)  # unknown: ignored
    assert domain.calls == [
        ("start", ("attrs", "load"), 1001), ("start", ("attrs", "load"), 1002),
        ("end", 1001), ("end", 1002),
    ]


def test_range_start_end_quiet(quiet):
    rid = cnvtx.range_start("x")
    assert isinstance(rid, int)
    cnvtx.range_end(rid)


def test_attribute_cache_is_bounded(domain, monkeypatch):
    monkeypatch.setattr(cnvtx, "ATTRIBUTE_CACHE_SIZE", 16)
    for i in range(100):
        cnvtx.range_push(f"msg {i}")
        cnvtx.range_pop()
    assert len(cnvtx._attributes) <= 16
    assert "msg 99" in cnvtx._attributes


@pytest.mark.parametrize("mode", ["quiet", "domain"])
def test_non_str_message_raises(request, mode):
    request.getfixturevalue(mode)
    for call in (cnvtx.range_push, cnvtx.mark, cnvtx.range_start):
        with pytest.raises(TypeError):
            call(123)
    assert cnvtx.current_ranges() == ()


# ------------------------------------------------------------------------ the nvtx package
def test_without_nvtx_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # `import nvtx` fails
    monkeypatch.setattr(cnvtx, "_domain", cnvtx._UNSET)
    assert cnvtx.range_push("x") == 0
    assert cnvtx._domain is None  # resolved lazily, to "emit nothing"
    cnvtx.mark("m")
    with cnvtx.range("r"):
        assert cnvtx.current_ranges() == ("x", "r")
    assert cnvtx.range_pop() == 0
    cnvtx.range_end(cnvtx.range_start("s"))


def test_real_nvtx_without_profiler(monkeypatch):
    """With no tool attached nvtx gives a DummyDomain, which cudalab skips entirely."""
    pytest.importorskip("nvtx")
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.setattr(cnvtx, "_domain", cnvtx._UNSET)
    assert cnvtx.range_push("real") == 0
    assert cnvtx._domain is None
    assert cnvtx.range_pop() == 0


def test_private_nvtx_constructors_still_fit():
    """_attribute_factory registers strings through nvtx._lib directly; check it still works."""
    pytest.importorskip("nvtx")
    from types import SimpleNamespace

    from nvtx._lib.lib import DomainHandle

    handle = DomainHandle(None)  # the default domain's handle (NULL without a tool)
    fallback = []
    dom = SimpleNamespace(handle=handle, get_event_attributes=lambda m: fallback.append(m))
    make = cnvtx._attribute_factory(dom)
    attrs = make("hello")
    assert attrs.message.string == "hello"
    assert fallback == []  # the private path was used, not the unbounded-cache fallback


# ------------------------------------------------------------------------ Ctrl-C
@pytest.mark.parametrize("where", ["range_push", "range_pop"])
def test_ctrl_c_anywhere_in_push_or_pop_keeps_the_stack_and_nvtx_paired(domain, deferring, where):
    """An interrupt at any line of range_push / range_pop comes after it returns: NVTX's
    pushes minus pops always equal this thread's stack depth (collectives pop in a
    ``finally``, where an interrupt inside the pop would leave the range open)."""
    from tests.helpers.interrupts import count_events, interrupt_at

    code = getattr(cnvtx, where).__code__

    def op():
        if where == "range_push":
            cnvtx.range_push("r")
        else:
            cnvtx.range_pop()

    def traced(frame):
        return frame.f_code is code

    cnvtx.range_push("setup")
    n = count_events(op, traced)
    assert n >= 3
    for k in range(1, n + 1):
        if where == "range_pop":
            cnvtx.range_push("r")
        _, exc, tripped = interrupt_at(op, traced, k)
        assert tripped and isinstance(exc, KeyboardInterrupt), k
        pushes = sum(c[0] == "push" for c in domain.calls)
        pops = sum(c[0] == "pop" for c in domain.calls)
        assert pushes - pops == len(cnvtx.current_ranges()), k
