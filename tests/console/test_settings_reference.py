"""docs/settings.md is generated from the settings modules: every setting has its one-line doc,
and the file says what the modules say (console.settings_reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from console.settings_reference import REFERENCE, env_reads, markdown, reference, settings_of, unlisted_env_reads


def test_every_setting_has_its_doc_and_every_environment_variable_one_setting():
    settings = reference()
    assert len(settings) > 150
    assert [f"{s.module}.{s.name}" for s in settings if not s.doc] == []
    names = [s.env for s in settings if s.env]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    by_name = {s.name: s for s in settings}
    assert (by_name["WORKER_HOST_LEASE_SECONDS"].env, by_name["WORKER_HOST_LEASE_SECONDS"].default) == (
        "WORKER_HOST_LEASE_SECONDS", "15.0"
    )  # fmt: skip


def test_the_reference_is_current():
    assert REFERENCE.read_text() == markdown(), "docs/settings.md is stale: run python manage.py settings_reference"
    call_command("settings_reference", "--check")


def test_a_setting_without_its_doc_is_found(tmp_path: Path, monkeypatch):
    module = tmp_path / "extra.py"
    module.write_text('import os\n\n#: Documented.\nGOOD = os.environ.get("GOOD", "1")\nBARE = envint("BARE", 3)\n')
    found = {s.name: s for s in settings_of(module)}
    assert (found["GOOD"].doc, found["GOOD"].env, found["GOOD"].default) == ("Documented.", "GOOD", '"1"')
    assert (found["BARE"].doc, found["BARE"].env, found["BARE"].default) == ("", "BARE", "3")
    monkeypatch.setattr("console.management.commands.settings_reference.reference", lambda: list(found.values()))
    with pytest.raises(CommandError, match=r"extra\.BARE"):
        call_command("settings_reference", "--check")


def test_every_environment_read_is_a_setting_of_its_own(tmp_path: Path, monkeypatch):
    assert unlisted_env_reads() == []
    module = tmp_path / "extra.py"
    module.write_text(
        '#: Ticks.\nSCHEDULE = {"tick": every(envfloat("TICK_SECONDS", 2.0))}\nX = {"y": envint("Y", 1)}\n'
    )
    assert env_reads(module) == [("TICK_SECONDS", 2), ("Y", 3)]
    monkeypatch.setattr("console.settings_reference.SETTINGS_DIR", tmp_path)
    # SCHEDULE's row takes TICK_SECONDS as its own (the first read); a second read would not be listed.
    module.write_text('#: Ticks.\nS = [envfloat("A", 1.0), envfloat("B", 2.0)]\n')
    assert unlisted_env_reads() == ["extra:2 B"]
