"""Local media files, read beneath one directory with no way out of it (openat2 RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS, else an O_NOFOLLOW walk), each failure with the same message: docs/security.md#media-access.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import sys

from mmserve.errors import InvalidRequest

_SYS_OPENAT2 = 437  # the same number on every Linux architecture
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_DIRECTORY", 0)


def read_local_media(url: str, media_dir: str | None, max_bytes: int) -> bytes:
    """Bytes of a regular file beneath `media_dir` (a relative path is taken from there)."""
    path = url[len("file://"):] if url.startswith("file://") else url
    unavailable = InvalidRequest(f"local media {path!r} is not available: name a readable file inside the media directory")
    relative = _relative_to(path, media_dir) if media_dir else None
    if relative is None:
        raise unavailable
    try:
        fd = open_beneath(media_dir, relative)
    except OSError:
        raise unavailable from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise unavailable
        if info.st_size > max_bytes:
            raise InvalidRequest(f"media item larger than the limit of {max_bytes} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise unavailable from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise InvalidRequest(f"media item larger than the limit of {max_bytes} bytes")
    return data


def _relative_to(path: str, media_dir: str) -> str | None:
    """`path` relative to `media_dir` (an absolute path must start with it, as configured or
    resolved), or None."""
    if "\0" in path:
        return None
    if not path.startswith("/"):
        return path
    for prefix in (os.path.abspath(media_dir), os.path.realpath(media_dir)):
        prefix = prefix.rstrip("/") + "/"
        if path.startswith(prefix):
            return path[len(prefix):]
    return None


def open_beneath(directory: str, relative: str) -> int:
    """A descriptor of `relative` opened beneath `directory`, following no symlink on the way
    (the directory's own path is the operator's and is followed). `..`, absolute paths and any
    symlink raise OSError."""
    names = [name for name in relative.split("/") if name not in ("", ".")]
    if relative.startswith("/") or "\0" in relative or ".." in names or not names:
        raise OSError(errno.EXDEV, "not a path beneath the media directory", relative)
    root = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fd = _openat2(root, "/".join(names), _FILE_FLAGS)
        return fd if fd is not None else _walk(root, names)
    finally:
        os.close(root)


def _walk(root: int, names: list[str]) -> int:
    """Open `names` one component at a time from `root`, each with O_NOFOLLOW."""
    current = root
    try:
        for name in names[:-1]:
            parent, current = current, os.open(name, _DIR_FLAGS, dir_fd=current)
            if parent != root:
                os.close(parent)
        return os.open(names[-1], _FILE_FLAGS, dir_fd=current)
    finally:
        if current != root:
            os.close(current)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def _libc_syscall():
    if not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    return syscall


def _openat2(dir_fd: int, path: str, flags: int) -> int | None:
    """openat2(dir_fd, path, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS); None where the kernel (or a
    seccomp filter) does not offer it."""
    syscall = _libc_syscall()
    if syscall is None:
        return None
    sys.audit("open", path, None, flags)  # what os.open announces, so audit hooks see this open too
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
    fd = syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(dir_fd), ctypes.c_char_p(os.fsencode(path)),
                 ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # no openat2, or a seccomp filter refusing it: walk instead
        return None
    raise OSError(err, os.strerror(err), path)
