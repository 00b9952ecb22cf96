"""The one way ddpkit writes, replaces, truncates, renames and deletes files and folders
(:mod:`ddpkit._fs.safe`).

Call these through the package (``fs.write_atomic(...)``): a test can then stand in for one of them.
"""

from ddpkit._fs.safe import (
    Linked,
    check_owned,
    folder,
    hard_link_message,
    link_message,
    make_dir,
    make_dirs,
    open_append,
    open_exclusive,
    open_fd,
    other_owner,
    owner_message,
    read_bytes,
    refuse_link,
    remove,
    remove_empty_dir,
    remove_tree,
    rename,
    truncate,
    unshare,
    user_name,
    write_atomic,
    write_with,
)

__all__ = [
    "Linked",
    "check_owned",
    "folder",
    "hard_link_message",
    "link_message",
    "make_dir",
    "make_dirs",
    "open_append",
    "open_exclusive",
    "open_fd",
    "other_owner",
    "owner_message",
    "read_bytes",
    "refuse_link",
    "remove",
    "remove_empty_dir",
    "remove_tree",
    "rename",
    "truncate",
    "unshare",
    "user_name",
    "write_atomic",
    "write_with",
]
