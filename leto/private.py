"""Private directories and files: the run directory, the checkpoint directory, the secret.

What leto writes and later trusts must be out of other users' reach: the run
directory holds the job's secret and its logs; the checkpoint directory holds
what ``torch.distributed.checkpoint.load`` reads back, and it unpickles the
``.metadata`` it finds there (a file another user placed there would run as
code in every trainer). So such a directory is created mode 0700, and one that
already exists is refused unless this user owns it and no other user can write
to it, nor move it away (a parent that others may write to, without the sticky
bit of ``/tmp``). A refusal is an :class:`InsecurePathError` whose message is
one line naming the path and what is wrong with it.

As root (uid 0) the same rules hold: a directory some other uid owns is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["InsecurePathError", "check_private_file", "check_tree", "private_dir"]


class InsecurePathError(PermissionError):
    """A path another user owns, or could have written: leto refuses to use it."""


def private_dir(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a directory only this user can change: created 0700 (its missing
    parents with the usual mode) or checked; the resolved path."""
    given = Path(path).absolute()
    _check_link(given, what)
    try:
        given.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as e:
        raise InsecurePathError(f"cannot create the {what} {given}: {e.strerror}") from None
    real = given.resolve()
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise InsecurePathError(f"the {what} {real} is not a directory")
    _check_owner(real, st, what, deny=0o022)
    for parent in real.parents:
        pst = os.stat(parent)
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise InsecurePathError(
                f"the {what} {real} is inside {parent}, which every user may write to "
                f"(mode {stat.S_IMODE(pst.st_mode):o}, no sticky bit): refusing it"
            )
    return real


def check_private_file(path: str | os.PathLike[str], st: os.stat_result, what: str) -> None:
    """Refuse a file (its ``stat``) unless this user owns it and no one else may read
    or write it."""
    _check_owner(Path(path), st, what, deny=0o077)


def check_tree(path: str | os.PathLike[str], what: str) -> None:
    """Refuse the tree under ``path`` unless this user owns every entry of it and no
    other user may write to any (symbolic links are not followed: one is refused
    unless it is ours)."""
    root = Path(path)
    for top, dirs, files in os.walk(root, onerror=_raise):
        for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
            st = os.lstat(name)
            if stat.S_ISLNK(st.st_mode):
                _check_owner(Path(name), st, what, deny=0)
            else:
                _check_owner(Path(name), st, what, deny=0o022)


def _raise(e: OSError) -> None:
    raise InsecurePathError(f"cannot read {e.filename}: {e.strerror}") from None


def _check_link(path: Path, what: str) -> None:
    """A symbolic link at ``path`` itself must be ours (another user's link in /tmp
    could be pointed elsewhere later)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        _check_owner(path, st, what, deny=0)


def _check_owner(path: Path, st: os.stat_result, what: str, *, deny: int) -> None:
    me = os.getuid()
    if st.st_uid != me:
        raise InsecurePathError(
            f"the {what} {path} belongs to uid {st.st_uid}, not to this user (uid {me}): "
            "refusing it (another user could have prepared its contents)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & deny:
        who = "read or written" if deny & 0o044 else "written"
        raise InsecurePathError(
            f"the {what} {path} can be {who} by other users (mode {mode:o}): refusing it "
            f"(chmod go-{'rw' if deny & 0o044 else 'w'} {path})"
        )
