"""A dataset whose ``__getitem__`` only subscripts containers it holds is read without the watch for
draws (``ddpkit.data._held_reads``): the proof is exact over the code it accepts,
what it assumed is checked before every batch, and anything else is watched and seeded as before."""

from __future__ import annotations

import abc
import random
import sys
import textwrap
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpkit
import ddpkit.data._held_reads as held_reads_module
import ddpkit.data._sample_seeding as sample_seeding
from ddpkit.data import SeededSamples
from ddpkit.data._held_reads import held_reads
from ddpkit.data._sampler import EpochIndices

N = 12


class Held(torch.utils.data.Dataset):
    """pytorch/examples' dataset: samples in a list, read as they are."""

    def __init__(self) -> None:
        self.data = [(torch.rand(3), torch.rand(1)) for _ in range(N)]

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int):
        return self.data[index]


class DrawingList(list):
    """A list whose reads draw, as an augmentation would."""

    def __getitem__(self, index):
        return super().__getitem__(index), random.random(), torch.rand(()).item()


def _unwatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a read of the generators' states fail the test."""

    def fail():
        raise AssertionError("the generators were read around a batch")

    monkeypatch.setattr(sample_seeding, "draw_marks", fail)


def _class(body: str, base: type = Held) -> type:
    namespace = {"random": random, "torch": torch, "G": list(range(N)), "base": base}
    source = "class Made(base):\n    def __getitem__(self, i):\n" + textwrap.indent(body, " " * 8)
    exec(source, namespace)
    return namespace["Made"]


def _instance(cls: type) -> Held:
    ds = cls()
    ds.a, ds.b = list(range(N)), tuple(range(N))
    ds.t, ds.n = torch.arange(N), np.arange(N)
    ds.c = type("C", (), {"d": list(range(N))})()
    ds.m = lambda i: random.random()
    return ds


PROVEN = [
    "return self.data[i]",
    "return self.a[i], self.b[i]",
    "return [self.t[i], self.n[i], 0]",
    "x = self.t[i]\ny = self.a[i]\nreturn x, y",
    "return self",
    "return None",
    "return {'x': self.a[i], 'y': self.t[i]}",
]
WATCHED = [
    "return self.data[i], random.random()",  # a call
    "return len(self.a)",
    "return self.m(i)",  # a method's call
    "return G[i]",  # a global
    "return self.c.d[i]",  # an attribute of an attribute
    "return self.data[i][0]",  # a subscript of what a subscript gave: any object
    "return self.a[i + 1]",  # arithmetic on the index may run code (__add__)
    "return self.a[-1]",  # not the index
    "return self.a[i] if i else self.b[i]",  # a jump
    "return {self.a[i]: 0}",  # a key of any type: its hash may run code
    "try:\n    return self.a[i]\nexcept IndexError:\n    return random.random()",  # a handler
    "x, y = self.data[i]\nreturn x",  # unpacking runs the element's __iter__
    "yield self.a[i]",
]


@pytest.mark.parametrize("body", PROVEN)
def test_a_read_of_held_containers_is_not_watched(body, monkeypatch):
    ds = _instance(_class(body))
    assert held_reads(ds) is not None
    expected = [ds[i] for i in range(N)]
    _unwatched(monkeypatch)
    got = SeededSamples(ds, seed=3).__getitems__(EpochIndices(list(range(N)), 0))
    assert [repr(x) for x in got] == [repr(x) for x in expected]


@pytest.mark.parametrize("body", WATCHED)
def test_a_read_that_may_run_code_is_watched(body):
    assert held_reads(_instance(_class(body))) is None


def test_a_class_that_runs_code_on_attribute_reads_is_watched():
    class Property(Held):
        def __init__(self) -> None:
            pass

        @property
        def data(self):
            return DrawingList(range(N))

    class Lookup(Held):
        def __getattribute__(self, name):
            random.random()
            return super().__getattribute__(name)

    class Slots:
        __slots__ = ("data",)

        def __getitem__(self, i):
            return self.data[i]

    slots = Slots()
    slots.data = list(range(N))
    # a proof is made, but what it read is not where it looked: a class attribute of that name
    assert held_reads(Property()) is not None and not held_reads(Property()).hold(Property(), [0])
    assert held_reads(Lookup()) is None
    proof = held_reads(slots)
    assert proof is None or not proof.hold(slots, [0])


