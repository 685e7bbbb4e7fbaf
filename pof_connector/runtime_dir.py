"""The runtime directory (``runtime_dir``): the embedded index's socket, pidfile and locks, and
peer-HBM region files. Owner-only, and refused when another user owns it: whoever owns it could
replace the index socket (and so hand engines forged page locations) or read the regions."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from pof_connector.config.config_error import ConfigError


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def private_dir(path: str | Path, key: str = "runtime_dir") -> Path:
    """``path``, created mode 0o700 if missing; an existing one of ours loses any group and other
    permissions. Raises :class:`ConfigError` naming ``key``, the path and its owner when another
    user owns it, when it is not a directory, or when it is a shared sticky directory such as
    ``/tmp`` (giving it 0o700 would lock every other user out of it)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{key}: {p} is not a directory (a symlink or a file); give a directory of pof's own")
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(f"{key}: {p} is owned by {_user(st.st_uid)}, not by this user ({_user(me)}); pof "
                          f"refuses it: its owner could replace the index socket or read the regions. Give a "
                          f"directory of your own")
    if st.st_mode & 0o077:
        if st.st_mode & stat.S_ISVTX:
            raise ConfigError(f"{key}: {p} is a shared directory (mode {stat.S_IMODE(st.st_mode):o}); give a "
                              f"directory of pof's own, such as {p / f'pof-{me}'}")
        os.chmod(p, 0o700)
    return p


__all__ = ["private_dir"]
