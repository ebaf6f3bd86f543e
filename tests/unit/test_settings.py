"""Every PARTITA_* setting is checked: a value partita cannot use is a SettingsError naming the variable, the value,
what it takes and an example; a PARTITA_* variable partita does not read gets a warning naming the close match."""

import os
from pathlib import Path

import pytest

from partita import settings
from partita.cli.main import main
from partita.errors import PartitaError, SettingsError


@pytest.fixture(autouse=True)
def no_settings(monkeypatch):
    """Each test starts from an environment without PARTITA_* variables (the developer's own stay out)."""
    for name in [n for n in os.environ if n.startswith(settings.PREFIX)]:
        monkeypatch.delenv(name)


def refused(monkeypatch, name: str, value: str) -> str:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as e:
        settings.READERS[name]()
    return str(e.value)


def test_the_error_is_partitas():
    assert issubclass(SettingsError, PartitaError)


def test_defaults_when_nothing_is_set():
    assert settings.memory_limit() is None
    assert settings.profile_mode() == "measure"
    assert settings.timeout_s() == 300.0
    assert settings.log_enabled() is True
    assert settings.cache_dir() == Path.home() / ".cache" / "partita"
    assert settings.stop_file() is None and settings.resume_file() is None
    assert settings.check() == []


@pytest.mark.parametrize("text, size", [("512MiB", 512 * 2**20), ("1.5 GB", 3 * 2**29), ("1e3", 1000),
                                        ("2k", 2048), ("7", 7)])
def test_memory_limit_reads_sizes(monkeypatch, text, size):
    monkeypatch.setenv("PARTITA_MEMORY_LIMIT", text)
    assert settings.memory_limit() == size


@pytest.mark.parametrize("text", ["0", "0GiB", "-1", "-512MiB", "0.1", "lots", "12 parsecs", "nan", "inf", "1e400"])
def test_memory_limit_refuses_what_is_no_size_above_zero(monkeypatch, text):
    assert refused(monkeypatch, "PARTITA_MEMORY_LIMIT", text) == (
        f"PARTITA_MEMORY_LIMIT={text!r} is not valid: PARTITA_MEMORY_LIMIT takes a memory size above 0, in bytes or "
        "with a unit (KiB, MiB, GiB, TiB; KB, MB, GB, TB count in 1024s too), for example PARTITA_MEMORY_LIMIT=512MiB")


def test_parse_bytes_says_what_it_cannot_read():
    with pytest.raises(ValueError, match="cannot read 'lots' as a size; write e.g. 512MiB or 40GB"):
        settings.parse_bytes("lots")


@pytest.mark.parametrize("text, mode", [("measure", "measure"), ("estimate", "estimate"), (" Estimate ", "estimate")])
def test_profile_mode(monkeypatch, text, mode):
    monkeypatch.setenv("PARTITA_PROFILE", text)
    assert settings.profile_mode() == mode


def test_profile_mode_refuses_others(monkeypatch):
    assert refused(monkeypatch, "PARTITA_PROFILE", "fast") == (
        "PARTITA_PROFILE='fast' is not valid: PARTITA_PROFILE takes 'measure' (the default) or 'estimate', "
        "for example PARTITA_PROFILE=estimate")


def test_timeout(monkeypatch):
    monkeypatch.setenv("PARTITA_TIMEOUT_S", "2.5")
    assert settings.timeout_s() == 2.5


@pytest.mark.parametrize("text", ["0", "-5", "ten", "nan", "inf", "1e10"])
def test_timeout_refuses_what_is_no_positive_finite_number(monkeypatch, text):
    assert refused(monkeypatch, "PARTITA_TIMEOUT_S", text) == (
        f"PARTITA_TIMEOUT_S={text!r} is not valid: PARTITA_TIMEOUT_S takes a number of seconds above 0 and at most "
        "1e9, for example PARTITA_TIMEOUT_S=600")


@pytest.mark.parametrize("text, on", [("on", True), ("off", False), ("OFF", False)])
def test_log_switch(monkeypatch, text, on):
    monkeypatch.setenv("PARTITA_LOG", text)
    assert settings.log_enabled() is on


def test_log_switch_refuses_others(monkeypatch):
    assert refused(monkeypatch, "PARTITA_LOG", "quiet") == (
        "PARTITA_LOG='quiet' is not valid: PARTITA_LOG takes 'on' (the default) or 'off', for example PARTITA_LOG=off")


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "not yet"))
    assert settings.cache_dir() == tmp_path / "not yet"
    monkeypatch.setenv("PARTITA_CACHE_DIR", "~/cache")
    assert settings.cache_dir() == Path.home() / "cache"


