"""The public surface: the names scripts call, frozen so that it changes only on purpose."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpkit

PUBLIC = {
    "init", "shutdown", "get_runtime", "Runtime", "split_world", "spawn", "seed_everything",
    "prepare_model", "unwrap", "no_sync", "build_loader", "build_eval_loader", "to_device",
    "evaluate", "classification_metrics", "regression_metrics", "Trainer", "TrainerConfig", "SnapshotConfig",
    "EarlyStoppingConfig", "LoggingConfig", "DDPConfig", "ZeroConfig", "FSDPConfig", "Callback", "Snapshots",
    "print0", "get_logger", "barrier", "main_first", "all_reduce", "broadcast_object", "all_gather_object",
    "gather_tensors", "MetricSums", "ConfigError", "Preempted",
}  # fmt: skip


def test_the_public_names_are_the_frozen_list():
    assert set(ddpkit.__all__) == PUBLIC, "a public name was added or removed: update PUBLIC and the README"
    assert len(ddpkit.__all__) == len(PUBLIC)
    for name in PUBLIC:
        assert getattr(ddpkit, name) is not None
    # Nothing else public leaks through `from ddpkit import *`.
    namespace: dict = {}
    exec("from ddpkit import *", namespace)
    assert set(namespace) - {"__builtins__"} == PUBLIC


def test_no_module_imports_another_modules_private_names():
    src = Path(ddpkit.__file__).parent
    offenders = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpkit"):
                offenders += [
                    f"{path.name}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not offenders, offenders


def test_no_module_reads_another_modules_private_attributes():
    src = Path(ddpkit.__file__).parent
    offenders = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {  # names bound to ddpkit modules in this file
            (a.asname or a.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "ddpkit"
            for a in node.names
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
            ):
                offenders.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert not offenders, offenders
