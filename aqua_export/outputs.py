"""How this tool writes files: never over a file it did not write, never half, never two writers at once.

    check_writable(out)            before any work: the path can be created (one line naming why not otherwise)
    check_free_space(dir, bytes)   before any work: the disk holds what will be written (the numbers otherwise)
    refuse_foreign(path, ours)     an existing output is replaced only when it is this tool's (and --force)
    atomic_write_bytes(path, data) written to a temporary sibling, renamed into place
    claim(out)                     an exclusive claim on an output path for the length of a job (a lock file
                                   beside it, held with flock: released by the kernel if the process dies)
    critical()                     a few renames that must all happen: Ctrl-C, SIGTERM or SIGHUP waits for them
                                   (on_signal is the handler cli.main installs)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import tempfile
from pathlib import Path

from .config import ConfigError

DISK_MARGIN = 64 * 2**20  # bytes beyond an estimate that a job keeps free (logs, temporary graphs, rounding)


def _existing_ancestor(p: Path) -> Path:
    p = Path(os.path.abspath(p))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(out: Path, what: str = "--out") -> None:
    """One ConfigError line if ``out`` cannot be created: its nearest existing ancestor must be a folder this
    process can write in (nothing is created here; the job makes the folders it needs when it writes)."""
    out = Path(out)
    anc = _existing_ancestor(out.parent)
    if not anc.is_dir():
        raise ConfigError(f"{what} {out} cannot be created: {anc} is a file, not a folder: choose another path")
    try:
        with tempfile.TemporaryFile(dir=anc):
            pass
    except OSError as e:
        raise ConfigError(f"{what} {out} cannot be written: {anc} refuses new files ({e.strerror}): choose a writable "
                          "path") from None


def check_free_space(where: Path, needed: int, what: str) -> None:
    """One ConfigError line, with the numbers, when the disk holding ``where`` has less than needed + DISK_MARGIN."""
    free = shutil.disk_usage(_existing_ancestor(Path(where))).free
    if free < needed + DISK_MARGIN:
        raise ConfigError(f"{what} needs about {(needed + DISK_MARGIN) / 2**30:.2f} GiB on the disk of {where}, which "
                          f"has {free / 2**30:.2f} GiB free: free some space or choose another path")


def refuse_foreign(path: Path, ours, force: bool, what: str = "--out") -> None:
    """An existing file at ``path`` is replaced only if ``ours(path)`` says this tool wrote it, and --force is
    given; otherwise one ConfigError line. No existing file: nothing to refuse."""
    path = Path(path)
    if not path.exists():
        return
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder: give a file path")
    if not ours(path):
        raise ConfigError(f"{what} {path} is a file this tool did not write: choose another path (it is left as it is)")
    if not force:
        raise ConfigError(f"{what} {path} exists: pass --force to replace it, or choose another path")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def claim(out: Path, what: str = "--out"):
    """Hold an exclusive claim on ``out`` (a lock file ``.<name>.lock`` beside it) for the block: a second job
    claiming the same path fails at once with one line instead of writing over the first's output."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(f"another aqua-export is writing {what} {out} right now: wait for it to finish or "
                                  "choose another path") from None
            raise
        try:  # the file we locked must still be the one at the path (a finishing job unlinks it)
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so every stage's cleanup
    (``finally``, ``except BaseException``) runs before the process ends."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_critical = {"depth": 0, "pending": []}


def on_signal(signum, frame) -> None:
    """The handler of SIGINT, SIGTERM and SIGHUP: KeyboardInterrupt or Terminated now, or after the critical section
    the main thread is in."""
    if _critical["depth"]:
        _critical["pending"].append(signum)
        return
    _raise(signum)


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    for s in (signal.SIGTERM, signal.SIGHUP):  # once: a second signal during the cleanup would cut it short
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


@contextlib.contextmanager
def critical():
    """A block of renames that must all happen (a folder replaced: the old one moved aside, the new one in its
    place): a signal that arrives inside it is raised when it ends."""
    _critical["depth"] += 1
    try:
        yield
    finally:
        _critical["depth"] -= 1
        if not _critical["depth"] and _critical["pending"]:
            signum = _critical["pending"][0]
            _critical["pending"].clear()
            _raise(signum)