def test_cache_dir_refuses_a_file(monkeypatch, tmp_path):
    (tmp_path / "f").write_text("")
    assert refused(monkeypatch, "PARTITA_CACHE_DIR", str(tmp_path / "f")).startswith(
        f"PARTITA_CACHE_DIR={str(tmp_path / 'f')!r} is not valid: PARTITA_CACHE_DIR takes a directory, or a path where "
        "one can be created")


@pytest.mark.parametrize("name", ["PARTITA_STOP_FILE", "PARTITA_RESUME_FILE"])
def test_files_refuse_a_directory(monkeypatch, tmp_path, name):
    monkeypatch.setenv(name, str(tmp_path / "job.stop"))
    assert settings.READERS[name]() == str(tmp_path / "job.stop")
    assert refused(monkeypatch, name, str(tmp_path)).startswith(
        f"{name}={str(tmp_path)!r} is not valid: {name} takes the path of a file (not a directory)")


@pytest.mark.parametrize("name", sorted(settings.READERS))
def test_an_empty_value_is_refused_not_taken_for_the_default(monkeypatch, name):
    message = refused(monkeypatch, name, "")
    assert message.startswith(f"{name} is set but empty: unset it for the default, or set it to ")
    assert f"for example {name}=" in message


def test_check_names_every_bad_value_at_once(monkeypatch):
    monkeypatch.setenv("PARTITA_MEMORY_LIMIT", "0")
    monkeypatch.setenv("PARTITA_TIMEOUT_S", "-1")
    with pytest.raises(SettingsError) as e:
        settings.check()
    lines = str(e.value).splitlines()
    assert [line.split("=")[0] for line in lines] == ["PARTITA_MEMORY_LIMIT", "PARTITA_TIMEOUT_S"]


@pytest.mark.parametrize("typo, meant", [("PARTITA_MEMORY_LIMT", "PARTITA_MEMORY_LIMIT"),
                                         ("PARTITA_TIMEOUT", "PARTITA_TIMEOUT_S"),
                                         ("PARTITA_CACHEDIR", "PARTITA_CACHE_DIR")])
def test_an_unknown_variable_is_a_warning_naming_the_close_match(monkeypatch, typo, meant):
    monkeypatch.setenv(typo, "1")
    assert settings.check() == [
        f"{typo} is set, but partita reads no such setting: did you mean {meant}? partita reads PARTITA_CACHE_DIR, "
        "PARTITA_LOG, PARTITA_MEMORY_LIMIT, PARTITA_OVERLAP, PARTITA_PROFILE, PARTITA_RESUME_FILE, PARTITA_STOP_FILE, "
        "PARTITA_SWITCH_LAYOUT, PARTITA_TIMEOUT_S, PARTITA_UNVERIFIED_CHECKPOINTS"]


def test_an_unknown_variable_like_no_setting_is_a_warning_without_a_guess(monkeypatch):
    monkeypatch.setenv("PARTITA_DEBUG", "1")
    [warning] = settings.check()
    assert warning.startswith("PARTITA_DEBUG is set, but partita reads no such setting: partita reads ")


def test_the_command_refuses_a_bad_value_before_starting_anything(monkeypatch, tmp_path, capsys):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('started')\n")
    monkeypatch.setenv("PARTITA_MEMORY_LIMIT", "-1GiB")
    assert main(["run", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script)]) == 2
    assert capsys.readouterr().err == (
        "partita run: PARTITA_MEMORY_LIMIT='-1GiB' is not valid: PARTITA_MEMORY_LIMIT takes a memory size above 0, "
        "in bytes or with a unit (KiB, MiB, GiB, TiB; KB, MB, GB, TB count in 1024s too), for example "
        "PARTITA_MEMORY_LIMIT=512MiB\n")
    assert not (tmp_path / "logs").exists()


def test_the_command_warns_of_an_unknown_variable(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PARTITA_PROFIL", "estimate")
    assert main(["run", "-n", "1", str(tmp_path / "missing.py")]) == 2  # no such script: nothing starts
    err = capsys.readouterr().err
    assert err.startswith("partita run: warning: PARTITA_PROFIL is set, but partita reads no such setting: did you "
                          "mean PARTITA_PROFILE? ")


@pytest.mark.parametrize("text, allowed", [(None, False), ("off", False), ("on", True), (" ON ", True)])
def test_unverified_checkpoints_are_refused_unless_switched_on(monkeypatch, text, allowed):
    if text is None:
        monkeypatch.delenv("PARTITA_UNVERIFIED_CHECKPOINTS", raising=False)
    else:
        monkeypatch.setenv("PARTITA_UNVERIFIED_CHECKPOINTS", text)
    assert settings.unverified_checkpoints_allowed() is allowed

