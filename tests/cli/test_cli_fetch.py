"""`lily fetch`: local copies, offline mode, Hub refusals and the disk-space check, all without the network.

HF_HUB_OFFLINE=1 is set for the whole session (conftest), so huggingface_hub itself refuses any
request; where a test needs the Hub to have answered, it replaces `snapshot_download` with a stand-in.
"""

from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import errors
from huggingface_hub.file_download import DryRunFileInfo
from lily_harness import COMMIT, hub_cache_copy, write_checkpoint
from typer.testing import CliRunner

from lilycli.checkpoint import is_needed
from lilycli.cli import app

runner = CliRunner()


def test_only_the_files_the_engine_reads_are_fetched():
    for name in ["config.json", "model-00003-of-00009.safetensors", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:  # fmt: skip
        assert is_needed(name), name
    for name in ["README.md", ".gitattributes", "vocab.json", "merges.txt", "preprocessor_config.json"]:
        assert not is_needed(name), name


def test_offline_a_complete_cached_copy_is_used(tmp_path):
    snapshot = hub_cache_copy("lily-test/complete")
    result = runner.invoke(app, ["fetch", "lily-test/complete"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == str(snapshot)
    assert "offline: using the complete copy" in result.stderr


def test_offline_an_incomplete_cached_copy_is_refused():
    snapshot = hub_cache_copy("lily-test/partial")
    (snapshot / "model-00002-of-00002.safetensors").unlink()  # an interrupted download
    result = runner.invoke(app, ["fetch", "lily-test/partial"])
    assert result.exit_code == 1
    assert "cannot reach the Hugging Face Hub" in result.stderr
    assert "no complete copy of lily-test/partial" in result.stderr
    assert "resumes" in result.stderr


def test_offline_with_nothing_on_disk_says_so():
    result = runner.invoke(app, ["fetch", "lily-test/never-downloaded"])
    assert result.exit_code == 1
    assert "cannot reach the Hugging Face Hub" in result.stderr
    assert "HF_HUB_OFFLINE" in result.stderr


def test_offline_a_complete_dir_is_used(tmp_path):
    target = write_checkpoint(tmp_path / "qwen")
    result = runner.invoke(app, ["fetch", "lily-test/in-dir", "--dir", str(target)])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == str(target)


def test_a_local_checkpoint_directory_is_checked_not_downloaded(tmp_path):
    target = write_checkpoint(tmp_path / "ckpt")
    assert runner.invoke(app, ["fetch", str(target)]).exit_code == 0
    (target / "tokenizer.json").unlink()
    result = runner.invoke(app, ["fetch", str(target)])
    assert result.exit_code == 1
    assert "missing tokenizer.json" in result.stderr


def test_an_index_naming_a_missing_shard_is_incomplete(tmp_path):
    target = write_checkpoint(tmp_path / "ckpt")
    (target / "model-00001-of-00002.safetensors").unlink()
    result = runner.invoke(app, ["fetch", str(target)])
    assert result.exit_code == 1
    assert "missing model-00001-of-00002.safetensors" in result.stderr


def bare(error_type):
    """A huggingface_hub error instance without building the HTTP response its constructor wants."""
    error = error_type.__new__(error_type)
    Exception.__init__(error, "403 Forbidden")
    return error


@pytest.mark.parametrize(
    ("error_type", "message"),
    [
        (errors.GatedRepoError, "is gated: accept its conditions at https://huggingface.co/Qwen/Qwen3.6-35B-A3B"),
        (errors.RepositoryNotFoundError, "was not found on the Hugging Face Hub"),
        (errors.RevisionNotFoundError, "has no revision 'v9'"),
    ],
)
@pytest.mark.parametrize("in_dry_run", [False, True])
def test_hub_refusals_get_a_clear_message(monkeypatch, error_type, message, in_dry_run):
    def refuse(*args, **kwargs):
        if in_dry_run:  # huggingface_hub's dry run re-raises the Hub's refusal as a DryRunError
            raise errors.DryRunError("Dry run cannot be performed") from bare(error_type)
        raise bare(error_type)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    result = runner.invoke(app, ["fetch", "Qwen/Qwen3.6-35B-A3B", "--revision", "v9"])
    assert result.exit_code == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


class FakeHub:
    """Answers snapshot_download's dry run with `plan` and, for the real call, writes a checkpoint."""

    def __init__(self, plan_sizes: dict[str, int], writes=True):
        self.plan_sizes = plan_sizes
        self.writes = writes
        self.downloads = []

    def __call__(self, repo_id, *, revision=None, allow_patterns=None, dry_run=False, local_dir=None, **_):
        assert allow_patterns is not None and "*.safetensors" in allow_patterns
        if dry_run:
            return [
                DryRunFileInfo(COMMIT, size, name, f"/x/{name}", False, True) for name, size in self.plan_sizes.items()
            ]
        self.downloads.append(repo_id)
        target = Path(local_dir)
        if self.writes:
            write_checkpoint(target, shards=("model.safetensors",))
        return str(target)


def test_a_download_that_cannot_fit_is_refused_before_it_starts(monkeypatch, tmp_path):
    hub = FakeHub({"config.json": 3000, "model-00001-of-00004.safetensors": 10**18})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    result = runner.invoke(app, ["fetch", "--dir", str(tmp_path / "q")])
    assert result.exit_code == 1
    assert "not enough disk space" in result.stderr and "1000000.0 TB" in result.stderr
    assert hub.downloads == []


def test_a_download_reports_its_plan_and_prints_the_model_directory(monkeypatch, tmp_path):
    hub = FakeHub({"config.json": 3000, "model.safetensors": 5 * 10**6})
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    result = runner.invoke(app, ["fetch", "--dir", str(tmp_path / "q")])
    assert result.exit_code == 0, result.stderr
    assert hub.downloads == ["mlx-community/Qwen3.6-35B-A3B-4bit"]
    assert "2 files, 5.0 MB; 2 to download (5.0 MB)" in result.stderr
    assert result.stdout.strip() == str(tmp_path / "q")


def test_a_download_that_leaves_files_missing_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({"config.json": 10}, writes=False))
    (tmp_path / "q").mkdir()
    result = runner.invoke(app, ["fetch", "--dir", str(tmp_path / "q")])
    assert result.exit_code == 1
    assert "still missing config.json, tokenizer.json" in result.stderr


def test_an_unknown_repo_is_fetched_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({"model.safetensors": 10}))
    result = runner.invoke(app, ["fetch", "someone/other-model", "--dir", str(tmp_path / "o")])
    assert result.exit_code == 0
    assert "warning: someone/other-model is not one of the checkpoints Lily knows" in result.stderr
