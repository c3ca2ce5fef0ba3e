"""Whether a path the agent reads secrets from or creates files in can be trusted.

The agent runs as root and keeps its lock, sockets, CA key and records in the state dir:
a directory another user owns, or one anybody may write, lets that user swap those files
or plant a symlink that makes root overwrite a file of their choice. So, as ssh does for
its keys, such paths are refused at start: a directory (the state dir, the CA's) must be
owned by the agent's effective uid and writable by nobody else.
Files the agent creates in a trusted directory are opened ``O_NOFOLLOW`` (or through
:func:`agent.core.files.write_atomic`'s ``O_EXCL`` + rename), so a symlink is refused,
never followed.
"""

from __future__ import annotations

import os
import stat


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def dir_problem(path: str | os.PathLike[str]) -> str:
    """Why the existing directory ``path`` can't be trusted ("" when it can): not a
    directory, not owned by our euid, or writable by group or others. The path itself may
    be a symlink to a directory (its target is judged, as ``/var/run -> /run``). Raises
    OSError when it can't be stat'ed."""
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return (f"is owned by {_owner(st.st_uid)}, not by the agent's {_owner(os.geteuid())} "
                f"(mode {mode:04o})")
    if mode & 0o022:
        who = {0o022: "group and others", 0o020: "group", 0o002: "others"}[mode & 0o022]
        return f"is writable by {who} (mode {mode:04o}, owner {_owner(st.st_uid)})"
    return ""


def secret_file_problem(st: os.stat_result) -> str:
    """Why a file the agent reads secrets from (``tokens_file``), given its ``stat`` (of
    the symlink's target when the path is one: the target is judged), can't be trusted
    ("" when it can): not a regular file, owned by neither the agent's euid nor root,
    writable by group or others (they could add a token of their own), or readable by
    others (they could take one). The mode ssh wants for a key: 0600 or 0640/0400."""
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in (os.geteuid(), 0):
        return (f"is owned by {_owner(st.st_uid)}, not by the agent's {_owner(os.geteuid())} "
                f"or root (mode {mode:04o})")
    if mode & 0o022:
        who = {0o022: "group and others", 0o020: "group", 0o002: "others"}[mode & 0o022]
        return f"is writable by {who} (mode {mode:04o}, owner {_owner(st.st_uid)})"
    if mode & 0o004:
        return f"is readable by others (mode {mode:04o}, owner {_owner(st.st_uid)})"
    return ""


def secret_file_path_problem(path: str | os.PathLike[str]) -> str:
    """:func:`secret_file_problem` of ``path`` (symlinks followed); raises OSError when it
    can't be stat'ed."""
    return secret_file_problem(os.stat(path))
