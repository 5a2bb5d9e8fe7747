"""Uploading final/ to the Hugging Face Hub: `python -m trainer push RUN_DIR --repo-id ORG/NAME`,
or `hub.push_at_end` as a run ends.

huggingface_hub's own API does it all: the repository created if missing (`create_repo`), the
branch (`create_branch`), and one commit of every file of the folder (`create_commit`, which
uploads large files through the Hub's LFS or Xet storage, as the Hub tells it). The token is
its to read (HF_TOKEN, or `hf auth login`); nothing here sees it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from trainer.errors import ConfigError, TrainerError, describe
from trainer.exit_codes import Exit

log = logging.getLogger(__name__)


class PushError(TrainerError):
    """The Hub refused or failed the upload; the files are where they were. Exit 1: a retry
    may get through."""

    exit_code = Exit.CRASH


def folder_of(run_dir: Path, adapter: bool) -> Path:
    """What a run pushes: final/, or its adapter alone (final/adapter/, export_adapter)."""
    folder = run_dir / "final" / ("adapter" if adapter else "")
    if not (folder / ("adapter_config.json" if adapter else "config.json")).is_file():
        what = "final/adapter/ (a run with checkpoint.export_adapter)" if adapter else "final/ (a run that ended)"
        raise ConfigError(f"push: {run_dir}: no {what} to push")
    return folder


def push(folder: Path, repo_id: str, private: bool = True, revision: str | None = None) -> str:
    """Upload every file of `folder` to `repo_id` (at branch `revision`, None: main) as one
    commit; returns its URL. A repository it creates is `private`; one that exists keeps its
    visibility. Raises PushError with the Hub's reason."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.create_commit(
            repo_id, revision=revision, commit_message=f"Upload {folder.name}/ from python -m trainer",
            operations=[CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=path)
                        for path in files])
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise PushError(f"push: {repo_id}: {describe(e)}") from None
    log.info("pushed %d files of %s to %s", len(files), folder, commit.commit_url)
    return commit.commit_url