def _drawing_batch(ds: Held, keys: EpochIndices) -> list:
    """What ``keys`` read from ``ds`` when each sample is seeded (the watch finds the draws)."""
    fresh = SeededSamples(ds, seed=3)
    fresh._proof, fresh._proof_made = None, True  # never proven: always watched
    return fresh.__getitems__(keys)


CHANGES = {
    "an attribute replaced by a container that draws": lambda ds: setattr(
        ds, "data", DrawingList(ds.data)
    ),
    "a property of that name set on the class": lambda ds: setattr(
        type(ds), "data", property(lambda self: DrawingList(range(N)))
    ),
    "the instance given another class": lambda ds: setattr(
        ds, "__class__", type("Other", (Held,), {"__getitem__": lambda self, i: random.random()})
    ),
    "__getitem__ replaced on the class": lambda ds: setattr(
        type(ds), "__getitem__", lambda self, i: (self.data[i], random.random())
    ),
    "the function's code replaced": lambda ds: setattr(
        type(ds).__getitem__,
        "__code__",
        (lambda self, index: (self.data[index], random.random())).__code__,
    ),
}


@pytest.mark.parametrize("check", [True, False], ids=["checked", "control-unchecked"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_what_a_proof_assumed_is_checked_before_every_batch(change, check, monkeypatch):
    """After a first batch read without the watch, the dataset changes so that its reads draw: the
    next batch is watched, and each sample's draws are the seeded ones. Control: without the check
    the draws of that batch are the process's own stream's, not the seeded ones."""
    cls = type("Local", (Held,), {"__getitem__": _fresh_getitem()})
    ds = cls()
    samples = SeededSamples(ds, seed=3)
    first = EpochIndices([0, 1, 2], 0)
    samples.__getitems__(first)
    assert samples._proof is not None
    if not check:
        monkeypatch.setattr(held_reads_module.HeldReads, "hold", lambda *_: True)
    CHANGES[change](ds)
    keys = EpochIndices([3, 4, 5], 1)
    random.seed(99), torch.manual_seed(99)
    got = [repr(x) for x in samples.__getitems__(keys)]
    random.seed(99), torch.manual_seed(99)
    seeded = [repr(x) for x in _drawing_batch(ds, keys)]
    assert (got == seeded) is check


def _fresh_getitem():
    """A new function with Held.__getitem__'s code, so a test may replace its ``__code__``."""

    def __getitem__(self, index: int):
        return self.data[index]

    return __getitem__


@st.composite
def _bodies(draw) -> tuple[str, bool]:
    """A ``__getitem__`` body from pieces that read held containers and pieces that may run code;
    True where every piece is one of the former."""
    pure = ["self.a[i]", "self.b[i]", "self.t[i]", "self.n[i]", "i", "0", "self"]
    other = [
        "self.data[i][0]",
        "len(self.a)",
        "random.random()",
        "self.m(i)",
        "self.c.d[i]",
        "G[i]",
        "self.a[i + 0]",
        "self.a[0]",
        "(self.a[i] if i else 1)",
        "torch.rand(())",
    ]
    pieces = draw(st.lists(st.sampled_from(pure + other), min_size=1, max_size=4))
    form = draw(st.sampled_from(["tuple", "list", "locals", "one"]))
    if form == "one":
        body = f"return {pieces[0]}"
        pieces = pieces[:1]
    elif form == "locals":
        body = "".join(f"x{k} = {p}\n" for k, p in enumerate(pieces))
        body += "return (" + ", ".join(f"x{k}" for k in range(len(pieces))) + ",)"
    else:
        opened, closed = ("(", ",)") if form == "tuple" else ("[", "]")
        body = f"return {opened}{', '.join(pieces)}{closed}"
    return body, all(p in pure for p in pieces)


@settings(max_examples=300, deadline=None)
@given(_bodies())
def test_proven_exactly_where_the_read_calls_nothing(case):
    """Over bodies made of held reads and of pieces that run code: proven exactly where every piece
    is a held read; and a proven read, run under a profiler, enters no Python frame but its own and
    calls no C function (a profiler does not see a container's own subscript, which runs no Python
    code for the exact types the proof allows)."""
    body, pure = case
    ds = _instance(_class(body))
    proof = held_reads(ds)
    assert (proof is not None and proof.hold(ds, [3])) is pure, body
    if proof is None:
        return
    calls: list[str] = []
    getitem = type(ds).__getitem__

    def profile(frame, event, arg):
        # every Python frame but the read's own, every C function but the profiler's switch-off
        if event == "call" and frame.f_code is not getitem.__code__:
            calls.append(f"call {frame.f_code.co_name}")
        elif event == "c_call" and arg is not sys.setprofile:
            calls.append(f"c_call {arg!r}")

    sys.setprofile(profile)
    try:
        getitem(ds, 3)
    finally:
        sys.setprofile(None)
    assert calls == [], body


def test_build_loader_reads_pytorch_examples_dataset_unwatched_and_a_drawing_one_seeded(
    monkeypatch,
):
    """End to end, on the loader: the tutorial's dataset reads every batch without the watch; a
    dataset that draws is still seeded (control: its batches differ from the unseeded loader's)."""
    ds = Held()
    unseeded = [repr(b) for b in ddpkit.build_loader(ds, 3, num_workers=0, seed_samples=False)]
    with monkeypatch.context() as m:
        _unwatched(m)
        assert [repr(b) for b in ddpkit.build_loader(ds, 3, num_workers=0)] == unseeded

    drawing = Held()
    drawing.data = DrawingList(drawing.data)
    a = [repr(b) for b in ddpkit.build_loader(drawing, 3, num_workers=0)]
    random.seed(5), torch.manual_seed(5)
    b = [repr(b) for b in ddpkit.build_loader(drawing, 3, num_workers=0)]
    c = [repr(b) for b in ddpkit.build_loader(drawing, 3, num_workers=0, seed_samples=False)]
    assert a == b and a != c


def test_torchs_subset_and_tensor_dataset_read_what_they_hold(monkeypatch):
    """``random_split``'s subsets of a dataset proven to draw nothing, and of a TensorDataset, are
    read unwatched; a subset of one that may draw is not; and what the proof assumed (the inner
    dataset's containers, the indices) is checked before every batch."""
    from torch.utils.data import Subset, TensorDataset, random_split

    held, _ = random_split(Held(), [8, 4], generator=torch.Generator().manual_seed(0))
    tensors = Subset(TensorDataset(torch.arange(N), torch.rand(N)), [5, 1, 7])
    keys = EpochIndices([0, 1, 2], 0)
    for ds in (held, tensors):
        expected = [repr(ds[i]) for i in keys]
        samples = SeededSamples(ds, seed=3)
        with monkeypatch.context() as m:
            _unwatched(m)
            assert [repr(x) for x in samples.__getitems__(keys)] == expected
    assert held_reads(Subset(_instance(_class(WATCHED[0])), [0, 1])) is None

    proof = held_reads(held)
    assert proof.hold(held, keys)
    held.indices = torch.tensor(held.indices)  # its elements are tensors: their __index__ runs
    assert not proof.hold(held, keys)
    held.indices = held.indices.tolist()
    held.dataset.data = DrawingList(held.dataset.data)
    assert not proof.hold(held, keys)
    tensors.dataset.tensors = (*tensors.dataset.tensors, DrawingList(range(N)))
    assert not held_reads(tensors).hold(tensors, keys)


class _EqualsList(type):
    """A metaclass whose classes say they equal ``list``."""

    def __eq__(cls, other):
        return other is list or type.__eq__(cls, other)

    __hash__ = type.__hash__


class _ListLookalike(list, metaclass=_EqualsList):
    def __getitem__(self, index):
        return super().__getitem__(index), random.random()


class _HiddenBase:
    @property
    def data(self):
        return [(k, random.random()) for k in range(N)]


class _LyingMro(type):
    @property
    def __mro__(cls):
        return (cls, object)


class _LyingLookup(type):
    def __getattribute__(cls, name):
        return (
            object.__getattribute__
            if name == "__getattribute__"
            else super().__getattribute__(name)
        )


class _LyingDict(dict):
    def get(self, key, default=None):
        return list(range(N)) if key == "data" else super().get(key, default)


class _Key(str):
    __hash__ = str.__hash__

    def __eq__(self, other):
        random.random()
        return False


class _Index:
    def __init__(self, i):
        self.i = i

    def __index__(self):
        random.random()
        return self.i

    def __repr__(self):
        return f"_Index({self.i})"


def _plain(data, meta=type, bases=(), getitem=None) -> object:
    """An instance of a new class (of metaclass ``meta``) with ``self.data[index]`` as its read."""

    def __getitem__(self, index):
        return self.data[index]

    cls = meta("Made", (*bases, object), {"__getitem__": getitem or __getitem__})
    ds = cls.__new__(cls)
    if data is not None:
        ds.__dict__["data"] = data
    return ds


def _except_handler(self, index):
    try:
        return self.data[index]
    except IndexError:
        return random.random()


def _extend_by(obj):
    """``return [*const]`` where the constant is ``obj`` (a code object made by hand)."""

    def __getitem__(self, index):
        return [0, 0, 0]

    code = __getitem__.__code__
    __getitem__.__code__ = code.replace(
        co_consts=tuple(obj if type(c) is tuple else c for c in code.co_consts)
    )
    return __getitem__


class _DrawsWhenIterated:
    def __iter__(self):
        random.random()
        return iter((0, 0, 0))


def _keyed_by_lookalike():
    d = {_Key("data"): None}
    d["data"] = list(range(N))
    ds = _plain(None)
    ds.__dict__ = d
    return ds


def _with_lying_dict():
    ds = _plain(None)
    ds.__dict__ = _LyingDict(data=_ListLookalike(range(N)))
    return ds


FIRST = [0, 1, 2]
ADVERSARIES = {  # name: (make the dataset, the batch's indices, of epoch 0)
    "a list subclass whose metaclass says it equals list": (
        lambda: _plain(_ListLookalike(range(N))),
        FIRST,
    ),
    "a metaclass whose __mro__ hides a base's property": (
        lambda: _plain(list(range(N)), meta=_LyingMro, bases=(_HiddenBase,)),
        FIRST,
    ),
    "a metaclass that hides the class's __getattribute__": (
        lambda: _plain(
            list(range(N)),
            meta=type("M", (_LyingLookup,), {}),
            bases=(type("B", (), {"__getattribute__": _draws_then_looks_up}),),
        ),
        FIRST,
    ),
    "an exception handler that draws": (
        lambda: _plain(list(range(3)), getitem=_except_handler),
        [0, 5, 7],
    ),
    "indices whose __index__ draws": (
        lambda: _plain(list(range(N))),
        [_Index(0), _Index(1), _Index(2)],
    ),
    "a __dict__ whose get() lies": (_with_lying_dict, FIRST),
    "a key in __dict__ whose __eq__ draws": (_keyed_by_lookalike, FIRST),
    "a constant extended into a list that draws when iterated": (
        lambda: _plain(list(range(N)), getitem=_extend_by(_DrawsWhenIterated())),
        FIRST,
    ),
}


def _draws_then_looks_up(self, name):
    random.random()
    return object.__getattribute__(self, name)


def _read_twice(make, keys) -> tuple[list[str], bool]:
    """The batch read under two process seeds, and whether python's generator moved (before the
    batch is shown: showing it may draw)."""
    outs, moved = [], False
    for g in (11, 22):
        ds = make()
        random.seed(g), torch.manual_seed(g)
        before = random.getstate()
        out = SeededSamples(ds, seed=3).__getitems__(keys)
        moved = moved or random.getstate() != before
        outs.append(repr(out))
    return outs, moved


@pytest.mark.parametrize(
    "hook",
    ["trace", "profile", "torch function mode", "torch dispatch mode", "Tensor.__getitem__"],
)
def test_a_hook_that_runs_python_on_every_read_turns_the_proof_off(hook, monkeypatch):
    """While anything runs Python code on a plain read (a debugger's or coverage's trace function, a
    profiler, a torch mode, a patched tensor indexing), the proof does not hold; it holds again
    after. Control: the same dataset outside the hook."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    ds = _instance(_class("return self.t[i], self.a[i]"))
    proof, keys = held_reads(ds), EpochIndices([0, 1], 0)
    assert proof.hold(ds, keys)

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            random.random()
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            random.random()
            return func(*args, **(kwargs or {}))

    def patched(self, index):
        random.random()
        return torch._C.TensorBase.__getitem__(self, index)

    hooks = {
        "trace": lambda: _set(sys.settrace, lambda *a: None),
        "profile": lambda: _set(sys.setprofile, lambda *a: None),
        "torch function mode": Function,
        "torch dispatch mode": Dispatch,
        "Tensor.__getitem__": lambda: _patched(monkeypatch, patched),
    }
    with hooks[hook]():
        inside = proof.hold(ds, keys)
    assert not inside and proof.hold(ds, keys)


class _set:
    """``sys.settrace`` or ``sys.setprofile`` with ``fn`` for the block."""

    def __init__(self, setter, fn):
        self.setter, self.fn = setter, fn

    def __enter__(self):
        self.setter(self.fn)

    def __exit__(self, *exc):
        self.setter(None)


class _patched:
    def __init__(self, monkeypatch, fn):
        self.monkeypatch, self.fn = monkeypatch, fn

    def __enter__(self):
        self.monkeypatch.setattr(torch.Tensor, "__getitem__", self.fn)

    def __exit__(self, *exc):
        self.monkeypatch.undo()


def test_keys_of_another_type_are_not_iterated_unwatched():
    class Keys(EpochIndices):
        def __iter__(self):
            random.random()
            return super().__iter__()

    ds = Held()
    assert not held_reads(ds).hold(ds, Keys([0, 1], 0))
    assert held_reads(ds).hold(ds, EpochIndices([0, 1], 0))


class _DropsARecord(np.void):
    """A numpy scalar type whose instances draw when freed."""

    def __del__(self):
        random.random()


def _drops_a_value():
    """A read that subscripts a record array and drops the record it read (a local never
    returned): the record is freed inside the read, running its finalizer."""

    def __getitem__(self, index):
        record = self.recs[index]  # noqa: F841
        return self.data[index]

    ds = _plain(list(range(N)), getitem=__getitem__)
    ds.__dict__["recs"] = np.zeros(N, dtype=np.dtype((_DropsARecord, [("x", "f4")])))
    return ds


def _repeats_a_key():
    def __getitem__(self, index):
        return {"x": self.recs[index], "x": self.data[index]}  # noqa: F601

    ds = _plain(list(range(N)), getitem=__getitem__)
    ds.__dict__["recs"] = np.zeros(N, dtype=np.dtype((_DropsARecord, [("x", "f4")])))
    return ds


def _dict_property():
    """A ``__dict__`` property on the class: what it shows differs from the instance's attributes,
    which the read looks up."""
    shown = {"data": list(range(N))}

    def __getitem__(self, index):
        return self.data[index]

    cls = type("Made", (), {"__getitem__": __getitem__, "__dict__": property(lambda s: shown)})
    ds = cls()
    ds.data = _ListLookalike(range(N))
    return ds


def test_a_class_keyed_by_a_str_subclass_is_refused_before_any_lookup():
    """A lookup of ``data`` in a class dictionary holding a str-subclass key of the same hash runs
    the key's ``__eq__``: such a class is refused when the proof is made, and no check draws.
    Control: the lookup the checks make along the MRO draws in that class."""

    def __getitem__(self, index):
        return self.data[index]

    cls = type("Made", (), {"__getitem__": __getitem__, _Key("data"): None})
    ds = cls.__new__(cls)
    ds.__dict__["data"] = list(range(N))
    before = random.getstate()
    assert held_reads(ds) is None and random.getstate() == before
    held_reads_module._class_lookup(cls, "data")
    assert random.getstate() != before


def _two_locals_of_one_name():
    """A code object naming two locals alike (made by hand): slot 2 holds an index object whose
    ``__index__`` draws, slot 3 the index; both are ``t`` by name."""

    def template(self, index):
        a = self.objs[index]
        b = index  # noqa: F841
        return self.data[a]

    made = _plain(list(range(N)))
    getitem = type(made).__dict__["__getitem__"]
    getitem.__code__ = template.__code__.replace(co_varnames=("self", "index", "t", "t"))
    made.__dict__["objs"] = [_Index(i) for i in range(N)]
    return made


ADVERSARIES.update(
    {
        "a record dropped inside the read, whose finalizer draws": (
            _drops_a_value,
            FIRST,
        ),
        "a repeated dict key dropping a record whose finalizer draws": (
            _repeats_a_key,
            FIRST,
        ),
        "a __dict__ property that shows other attributes": (
            _dict_property,
            FIRST,
        ),
        "two locals of one name in a hand-made code object": (
            _two_locals_of_one_name,
            FIRST,
        ),
    }
)


@pytest.mark.parametrize("hook", ["anomaly mode", "python dispatcher"])
def test_a_tensor_read_that_runs_python_under_torchs_own_switches_is_watched(hook):
    """torch's anomaly mode records a traceback (Python code) on every read of a tensor that
    requires grad, and the Python dispatcher runs Python kernels: under either, the proof does not
    hold. Control: outside them it does."""
    from torch._dispatch.python import enable_python_dispatcher

    ds = _instance(_class("return self.t[i]"))
    ds.t = torch.arange(float(N)).requires_grad_()
    proof, keys = held_reads(ds), EpochIndices([0, 1], 0)
    switch = {
        "anomaly mode": lambda: torch.autograd.set_detect_anomaly(True),
        "python dispatcher": enable_python_dispatcher,
    }[hook]
    assert proof.hold(ds, keys)
    with switch():
        assert not proof.hold(ds, keys)
    assert proof.hold(ds, keys)


@pytest.mark.parametrize(
    "change",
    ["code replaced", "tuple shadowed in its module", "a property named tensors"],
)
def test_torchs_tensor_dataset_changed_by_a_patch_is_watched(change, monkeypatch):
    from torch.utils.data import TensorDataset, dataset

    ds = TensorDataset(torch.arange(N))
    proof, keys = held_reads(ds), EpochIndices([0, 1], 0)
    assert proof.hold(ds, keys)
    if change == "code replaced":
        monkeypatch.setattr(
            TensorDataset.__getitem__,
            "__code__",
            (lambda self, index: (self.tensors[0][index], random.random())).__code__,
        )
    elif change == "tuple shadowed in its module":
        monkeypatch.setattr(dataset, "tuple", lambda xs: (*xs, random.random()), raising=False)
    else:
        monkeypatch.setattr(
            TensorDataset, "tensors", property(lambda self: (DrawingList(range(N)),)), raising=False
        )
    assert not proof.hold(ds, keys)


def test_no_check_runs_the_datasets_code_before_the_watch():
    """The checks look at the class's own dictionaries before any lookup through the class: a
    metaclass swapped in after the proof, or a descriptor set as ``__getitem__``, is refused without
    running its code, so nothing draws outside the watch. Control: the lookups through the class
    would run it."""
    ran: list[str] = []

    class Meta(abc.ABCMeta):
        def __getattribute__(cls, name):
            ran.append(name)
            return super().__getattribute__(name)

    class Described:
        def __get__(self, obj, owner=None):
            ran.append("__get__")
            return lambda *a: None

    ds = _plain(list(range(N)), meta=abc.ABCMeta)
    proof, keys = held_reads(ds), EpochIndices([0, 1], 0)
    assert proof.hold(ds, keys)
    type(ds).__getitem__ = Described()
    assert not proof.hold(ds, keys) and ran == []
    type(ds).__getitem__  # noqa: B018  (the control: a lookup through the class runs it)
    assert ran == ["__get__"]

    other = _plain(list(range(N)), meta=abc.ABCMeta)
    proof = held_reads(other)
    type(other).__class__ = Meta
    ran.clear()
    assert not proof.hold(other, keys) and ran == []


def test_every_index_of_a_batch_is_looked_at():
    """An index that is not an int runs its own ``__index__``: each is looked at, whoever made the
    keys (a sampler's keys are lists too, which anything may append to)."""
    from ddpkit.data import ShardedBatchSampler

    keys = next(iter(ShardedBatchSampler(N, 3, keyed=True, rank=0, world_size=1)))
    assert held_reads_module._ints(keys)
    keys.append(_Index(0))
    assert not held_reads_module._ints(keys)  # control: the same keys before
    assert not held_reads_module._ints(EpochIndices([0, _Index(1)], 0))


class _FakeFunction:
    """An object that says it is a function (its ``__class__``), with a plain read's code, and
    draws when called."""

    __class__ = property(lambda self: types.FunctionType)  # type: ignore[assignment]
    __code__ = (lambda self, index: self.data[index]).__code__

    def __call__(self, index):  # not a descriptor: the subscript calls it with the index alone
        random.random()
        return index


def _fake_function():
    ds = _plain(list(range(N)))
    type(ds).__getitem__ = _FakeFunction()
    return ds


class _DrawsWhenShown:
    def __repr__(self):
        random.random()
        return "shown"


def _const_shown():
    """A hand-made code object whose constant draws when ``dis`` shows it."""

    def __getitem__(self, index):
        return self.data[index], "marker"

    code = __getitem__.__code__
    __getitem__.__code__ = code.replace(
        co_consts=tuple(_DrawsWhenShown() if c == "marker" else c for c in code.co_consts)
    )
    return _plain(list(range(N)), getitem=__getitem__)


ADVERSARIES.update(
    {
        "an object that says it is a function": (_fake_function, FIRST),
    }
)


def test_making_a_proof_runs_nothing_of_the_datasets_and_never_raises():
    """A constant of a hand-made code object is not shown (dis would call its __repr__), and a
    proof that cannot be made (an exception on the way) is none: the dataset is watched."""
    before = random.getstate()
    assert held_reads(_const_shown()) is None and random.getstate() == before

    class Raises:
        def __repr__(self):
            raise RuntimeError("shown")

    def __getitem__(self, index):
        return self.data[index], "marker"

    __getitem__.__code__ = __getitem__.__code__.replace(
        co_consts=tuple(Raises() if c == "marker" else c for c in __getitem__.__code__.co_consts)
    )
    assert held_reads(_plain(list(range(N)), getitem=__getitem__)) is None


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring is Python 3.12's")
def test_a_monitoring_tool_turns_the_proof_off():
    """A debugger or coverage on ``sys.monitoring`` (PEP 669) runs Python code on every line of the
    read, unseen by ``sys.gettrace``: while a tool is registered the proof does not hold."""
    ds = _instance(_class("return self.a[i]"))
    proof, keys = held_reads(ds), EpochIndices([0, 1], 0)
    assert proof.hold(ds, keys)
    tool = next(t for t in range(6) if sys.monitoring.get_tool(t) is None)
    sys.monitoring.use_tool_id(tool, "a debugger")
    try:
        assert not proof.hold(ds, keys)
    finally:
        sys.monitoring.free_tool_id(tool)
    assert proof.hold(ds, keys)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control-unchecked"])
@pytest.mark.parametrize("name", list(ADVERSARIES))
def test_a_dataset_that_hides_its_draws_from_the_proof_is_watched(name, checked, monkeypatch):
    """Datasets built to look provable while their read runs code that draws: each is watched, so
    its samples are the seeded ones whatever the process's stream, and loading leaves that stream
    where it was. Control: where the proof is taken at its word, the samples follow the process's
    stream or move it."""
    make, indices = ADVERSARIES[name]
    keys = EpochIndices(indices, 0)
    ds = make()
    proof = held_reads(ds)
    assert proof is None or not proof.hold(ds, keys)
    if not checked:  # taken at its word: a proof made (where none was) that always holds
        taken = proof or held_reads_module.HeldReads(
            type(ds), held_reads_module._getitem_of(type(ds)), frozenset()
        )
        monkeypatch.setattr(sample_seeding, "held_reads", lambda _: taken)
        monkeypatch.setattr(type(taken), "hold", lambda *_: True)
    outs, moved = _read_twice(make, keys)
    assert (outs[0] == outs[1] and not moved) is checked
