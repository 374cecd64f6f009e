"""Hugging Face hub repos (models and datasets) as local snapshot folders: the cache first, then a download.

``resolve_snapshot("Qwen/Qwen2.5-0.5B-Instruct", revision=None)`` returns the folder of the
cached snapshot and the commit it is. A repo already in the cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) is used as it is, without the network, so
a node that ran once keeps running offline; pin ``revision`` to a commit for a swarm whose
peers must hold the same weights. A repo not cached is downloaded unless ``HF_HUB_OFFLINE`` is
set. When neither works the error names the repo, the revision and the cache folder.

Only the files a caller lists are fetched (``allow_patterns``), never the whole repo.

The other way, ``push_folder`` uploads an exported model folder (`hivespec export --push-to-hub`)
with the token ``hf auth login`` stored or ``$HF_TOKEN``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hivespec.protocol.errors import UserError

# owner/name as the hub spells it (also a bare name, for old canonical repos like "gpt2").
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(UserError):
    """A hub repo is neither in the local cache nor downloadable; the message names the repo, revision and cache."""


@dataclass(frozen=True)
class Snapshot:
    """A repo's files on disk: ``folder`` holds them, ``commit`` is the 40-hex commit they come from."""

    repo_id: str
    folder: Path
    commit: str


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` is spelled like a hub repo id ("owner/name") and is not an existing local path."""
    return bool(_REPO_ID.fullmatch(text)) and "/" in text and ".." not in text and not Path(text).expanduser().exists()


def hub_cache_dir() -> Path:
    """The hub cache folder huggingface_hub uses now (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or the default)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "")
    return constants.HF_HUB_OFFLINE or flag.strip().lower() in ("1", "true", "yes", "on")


def resolve_snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    repo_type: str = "model",
    allow_patterns: list[str] | None = None,
) -> Snapshot:
    """The local snapshot of ``repo_id`` at ``revision`` (a branch, tag or commit; None = the default branch).

    Cache first, then (unless ``HF_HUB_OFFLINE``) a download of ``allow_patterns``. Raises
    HubError naming the repo, revision and cache folder when neither works.
    """
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    kind = "dataset" if repo_type == "dataset" else "model"
    where = f"{kind} {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        folder = snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, local_files_only=True, allow_patterns=allow_patterns, cache_dir=cache
        )
    except Exception as cached_error:  # noqa: BLE001 - not cached: LocalEntryNotFoundError, a bad revision, ...
        if _offline():
            raise HubError(
                f"{where} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set; "
                f"download it on a machine with network (huggingface-cli download {repo_id}) into that cache, "
                f"or unset HF_HUB_OFFLINE ({type(cached_error).__name__})"
            ) from None
        try:
            folder = snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns, cache_dir=cache)
        except Exception as error:  # noqa: BLE001 - network, auth, missing repo: all end in the same message
            raise HubError(
                f"{where} is not in the Hugging Face cache {cache} and downloading it failed "
                f"({type(error).__name__}: {' '.join(str(error).split())[:240]}). "
                "Check the id and revision, the network, or HF_TOKEN for a gated repo"
            ) from None
    path = Path(str(folder))
    # Snapshots live in .../snapshots/<commit>; the folder name is the resolved revision.
    commit = path.name if _COMMIT.fullmatch(path.name) else ""
    if not commit:
        raise HubError(f"{where}: the cache folder {path} is not a snapshot named by its commit; clear it and retry")
    return Snapshot(repo_id, path, commit)


def check_upload(repo_id: str, *, folder: Path | None = None) -> str:
    """The token to upload to Hub model repo ``repo_id`` with, once its form, the token and online mode are checked.

    Raises HubError naming the fix when ``repo_id`` is not owner/name, no token is stored or in
    ``$HF_TOKEN``, or ``HF_HUB_OFFLINE`` is set. ``folder``: the finished folder the messages name
    (None: `hivespec export` checks before it writes anything).
    """
    from huggingface_hub import get_token

    _check_repo_id(repo_id)
    later = (f"(the folder {folder} is complete; upload it later with `hf upload {repo_id} {folder}`)" if folder is not None
             else "(or leave --push-to-hub out and upload the exported folder later with `hf upload`)")
    token = get_token()
    if not token:
        raise HubError(f"no Hugging Face token to upload to {repo_id}: run `hf auth login` or set HF_TOKEN {later}")
    if _offline():
        raise HubError(f"HF_HUB_OFFLINE is set: not uploading to {repo_id}; unset it {later}")
    return token


def _check_repo_id(repo_id: str) -> None:
    if "/" not in repo_id or not _REPO_ID.fullmatch(repo_id):
        raise HubError(f"--push-to-hub {repo_id!r} is not a Hub repo id; use owner/name, e.g. alice/smollm2-swarm-grpo")


def push_folder(folder: Path, repo_id: str, *, private: bool = False, commit_message: str = "", api=None) -> str:
    """Upload every file of ``folder`` to the Hub model repo ``repo_id`` (created if missing); the commit's URL.

    Needs a token (``hf auth login``, or ``$HF_TOKEN``) and the network. Raises HubError naming
    the repo and the fix when `check_upload` refuses or the upload fails. ``api`` stands in for
    ``huggingface_hub.HfApi`` in tests.
    """
    from huggingface_hub import HfApi

    if api is None:
        api = HfApi(token=check_upload(repo_id, folder=folder))
    else:
        _check_repo_id(repo_id)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                   commit_message=commit_message or "hivespec export")
    except Exception as error:  # noqa: BLE001 - network, auth, permissions: all end in the same message
        raise HubError(f"uploading {folder} to {repo_id} failed ({type(error).__name__}: {' '.join(str(error).split())[:240]}); "
                       f"check the token's write access and the network, then `hf upload {repo_id} {folder}`") from None
    return str(getattr(commit, "commit_url", commit))
