"""The atomic swap of a staged checkpoint into place, and the clean-up after killed saves (single process)."""

import os

import pytest

from fabric_hsdp.checkpoint.core import commit


def make_dir(path, content):
    path.mkdir()
    (path / "data").write_text(content)
    return path


def content(path):
    return (path / "data").read_text()


def hidden(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("exchange", [True, False])
def test_commit_replaces_the_previous_checkpoint(tmp_path, monkeypatch, exchange):
    if not exchange:  # a filesystem without renameat2(RENAME_EXCHANGE): two renames, the old copy parked between
        monkeypatch.setattr(commit, "_exchange", lambda first, second: False)
    target = make_dir(tmp_path / "ckpt", "old")
    commit.commit(make_dir(commit.pending_path(target), "new"), target)
    assert content(target) == "new"
    assert hidden(tmp_path) == []
    commit.commit(make_dir(commit.pending_path(tmp_path / "fresh"), "first"), tmp_path / "fresh")
    assert content(tmp_path / "fresh") == "first"


def test_fallback_puts_the_previous_checkpoint_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "_exchange", lambda first, second: False)
    target = make_dir(tmp_path / "ckpt", "old")
    pending = make_dir(commit.pending_path(target), "new")
    rename = os.rename

    def failing_rename(source, dest):
        if os.fspath(source) == os.fspath(pending):
            raise OSError(28, "No space left on device")
        rename(source, dest)

    monkeypatch.setattr(commit.os, "rename", failing_rename)
    with pytest.raises(OSError, match="No space left"):
        commit.commit(pending, target)
    assert content(target) == "old"
    assert hidden(tmp_path) == [pending.name]  # rank 0 discards it next
    commit.discard(pending)
    assert hidden(tmp_path) == []


def test_leftovers_are_removed_and_a_parked_only_copy_is_restored(tmp_path):
    target = tmp_path / "ckpt"
    # killed between the fallback's two renames: the previous checkpoint is parked and `ckpt` is missing
    parked = make_dir(tmp_path / ".ckpt.previous-0123456789ab", "old")
    stale = make_dir(commit.pending_path(target), "half")
    make_dir(tmp_path / "other", "keep")
    commit.remove_leftovers(target)
    assert content(target) == "old"
    assert not parked.exists() and not stale.exists()
    assert content(tmp_path / "other") == "keep"
    # with `ckpt` present, a parked copy is an old one: removed
    make_dir(tmp_path / ".ckpt.previous-ba9876543210", "older")
    commit.remove_leftovers(target)
    assert content(target) == "old" and hidden(tmp_path) == []


def test_discard_removes_only_its_pending_directory(tmp_path):
    target = tmp_path / "ckpt"
    parked = make_dir(tmp_path / ".ckpt.previous-0123456789ab", "old")
    pending = make_dir(commit.pending_path(target), "new")
    commit.discard(pending)
    assert not pending.exists() and content(parked) == "old"
