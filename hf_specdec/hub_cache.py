"""Place the method folders in the local Hugging Face cache (offline), or publish them to the Hub.

After ``hf-specdec install-hub-cache`` the exact call
``model.generate(..., custom_generate="hf_specdec/prompt_lookup", trust_remote_code=True)`` works from any
directory without network: transformers finds the repository ``hf_specdec/prompt_lookup`` in the cache, as if it had
been downloaded (``HF_HUB_OFFLINE=1`` or not).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from .entry import available_methods, custom_generate_path
from .folders import write_file

DEFAULT_ORG = "hf_specdec"


def _folder_files(root: str | os.PathLike) -> dict[str, bytes]:
    """The files of a folder that carries ``custom_generate/generate.py`` (a method's folder, or a model folder
    after ``hf-specdec attach``), by relative path; no caches, no hidden files."""
    root = Path(root)
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc" \
                and not any(part.startswith(".") for part in rel.parts):
            files[rel.as_posix()] = path.read_bytes()
    if "custom_generate/generate.py" not in files:
        raise FileNotFoundError(f"{root} has no custom_generate/generate.py (a model folder gets one from "
                                "`hf-specdec attach`)")
    return files


def _method_files(method: str) -> dict[str, bytes]:
    return _folder_files(custom_generate_path(method))


def write_cached_repo(cache_dir: str | os.PathLike, repo_id: str, files: dict[str, bytes],
                      repo_type: str = "model") -> Path:
    """Write ``files`` as one revision of ``repo_id`` in a Hub cache, in huggingface_hub's layout
    (``models--org--name/{blobs,snapshots/<commit>,refs/main}``); the commit hash is derived from the files.
    Returns the snapshot folder. Used to install the method folders, and by tests to stage published layouts.

    Every file and link is written beside its place and renamed onto it: a reader (transformers resolving the
    repository) or a second writer at the same time never sees a part of one."""
    digest = hashlib.sha1()
    for name, data in sorted(files.items()):
        digest.update(name.encode() + b"\0" + data)
    commit = digest.hexdigest()
    repo = Path(cache_dir) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            write_file(blob, data)
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        link = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.link")
        try:
            link.symlink_to(os.path.relpath(blob, target.parent))
            os.replace(link, target)
        except OSError:  # filesystems without symlinks
            link.unlink(missing_ok=True)
            write_file(target, data)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    write_file(repo / "refs" / "main", commit)
    return snapshot


def _cache(cache_dir) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE)


def install_folder(folder: str | os.PathLike, repo_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Place a model folder that carries ``custom_generate/`` (``hf-specdec attach``) in the Hub cache as the
    repository ``repo_id``, as if downloaded: ``from_pretrained(repo_id, trust_remote_code=True)`` then loads it
    offline. Returns the snapshot folder."""
    return write_cached_repo(_cache(cache_dir), repo_id, _folder_files(folder))


def install_hub_cache(cache_dir: str | os.PathLike | None = None, org: str = DEFAULT_ORG,
                      methods: list[str] | None = None, verbose: bool = True) -> list[Path]:
    """Write ``<org>/<method>`` repositories into the Hub cache (``$HF_HUB_CACHE`` by default).

    Re-installing identical files is a no-op (same commit hash). Returns the snapshot folders.
    """
    cache = _cache(cache_dir)
    snapshots = []
    for method in methods or available_methods():
        snapshot = write_cached_repo(cache, f"{org}/{method}", _method_files(method))
        snapshots.append(snapshot)
        if verbose:
            print(f"installed {org}/{method} -> {snapshot}")
    return snapshots


def publish(org: str = DEFAULT_ORG, methods: list[str] | None = None, token: str | None = None,
            private: bool = False, dry_run: bool = False, folder: str | os.PathLike | None = None,
            repo_id: str | None = None) -> list[str]:
    """Create (or update) one Hub repository per method with its folder (needs network and a write token); with
    ``folder`` and ``repo_id``, that model folder (attached by ``hf-specdec attach``) as the repository ``repo_id``."""
    from huggingface_hub import HfApi

    if (folder is None) != (repo_id is None):
        raise ValueError("Publishing a model folder takes both --folder and --repo.")
    api = HfApi(token=token)
    urls = []
    if folder is not None:
        _folder_files(folder)  # refuses a folder with nothing attached
        uploads = [(repo_id, str(folder), "Upload a model folder with hf_specdec speculative decoding attached")]
    else:
        uploads = [(f"{org}/{method}", custom_generate_path(method), "Update hf_specdec custom_generate method")
                   for method in methods or available_methods()]
    for repo_id, folder, message in uploads:
        if dry_run:
            print(f"would upload {folder} -> https://huggingface.co/{repo_id}")
            urls.append(repo_id)
            continue
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=message,
                                 ignore_patterns=["__pycache__/*", "*.pyc", ".*"])
        urls.append(str(info))
        print(f"published {repo_id}")
    return urls
