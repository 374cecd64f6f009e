"""The node's key file: created on first run with mode 0600, loaded on every later run.

File format (48 bytes): the 16-byte magic ``b"hivespec-key-v1\\n"`` followed by the raw 32-byte
Ed25519 private key. The magic lets a future format coexist and makes a wrong file (a hivemind
key, a truncated copy) fail loudly instead of becoming a different identity.

Location: `$HIVESPEC_HOME/identity.key` when HIVESPEC_HOME is set (tests, several nodes on one
machine), else `platformdirs.user_data_dir("hivespec")/identity.key`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from hivespec.node.config import default_home
from hivespec.node.durable import sync_dir
from hivespec.protocol.errors import UserError
from hivespec.protocol.identity import PRIVATE_KEY_BYTES, Identity

KEY_FILE_MAGIC = b"hivespec-key-v1\n"
KEY_FILE_BYTES = len(KEY_FILE_MAGIC) + PRIVATE_KEY_BYTES
KEY_FILE_NAME = "identity.key"


class KeyFileError(UserError):
    """The key file is not a hivespec key, is readable by others, or cannot be read or created; the message says the fix."""


def default_identity_path() -> Path:
    """Where the node keeps its key: ``default_home()/identity.key`` ($HIVESPEC_HOME or the user data dir)."""
    return default_home() / KEY_FILE_NAME


def load_or_create_identity(path: Path) -> Identity:
    """Load the identity at `path`, or create one there (mode 0600) if the file does not exist.

    Raises `KeyFileError` when the file exists but is not a hivespec key file, is readable by
    group or others, or cannot be read or created (the message says how to fix it). Two processes racing to create the same
    file end up with the same key: the first complete file wins and the other process loads it.
    """
    path = Path(path).expanduser()
    try:
        if path.exists():
            return _load(path)
        return _create(path)
    except OSError as exc:
        raise KeyFileError(f"identity file {path}: cannot {'read' if path.exists() else 'create'} it ({exc.strerror}); "
                           "check the folder's permissions, or point --home (or $HIVESPEC_HOME) at a folder you own") from None


def _load(path: Path) -> Identity:
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"identity path {path} is not a regular file; point the node at a key file or remove it")
    if os.name == "posix" and st.st_mode & 0o077:
        raise KeyFileError(
            f"identity file {path} has mode {stat.S_IMODE(st.st_mode):04o}: the private key is readable by "
            f"other users; run `chmod 600 {path}` (and consider the key leaked if the machine is shared)"
        )
    data = path.read_bytes()
    if len(data) != KEY_FILE_BYTES or not data.startswith(KEY_FILE_MAGIC):
        raise KeyFileError(
            f"identity file {path} is not a hivespec key file ({len(data)} bytes, expected {KEY_FILE_BYTES} "
            f"starting with {KEY_FILE_MAGIC!r}); restore it from a backup, or move it away to create a new "
            "identity (the node will then have a new peer id)"
        )
    return Identity.from_private_bytes(data[len(KEY_FILE_MAGIC) :])


def _create(path: Path) -> Identity:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    identity = Identity.generate()
    with private_temp_file(path, KEY_FILE_MAGIC + identity.private_bytes(), mode=0o600) as tmp:
        try:
            # link() refuses to overwrite, so a concurrent creator's key is never replaced.
            os.link(tmp, path)
        except FileExistsError:
            return _load(path)
        except OSError:
            # Filesystems without hard links: an atomic replace is the next best thing.
            os.replace(tmp, path)
        sync_dir(path.parent)
    return identity


@contextlib.contextmanager
def private_temp_file(path: Path, data: bytes, *, mode: int) -> Iterator[Path]:
    """`data` in a new file beside `path`, with `mode` from the start (O_EXCL: a key is never on disk with wider
    permissions) and fsynced, for the caller to link or rename into place; removed on exit where it is still there."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):  # left by a killed process that had our pid
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
