"""Reads that cannot draw: a proof, from a dataset's code, that ``dataset[index]`` runs no Python
code, so :class:`~ddpkit.data.SeededSamples` reads its batches without watching the generators.

pytorch/examples' dataset keeps its samples in a list and returns ``self.data[index]``: nothing to
seed, yet the watch reads every generator's state twice a batch (~20 us, several times that between
training steps, in the main process). A ``__getitem__`` whose code does no more than subscript, with
its index, lists, tuples, tensors or numpy arrays the dataset holds as its own attributes, and put
what it read in locals, a tuple, a list or a dict of constant str keys, runs no Python code and
draws from no generator. So its code is read once, as bytecode (``dis``): straight-line, with no
exception handler, made only of those operations, with constants of plain types, or it is watched.
torch's ``TensorDataset`` and ``Subset`` (and subclasses that keep their ``__getitem__``) are known
by their code.

What the proof assumed is checked before every batch, through the class's own dictionaries first
(so that no check runs the dataset's code), then the lookups the read itself makes: the class and
its MRO (of ``type``'s or ABC's metaclass, dictionaries keyed by exact strs), the ``__getitem__``
that ``dataset[index]`` calls and its code, no ``__getattribute__``, the instance's dictionary (read
by the class's own ``__dict__`` slot: a plain dict of str keys), no class attribute of the names
read (a property would run code), each attribute's exact type (a ``list`` subclass may draw in its
own ``__getitem__``), int indices (another index runs its ``__index__``), and nothing that runs
Python code on every read: a trace or profile function, a ``sys.monitoring`` tool, anomaly mode, a
torch function or dispatch mode, the Python dispatcher, a patched ``torch.Tensor.__getitem__``.

Not covered (watched): a call of any kind, a branch or an exception handler, a global, an attribute
of an attribute, a subscript of what a subscript gave, an unpacking, a value read and dropped (its
finalizer would run), a Python newer than those whose bytecode this reader knows (3.10 to 3.14).
Not seen: a Python kernel registered for torch's indexing operators on the CPU (``torch.library``),
a frame evaluation hook (PEP 523, as a compiled region installs one), a profile function set from C
without a Python object, a class dictionary edited behind the type's attribute cache (through
``gc``), patches made before this module was imported, and what runs between any two bytecodes
anyway: a cyclic garbage collection's finalizers, a signal handler.
"""

from __future__ import annotations

import abc
import builtins
import dis
import inspect
import itertools
import operator
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch.utils.data import Subset, TensorDataset

from ddpkit._internals.rng import torch_runs_python
from ddpkit.data._sampler import EpochIndices

try:  # numpy is optional
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

_MISSING = object()
_ISINSTANCE = isinstance
_SELF, _INDEX = ("self",), ("index",)
_NOT_PLAIN = (
    inspect.CO_VARARGS
    | inspect.CO_VARKEYWORDS
    | inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ITERABLE_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
)
_PLAIN_OPS = frozenset({"RESUME", "NOP", "CACHE", "EXTENDED_ARG"})


def _held_value(value: Any) -> bool:
    """A container whose subscript by an int runs no Python code: exact types, compared by identity
    (a subclass may override ``__getitem__``; a metaclass may override ``==``)."""
    t = type(value)
    return t is list or t is tuple or t is torch.Tensor or (np is not None and t is np.ndarray)


def _all_of(kind: type, values: Iterable[Any]) -> bool:
    """Every value's type is ``kind`` (by identity: a metaclass may override ``==``), at C speed."""
    return all(map(operator.is_, map(type, values), itertools.repeat(kind)))


def _class_lookup(cls: type, name: str) -> Any:
    """``name`` as the class's own dictionaries hold it along its MRO: no descriptor runs, and no
    key's ``__eq__`` once the keys are exact strs (:func:`_exact_keys`)."""
    for k in cls.__mro__:
        found = k.__dict__.get(name, _MISSING)
        if found is not _MISSING:
            return found
    return _MISSING


def _plain_meta(cls: type) -> bool:
    """A lookup on the class runs no code of a metaclass's: ``type``'s or ABC's (by identity)."""
    meta = type(cls)
    return meta is type or meta is abc.ABCMeta


def _exact_keys(cls: type) -> bool:
    # a key of a str subclass runs its own __eq__ on a lookup of a name of the same hash; setattr on
    # a class stores exact strs, so the MRO's dictionaries are read once, when the proof is made
    return all(_all_of(str, k.__dict__) for k in cls.__mro__)


