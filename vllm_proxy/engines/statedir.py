"""A state directory no one else can prepare (as sshd's ``StrictModes``).

Whoever can write the state dir, or any folder above it, can swap what the proxy keeps there:
plant a link where the lock, ``engines.json`` or an engine log is written (the proxy's user then
overwrites a file of the planter's choice), rename the 0700 ``sockets/`` folder aside and put
their own in its place (and answer requests, prompts captured), or prepare the engines' compile
cache. So, before anything is written there:

* every folder from ``/`` down to the state dir (its real path) is owned by root or the proxy's
  user and writable by no one else; a folder above the state dir may be writable by others only
  when it is root's and sticky (``/tmp``): others cannot rename or remove what is not theirs in
  it. The state dir itself is the proxy user's own.
* missing folders are made one at a time, mode 0700, and their owner checked;
* files in it are opened with ``O_NOFOLLOW`` (a link in their place is an error, never followed).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

#: Flags for every file the proxy writes in its state dir.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeStateDir(OSError):
    """The state dir or a folder above it could be prepared by another user."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name} ({uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def secure_state_dir(path: str | os.PathLike[str]) -> Path:
    """Check every folder down to `path` and make what is missing (0700); the real path.
    `UnsafeStateDir` names the first folder another user could write, or that is theirs."""
    me = os.geteuid()
    target = Path(os.path.realpath(os.path.abspath(path)))
    chain = [*reversed(target.parents), target]
    for folder in chain:
        own = folder == target
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
            st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeStateDir(f"{folder} is not a folder (a link or a file)")
        if st.st_uid != me and (own or st.st_uid != 0):
            raise UnsafeStateDir(
                f"{folder} belongs to {_owner(st.st_uid)}, not to the proxy's user"
                + ("" if own else " or root")
            )
        if st.st_mode & 0o022:
            sticky = st.st_mode & stat.S_ISVTX and st.st_uid == 0 and not own
            if not sticky:
                who = "others" if st.st_mode & 0o002 else "its group"
                raise UnsafeStateDir(
                    f"{folder} (mode {stat.S_IMODE(st.st_mode):04o}) can be written by {who}: "
                    "another user could prepare the state dir; make it writable by its owner "
                    "only (chmod go-w), or choose another server.state_dir"
                )
    return target


def private_dirs(path: Path, top: Path) -> None:
    """Make `path` (below `top`, already checked) and the folders between them, each mode 0700
    and the proxy user's own; `OSError` for a link, a file or another user's folder."""
    me = os.geteuid()
    rel = path.relative_to(top)
    folder = top
    for part in rel.parts:
        folder = folder / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
            raise OSError(f"{folder}: not a folder owned by the proxy's user")
        if st.st_mode & 0o077:
            os.chmod(folder, 0o700)


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """`os.open` that never follows a link in the last component (ELOOP instead)."""
    return os.open(path, flags | NOFOLLOW, mode)
