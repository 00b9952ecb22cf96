"""Ray's key-value store, where each rank counts Ray Train's restarts of its worker group. Imports
without Ray; the check reads Ray's source, never importing it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from ddpkit._internals.contract import Internal, warn_lost

NAMESPACE = "ddpkit"
_KV = "ray.experimental.internal_kv"


def kv_source() -> Path | None:
    """The file of Ray's ``internal_kv`` module, found without importing Ray (or None)."""
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "experimental" / "internal_kv.py"


def count_start(rank: int, job: str) -> int:
    """How many times this rank of this Ray Train run (``job``, its experiment name) started before,
    counting this one; 0 with one warning where the store is not as relied on."""
    if problem := _check_kv():
        warn_lost(
            f"{_KV}._internal_kv_get/_put", "Ray", f"restart_count under Ray Train ({problem})"
        )
        return 0
    import ray.train
    from ray.experimental import internal_kv

    key = f"restarts/{job}/{ray.train.get_context().get_experiment_name()}/{rank}"
    before = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
    count = int(before) if before else 0
    internal_kv._internal_kv_put(key, str(count + 1).encode(), overwrite=True, namespace=NAMESPACE)
    return count


def _check_kv(source: Path | None = None) -> str | None:
    source = kv_source() if source is None else source
    if source is None:
        return None
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError, ValueError):
        return f"{_KV} is gone"
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for name, keywords in (
        ("_internal_kv_get", {"namespace"}),
        ("_internal_kv_put", {"namespace", "overwrite"}),
    ):
        if name not in functions:
            return f"{_KV} has no {name}"
        args = functions[name].args
        taken = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        if missing := keywords - taken:
            return f"{_KV}.{name} takes no {', '.join(sorted(missing))}"
    return None


INTERNALS = [
    Internal(
        f"{_KV}._internal_kv_get/_put",
        "Ray",
        "the count of Ray Train's worker-group restarts (Runtime.restart_count under launcher "
        "'ray'); without it the count stays 0",
        _check_kv,
    ),
]
