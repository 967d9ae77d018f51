"""`lily fetch`: download a checkpoint's needed files with huggingface_hub.

Progress bars and resuming come from huggingface_hub itself (an interrupted download continues from
its `.incomplete` file). Before downloading we ask the Hub for the sizes (a dry run), subtract what
is already on disk and check the free space. Offline, a complete local copy is accepted as is.
"""

import shutil
from pathlib import Path

from lilycli.checkpoint import DEFAULT_REPO, KNOWN_REPOS, NEEDED_PATTERNS, missing_files
from lilycli.errors import LilyError

# Room left free beyond the download itself: huggingface_hub writes each file beside its final place.
HEADROOM = 1 << 30


def _hub():
    # Imported here so that `lily serve/chat/bench` never pay huggingface_hub's import time.
    import huggingface_hub
    from huggingface_hub import errors

    return huggingface_hub, errors


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser().resolve()
    while not path.exists():
        path = path.parent
    return path


def check_free_space(target: Path, needed: int) -> None:
    """Refuse to start a download that cannot fit (names the sizes and the place)."""
    place = _existing_ancestor(target)
    free = shutil.disk_usage(place).free
    if needed + HEADROOM > free:
        raise LilyError(
            f"not enough disk space in {place}: the download needs {human_bytes(needed)} "
            f"(+{human_bytes(HEADROOM)} headroom) and only {human_bytes(free)} is free. "
            "Free some space or choose another place with --dir."
        )


def _cache_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def local_copy(repo: str, revision: str | None, directory: Path | None) -> Path | None:
    """A complete copy of `repo` already on disk (in `directory` or the Hugging Face cache), without the network."""
    if directory is not None:
        return directory if directory.is_dir() and not missing_files(directory) else None
    hub, errors = _hub()
    try:
        path = Path(
            hub.snapshot_download(repo, revision=revision, allow_patterns=NEEDED_PATTERNS, local_files_only=True)
        )
    except (errors.LocalEntryNotFoundError, OSError, ValueError):  # incomplete snapshots are OSErrors too
        return None
    return path if not missing_files(path) else None


def _offline_error(repo: str, error: Exception) -> LilyError:
    return LilyError(
        f"cannot reach the Hugging Face Hub ({type(error).__name__}: {error}) and no complete copy of "
        f"{repo} is on disk. Connect to the network (and unset HF_HUB_OFFLINE) and run `lily fetch` "
        "again; it resumes where it stopped."
    )


def _hub_error(repo: str, revision: str | None, error: Exception) -> LilyError | None:
    """A clear message for the Hub's refusals, or None if `error` is not one of them."""
    _, errors = _hub()
    if isinstance(error, errors.GatedRepoError):
        return LilyError(
            f"{repo} is gated: accept its conditions at https://huggingface.co/{repo}, then log in "
            "(`hf auth login`, or set HF_TOKEN) and run `lily fetch` again."
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return LilyError(f"{repo} has no revision {revision!r}")
    if isinstance(error, errors.RepositoryNotFoundError):
        return LilyError(
            f"{repo} was not found on the Hugging Face Hub (or it is private: log in with `hf auth login`)"
        )
    if isinstance(error, errors.HFValidationError):
        return LilyError(f"{repo!r} is not a Hugging Face repo id (expected ORG/NAME): {error}", exit_code=2)
    return None


def _is_offline(error: Exception) -> bool:
    _, errors = _hub()
    # Some of these exist only in recent huggingface_hub releases.
    names = ("OfflineModeIsEnabled", "LocalEntryNotFoundError", "DryRunError", "IncompleteSnapshotError")
    offline_types = (ConnectionError, TimeoutError, *(getattr(errors, n) for n in names if hasattr(errors, n)))
    if isinstance(error, offline_types):
        return True
    # huggingface_hub's HTTP stack raises its own transport errors; recognise them by name.
    return type(error).__name__ in {"ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException"}


def fetch(repo: str = DEFAULT_REPO, revision: str | None = None, directory: Path | None = None, log=print) -> Path:
    """Download the files of `repo` the engine needs; return the model directory."""
    local = Path(repo).expanduser()
    if local.is_dir():  # a checkpoint already on disk: nothing to download, only check it
        missing = missing_files(local)
        if missing:
            raise LilyError(f"{local} is a directory but not a complete checkpoint: missing {', '.join(missing)}")
        return local
    hub, _ = _hub()
    if repo not in KNOWN_REPOS:
        log(f"warning: {repo} is not one of the checkpoints Lily knows ({', '.join(KNOWN_REPOS)}); "
            "the engine only runs the Qwen3.6-35B-A3B architecture.")  # fmt: skip
    where = {"local_dir": str(directory)} if directory is not None else {}

    try:
        plan = hub.snapshot_download(repo, revision=revision, allow_patterns=NEEDED_PATTERNS, dry_run=True, **where)
    except Exception as e:  # sorted into clear messages below
        # A dry run wraps the Hub's answer (gated, not found, unreachable) in a DryRunError.
        cause = e.__cause__ if type(e).__name__ == "DryRunError" and e.__cause__ is not None else e
        refusal = _hub_error(repo, revision, cause)
        if refusal is not None:
            raise refusal from e
        if not _is_offline(cause):
            raise LilyError(f"asking the Hugging Face Hub about {repo} failed: {type(cause).__name__}: {cause}") from e
        copy = local_copy(repo, revision, directory)
        if copy is None:
            raise _offline_error(repo, cause) from e
        log(f"offline: using the complete copy already at {copy} (not checked for updates)")
        return copy

    to_download = [f for f in plan if f.will_download]
    needed = sum(f.file_size or 0 for f in to_download)
    total = sum(f.file_size or 0 for f in plan)
    label = KNOWN_REPOS.get(repo, "")
    log(f"{repo}{f' ({label})' if label else ''}: {len(plan)} files, {human_bytes(total)}; "
        f"{len(to_download)} to download ({human_bytes(needed)})")  # fmt: skip
    if to_download:
        check_free_space(directory if directory is not None else _cache_root(), needed)
    try:
        path = Path(hub.snapshot_download(repo, revision=revision, allow_patterns=NEEDED_PATTERNS, **where))
    except KeyboardInterrupt:
        raise LilyError("download interrupted; run the same `lily fetch` again to resume", exit_code=130) from None
    except Exception as e:
        refusal = _hub_error(repo, revision, e)
        if refusal is not None:
            raise refusal from e
        if _is_offline(e):
            raise _offline_error(repo, e) from e
        raise LilyError(f"downloading {repo} failed: {type(e).__name__}: {e}. Run `lily fetch` again to resume.") from e
    missing = missing_files(path)
    if missing:
        raise LilyError(f"{path} is still missing {', '.join(missing)} after the download; run `lily fetch` again")
    return path
