"""The node key file: created 0600, reloaded unchanged, refused when corrupt or exposed."""

import os
import stat

import pytest

from hivespec.node.identity_file import (
    KEY_FILE_MAGIC,
    default_identity_path,
    load_or_create_identity,
)


def test_creates_file_with_mode_0600_and_parent_dirs(tmp_path):
    path = tmp_path / "a" / "b" / "identity.key"
    ident = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == KEY_FILE_MAGIC + ident.private_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == ["identity.key"]  # no temp file left


def test_reload_gives_the_same_key(tmp_path):
    path = tmp_path / "identity.key"
    first = load_or_create_identity(path)
    second = load_or_create_identity(path)
    assert second.public_key == first.public_key and second.peer_id == first.peer_id


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00" * 32, KEY_FILE_MAGIC + b"\x00" * 31, KEY_FILE_MAGIC + b"\x00" * 33, b"X" * len(KEY_FILE_MAGIC + b"\x00" * 32)],
)
def test_corrupt_file_is_refused_with_the_path(tmp_path, content):
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ValueError, match="not a hivespec key file") as excinfo:
        load_or_create_identity(path)
    assert str(path) in str(excinfo.value)
    assert path.read_bytes() == content  # never overwritten


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_readable_by_others_is_refused(tmp_path, mode):
    path = tmp_path / "identity.key"
    load_or_create_identity(path)
    path.chmod(mode)
    with pytest.raises(ValueError, match=f"chmod 600 {path}"):
        load_or_create_identity(path)


def test_directory_at_key_path_is_refused(tmp_path):
    (tmp_path / "identity.key").mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        load_or_create_identity(tmp_path / "identity.key")


def test_default_path_honours_hivespec_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HIVESPEC_HOME", str(tmp_path / "node1"))
    assert default_identity_path() == tmp_path / "node1" / "identity.key"
    monkeypatch.delenv("HIVESPEC_HOME")
    path = default_identity_path()
    assert path.name == "identity.key" and "hivespec" in str(path.parent)
