"""Errors of the machine, told from a candidate's own: the first stop a search, the second fail one
trial."""

from __future__ import annotations

import errno

# Errors of the machine, not of a candidate: every candidate would meet them, so failing trials on
# them would spend the budget on nothing. A full disk or quota, a file system mounted read-only, a
# failing disk or lost network mount (EIO), a network file handle gone stale. Left out: ENOMEM and
# EMFILE (a candidate's size or its data loader's workers can cause them) and EACCES (a path the
# objective chose).
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ESTALE})


def environment_error(err: BaseException) -> OSError | None:
    """The error of the machine (``ENVIRONMENT_ERRNOS``) behind ``err``, or None.

    Looked for in the chain of causes and contexts (a snapshot written in the background is
    re-raised as a RuntimeError from its error) and in the per-rank failures of
    torch.distributed.checkpoint's CheckpointException.
    """
    todo: list[BaseException | None] = [err]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        # CheckpointException: rank -> (exception, traceback)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None
