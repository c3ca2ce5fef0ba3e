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


def _owner_or_writers_problem(st: os.stat_result, root_ok: bool) -> str:
    """The owner and write-bit part every check here shares: owned by neither the
    agent's euid nor (when ``root_ok``) root, or writable by group or others."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid() and not (root_ok and st.st_uid == 0):
        return (f"is owned by {_owner(st.st_uid)}, not by the agent's {_owner(os.geteuid())}"
                f"{' or root' if root_ok else ''} (mode {mode:04o})")
    if mode & 0o022:
        who = {0o022: "group and others", 0o020: "group", 0o002: "others"}[mode & 0o022]
        return f"is writable by {who} (mode {mode:04o}, owner {_owner(st.st_uid)})"
    return ""


def dir_problem(path: str | os.PathLike[str], root_ok: bool = False) -> str:
    """Why the existing directory ``path`` can't be trusted ("" when it can): not a
    directory, not owned by our euid (or root, when ``root_ok``: a directory the agent
    only reads, as ``config_dir``), or writable by group or others. The path itself may
    be a symlink to a directory (its target is judged, as ``/var/run -> /run``); its
    parents are not judged (``/tmp`` is 1777). Raises OSError when it can't be stat'ed."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return _owner_or_writers_problem(st, root_ok)


def public_file_problem(st: os.stat_result) -> str:
    """Why a file the agent reads public but trusted data from (a certificate, a trust
    bundle, the config file), given its ``stat`` (of a symlink's target), can't be
    trusted ("" when it can): not a regular file, owned by neither the agent's euid nor
    root, or writable by group or others (they could swap the root the mesh trusts, or
    the settings). Anybody may read it: 0644 is fine."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    return _owner_or_writers_problem(st, root_ok=True)


def public_file_path_problem(path: str | os.PathLike[str]) -> str:
    """:func:`public_file_problem` of ``path`` (symlinks followed); raises OSError when it
    can't be stat'ed."""
    return public_file_problem(os.stat(path))


def secret_file_problem(st: os.stat_result) -> str:
    """Why a file the agent reads secrets from (``tokens_file``, ``ca_key_file``), given its ``stat`` (of
    the symlink's target when the path is one: the target is judged), can't be trusted
    ("" when it can): not a regular file, owned by neither the agent's euid nor root,
    writable by group or others (they could add a token of their own), or readable by
    others (they could take one). The mode ssh wants for a key: 0600 or 0640/0400."""
    mode = stat.S_IMODE(st.st_mode)
    problem = public_file_problem(st)
    if problem:
        return problem
    if mode & 0o004:
        return f"is readable by others (mode {mode:04o}, owner {_owner(st.st_uid)})"
    return ""


def secret_file_path_problem(path: str | os.PathLike[str]) -> str:
    """:func:`secret_file_problem` of ``path`` (symlinks followed); raises OSError when it
    can't be stat'ed."""
    return secret_file_problem(os.stat(path))