_MONITORING = getattr(sys, "monitoring", None)  # PEP 669, from 3.12: tools a debugger registers


def _plain_run() -> bool:
    """Nothing runs Python code on a plain read: no trace or profile function, no monitoring tool,
    no anomaly mode (a tensor's read records a traceback), no torch mode, torch's own tensor
    indexing."""
    return (
        sys.gettrace() is None
        and sys.getprofile() is None
        and (_MONITORING is None or not any(map(_MONITORING.get_tool, range(6))))
        and not torch.is_anomaly_enabled()
        and not torch_runs_python()
    )


def _ints(items: Sequence[Any]) -> bool:
    # keys of another type may iterate by code of their own; an index that is not an int runs its
    # own __index__
    t = type(items)
    return (
        t is list or (t is EpochIndices and "__iter__" not in EpochIndices.__dict__)
    ) and _all_of(int, items)


def _getitem_of(cls: type) -> Any:
    """``__getitem__`` as the class's own dictionaries hold it (no descriptor runs)."""
    found = _class_lookup(cls, "__getitem__")
    return None if found is _MISSING else found


def _attributes(slot: Any, dataset: Any, cls: type) -> dict[str, Any] | None:
    """The instance's own dictionary, read by the class's ``__dict__`` slot (a property of that
    name would run code): a plain dict of str keys (a dict subclass may answer ``get()`` otherwise
    than the lookup does; a str-subclass key of the same hash runs its ``__eq__`` on every lookup);
    None otherwise."""
    if type(slot) is not types.GetSetDescriptorType:
        return None
    held = slot.__get__(dataset, cls)
    return held if type(held) is dict and _all_of(str, held) else None


class _Proof:
    """What every proof assumes of the class and the run, checked again before each batch (see
    above), in an order where no check runs the dataset's code.

    The class's dictionaries are kept as live views, along the MRO the proof read. Before each
    batch: ``__getitem__`` and the instance dictionary's slot are where the proof found them, unset
    in every class above; ``__getattribute__`` is unset but in ``object``; the names the read takes
    from the instance are unset in every class (a property would be read instead). Each membership
    test is a dictionary's, at C speed."""

    def __init__(
        self,
        cls: type,
        function: types.FunctionType,
        names: Iterable[str] = (),
        code: types.CodeType | None = None,
    ) -> None:
        self.cls, self.mro, self.function = cls, cls.__mro__, function
        self.code = function.__code__ if code is None else code  # the code the proof read
        dicts = [k.__dict__ for k in self.mro]

        def first(name: str) -> int:
            return next((i for i, d in enumerate(dicts) if name in d), len(dicts))

        at = {name: first(name) for name in ("__getitem__", "__dict__")}
        # where each was found (object's dictionary where it was not: neither is there)
        self.getitem_in, self.slot_in = (dicts[min(at[n], len(dicts) - 1)] for n in at)
        self.slot: Any = self.slot_in.get("__dict__")
        unset = [(d, n) for n, i in at.items() for d in dicts[:i]]
        unset += [(d, "__getattribute__") for d in dicts[:-1]]  # object's, last in every MRO
        unset += [(d, n) for n in names for d in dicts]
        self.unset_in, self.unset_names = [d for d, _ in unset], [n for _, n in unset]

    def hold(self, dataset: Any, items: Sequence[Any]) -> bool:
        """True while ``dataset[item]`` for each of ``items`` still reads only what the proof
        read (False where a check cannot be made: the batch is watched)."""
        try:
            return self._hold(dataset, items)
        except Exception:
            return False

    def _hold(self, dataset: Any, items: Sequence[Any]) -> bool:
        raise NotImplementedError

    def _instance_dict(self, dataset: Any, items: Sequence[Any]) -> dict[str, Any] | None:
        """``dataset``'s attributes where the class's assumptions hold; None otherwise."""
        cls = type(dataset)
        if (
            cls is not self.cls
            or not _plain_meta(cls)
            or cls.__mro__ is not self.mro  # bases assigned since
            or any(map(operator.contains, self.unset_in, self.unset_names))
            or self.getitem_in.get("__getitem__") is not self.function
            # the lookup the subscript makes, through the type's cache, once the dictionaries say
            # the function is there: an edit behind that cache would show here
            or cast(Any, cls).__getitem__ is not self.function
            or self.slot_in.get("__dict__") is not self.slot
            or self.function.__code__ is not self.code
            or not _plain_run()
            or not _ints(items)
        ):
            return None
        return _attributes(self.slot, dataset, cls)


class HeldReads(_Proof):
    """A proof that ``__getitem__`` of a class reads only containers its instances hold
    (:func:`held_reads`), and the check that it still holds for an instance."""

    def __init__(self, cls: type, function: types.FunctionType, names: frozenset[str]) -> None:
        super().__init__(cls, function, names)
        self.names = names

    def _hold(self, dataset: Any, items: Sequence[Any]) -> bool:
        held = self._instance_dict(dataset, items)
        return held is not None and all(_held_value(held.get(name)) for name in self.names)


class _TorchReads(_Proof):
    """torch's own ``TensorDataset`` and ``Subset`` (what ``random_split`` gives), or a subclass
    that keeps their ``__getitem__``, which subscripts the tensors, or the indices and then the
    dataset, they hold: a ``TensorDataset`` of tensors, a ``Subset`` with a list, tuple or range of
    indices over a dataset that draws nothing by its own proof. Their code calls ``tuple`` and
    ``isinstance``: the module must not shadow them, nor the builtins replace them."""

    FIELDS = {TensorDataset: ("tensors",), Subset: ("dataset", "indices")}
    GETITEM = {base: _getitem_of(base) for base in FIELDS}
    CODE = {base: _getitem_of(base).__code__ for base in FIELDS}
    """torch's functions and code, as they were when this module was imported."""

    def __init__(self, cls: type, base: type, inner: HeldReads | _TorchReads | None = None) -> None:
        # torch's code as imported, not the function's as it is now
        super().__init__(cls, self.GETITEM[base], self.FIELDS[base], self.CODE[base])
        self.inner = inner

    def _hold(self, dataset: Any, items: Sequence[Any]) -> bool:
        held = self._instance_dict(dataset, items)
        function = self.function
        if (
            held is None
            or "tuple" in function.__globals__
            or "isinstance" in function.__globals__
            or builtins.tuple is not type(())  # the real one, not a name that may be patched
            or builtins.isinstance is not _ISINSTANCE
        ):
            return False
        if self.inner is None:
            tensors = held.get("tensors")
            return type(tensors) is tuple and _all_of(torch.Tensor, tensors)
        indices: Any = held.get("indices")
        t = type(indices)
        return (t is list or t is tuple or t is range) and self.inner.hold(
            held.get("dataset"), [indices[i] for i in items]
        )


def held_reads(dataset: Any) -> HeldReads | _TorchReads | None:
    """A proof that ``dataset[index]`` draws nothing (see above), whose ``hold(dataset, items)``
    says it still holds for the batch of ``items``; None where it may draw.

    A class or code this reader cannot read (an exception on the way) has no proof: it is watched.
    No check runs the dataset's code, so nothing of the dataset's is hidden by catching."""
    try:
        return _prove(dataset)
    except Exception:
        return None


def _prove(dataset: Any) -> HeldReads | _TorchReads | None:
    cls = type(dataset)
    if (
        sys.implementation.name != "cpython"
        or not _plain_meta(cls)
        or not _exact_keys(cls)
        or _class_lookup(cls, "__getattribute__") is not object.__getattribute__
    ):
        return None
    function = _getitem_of(cls)
    for base in _TorchReads.FIELDS:
        # `in` on the MRO compares classes, whose metaclasses are type's or ABC's: by identity
        if base in cls.__mro__ and function is _TorchReads.GETITEM[base]:
            if base is TensorDataset:
                return _TorchReads(cls, base)
            attributes = _attributes(_class_lookup(cls, "__dict__"), dataset, cls)
            inner = None if attributes is None else _prove(attributes.get("dataset"))
            return None if inner is None else _TorchReads(cls, base, inner)
    # exact: FunctionType cannot be subclassed, and isinstance would ask the object's __class__
    if type(function) is not types.FunctionType:
        return None
    code = function.__code__
    if (
        code.co_argcount != 2
        or code.co_kwonlyargcount
        or code.co_freevars
        or code.co_cellvars
        or code.co_flags & _NOT_PLAIN
        or cast(Any, getattr(code, "co_exceptiontable", b""))  # a handler: code off the line
        or not all(map(_plain_constant, code.co_consts))  # dis calls repr() on each
        or sys.version_info >= (3, 15)  # bytecode this reader does not know
    ):
        return None
    names = _names_read(code)
    return None if names is None else HeldReads(cls, function, names)


def _plain_constant(value: Any) -> bool:
    t = type(value)
    if t is tuple:
        return all(map(_plain_constant, value))
    return t is str or t is int or t is float or t is bool or t is bytes or value is None


def _names_read(code: types.CodeType) -> frozenset[str] | None:
    """The attributes of ``self`` that ``code`` subscripts with its index, where that is all it does
    before it returns; None otherwise.

    An abstract run of the bytecode. Each stack slot and local is ``self``, the index, a held
    attribute, a constant (with its value), a subscript's value (numbered), or a tuple, list or dict
    of those. Every value a subscript gave must be in what is returned: a value dropped on the way
    (a local rebound or never returned, a repeated key) would be freed inside the read, running its
    finalizer."""
    local: dict[int, tuple[Any, ...]] = {0: _SELF, 1: _INDEX}  # by slot, as the interpreter keeps
    stack: list[tuple[Any, ...]] = []
    read: set[str] = set()
    values = 0

    def within(slot: tuple[Any, ...]) -> frozenset[int]:
        """The subscripts' values a slot holds."""
        return (
            frozenset({slot[1]})
            if slot[0] == "value"
            else slot[1]
            if slot[0] == "built"
            else frozenset()
        )

    def build(slots: list[tuple[Any, ...]]) -> tuple[Any, ...]:
        return ("built", frozenset().union(*map(within, slots)))

    def const_keys(keys: Sequence[Any]) -> bool:
        return _all_of(str, keys) and len(set(keys)) == len(keys)

    for ins in dis.get_instructions(code):
        op, arg = ins.opname, ins.arg or 0
        if op in _PLAIN_OPS:
            continue
        if op in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"):
            loaded: tuple[int, ...] = (arg,)
        elif op in ("LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"):
            loaded = (arg >> 4, arg & 15)  # documented: two locals' slots in one argument
        else:
            loaded = ()
        if loaded:
            if any(slot not in local for slot in loaded):
                return None
            stack.extend(local[slot] for slot in loaded)
        elif op == "STORE_FAST":
            if not stack or arg in local:  # no local rebound: what it held would be dropped
                return None
            local[arg] = stack.pop()
        elif op in ("LOAD_CONST", "LOAD_SMALL_INT"):
            stack.append(("const", ins.argval))
        elif op == "LOAD_ATTR":
            # from 3.12 the low bit of the argument marks a method's load, for a call
            if (sys.version_info >= (3, 12) and arg & 1) or not stack or stack.pop() != _SELF:
                return None
            read.add(ins.argval)
            stack.append(("held", ins.argval))
        elif op == "BINARY_SUBSCR" or (op == "BINARY_OP" and ins.argrepr == "[]"):
            if len(stack) < 2:
                return None
            key, container = stack.pop(), stack.pop()
            if key != _INDEX or container[0] != "held":
                return None
            stack.append(("value", values))
            values += 1
        elif op in ("BUILD_TUPLE", "BUILD_LIST"):
            if len(stack) < arg:
                return None
            items = stack[len(stack) - arg :]
            del stack[len(stack) - arg :]
            stack.append(build(items))
        elif op == "LIST_EXTEND":  # [0, 0, 0]: a list extended by a constant tuple
            if arg != 1 or len(stack) < 2:
                return None
            extended = stack.pop()
            if extended[0] != "const" or type(extended[1]) is not tuple:
                return None
        elif op == "BUILD_CONST_KEY_MAP":  # {"x": ..., "y": ...} up to 3.12: str keys hash in C
            if len(stack) < arg + 1:
                return None
            keys = stack.pop()
            if keys[0] != "const" or type(keys[1]) is not tuple or len(keys[1]) != arg:
                return None
            if not const_keys(keys[1]):
                return None
            items = stack[len(stack) - arg :]
            del stack[len(stack) - arg :]
            stack.append(build(items))
        elif op == "BUILD_MAP":  # key, value pairs: a one-key dict, and any dict from 3.13
            if len(stack) < 2 * arg:
                return None
            pairs = stack[len(stack) - 2 * arg :]
            if not all(slot[0] == "const" for slot in pairs[::2]):
                return None
            if not const_keys([slot[1] for slot in pairs[::2]]):
                return None
            del stack[len(stack) - 2 * arg :]
            stack.append(build(pairs[1::2]))
        elif op in ("RETURN_VALUE", "RETURN_CONST"):
            returned = stack if op == "RETURN_VALUE" else [*stack, ("const", ins.argval)]
            # every subscript's value is in what is returned: none is freed at the frame's end
            if len(returned) != 1 or within(returned[0]) != frozenset(range(values)):
                return None
            return frozenset(read)
        else:
            return None
    return None
