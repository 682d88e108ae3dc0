"""The MGPU_* settings: one declaration each, checked readers, start-up checks, docs, --env.

Framework-free and fast: every check runs in this process (mgpu-train's ``main``,
``mgpu.init()`` on one process, the engine factory without a framework).
"""

import pathlib
import re

import os

import pytest

from mgpu_launcher import cli
from mgpu_launch.config import settings
from mgpu_launch.config.settings import SETTINGS, SettingError, SettingWarning

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: the value each checked type refuses (text takes anything)
BAD = {"integer": "two", "number": "big", "seconds": "soon", "flag": "maybe",
       "choice": "nonsense", "address": "no-port", "ipv4": "no-ip"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No MGPU_* variable of the caller's environment leaks in; warnings count afresh."""
    import os
    for name in [n for n in os.environ if n.startswith("MGPU_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(settings, "_warned", set())


# -- the readers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("reader, name, value, message", [
    (settings.integer, "MGPU_PREFETCH", "two",
     "MGPU_PREFETCH='two': expected the number of batches to copy to the device ahead of the "
     "step (a whole number >= 0; 0 turns device prefetch off), e.g. MGPU_PREFETCH=2"),
    (settings.integer, "MGPU_STALL_PORT", "70000",
     "MGPU_STALL_PORT='70000': expected a TCP port number 1-65535"),
    (settings.number, "MGPU_FUSION_MB", "big",
     "MGPU_FUSION_MB='big': expected a number of MiB >= 0, e.g. MGPU_FUSION_MB=64"),
    (settings.number, "MGPU_FUSION_MB", "-1", "MGPU_FUSION_MB='-1': expected a number of MiB"),
    (settings.number, "MGPU_FUSION_MB", "nan", "MGPU_FUSION_MB='nan': expected a number of MiB"),
    (settings.seconds, "MGPU_TORCH_TIMEOUT", "0",
     "MGPU_TORCH_TIMEOUT='0': expected a number of seconds > 0, e.g. MGPU_TORCH_TIMEOUT=1800"),
    (settings.seconds, "MGPU_STALL_SHUTDOWN_S", "soon",
     "MGPU_STALL_SHUTDOWN_S='soon': expected a number of seconds > 0 (or 'off'), e.g. "
     "MGPU_STALL_SHUTDOWN_S=600"),
    (settings.flag, "MGPU_TORCH_OVERLAP", "maybe",
     "MGPU_TORCH_OVERLAP='maybe': expected a flag: 1/true/yes/on or 0/false/no/off, e.g. "
     "MGPU_TORCH_OVERLAP=0"),
    (settings.choice, "MGPU_TF_TRANSPORT", "udp",
     "MGPU_TF_TRANSPORT='udp': expected one of collective, mpi, e.g. MGPU_TF_TRANSPORT=mpi"),
    (settings.text, "MGPU_JAX_COORDINATOR", "host-without-port",
     "MGPU_JAX_COORDINATOR='host-without-port': expected HOST:PORT, e.g. "
     "MGPU_JAX_COORDINATOR=10.0.0.1:29500"),
])
def test_a_bad_value_names_the_variable_the_value_and_an_example(reader, name, value, message,
                                                                   monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingError) as raised:
        reader(name)
    assert str(raised.value).startswith(message)
    assert isinstance(raised.value, ValueError)  # callers that caught ValueError still do


def test_good_values_blanks_and_defaults():
    assert settings.integer("MGPU_PREFETCH", {"MGPU_PREFETCH": " 3 "}) == 3
    assert settings.number("MGPU_FUSION_MB", {"MGPU_FUSION_MB": "0.5"}) == 0.5
    assert settings.seconds("MGPU_STALL_WARNING_S", {"MGPU_STALL_WARNING_S": "OFF"}) is None
    assert settings.choice("MGPU_TF_COLLECTIVE", {"MGPU_TF_COLLECTIVE": "Ring"}) == "ring"
    assert settings.text("MGPU_TORCH_ADDRESS", {"MGPU_TORCH_ADDRESS": "[::1]:29500"}) == \
        "[::1]:29500"
    # unset or empty: the declared default, or the caller's
    assert settings.seconds("MGPU_STALL_WARNING_S", {"MGPU_STALL_WARNING_S": ""}) == 60.0
    assert settings.number("MGPU_FUSION_MB", {}, fallback=25.0) == 25.0
    assert settings.flag("MGPU_STALL_INSPECTOR", {}) is True


@pytest.mark.parametrize("word", ["1", "true", "YES", "On", "0", "false", "No", "OFF"])
def test_every_flag_takes_one_set_of_spellings(word):
    expected = word.lower() in ("1", "true", "yes", "on")
    for name in [n for n, s in SETTINGS.items() if s.kind == "flag"]:
        assert settings.flag(name, {name: word}) is expected, name


def test_reading_an_undeclared_name_or_the_wrong_type_is_a_programming_error():
    with pytest.raises(KeyError, match="MGPU_NOPE is not declared"):
        settings.integer("MGPU_NOPE")
    with pytest.raises(TypeError, match="MGPU_FUSION_MB is declared as number, read as flag"):
        settings.flag("MGPU_FUSION_MB")


# -- start-up checks ------------------------------------------------------------------------------
CHECKED = sorted(name for name, s in SETTINGS.items() if s.kind in BAD)


@pytest.mark.parametrize("name", CHECKED)
@pytest.mark.parametrize("argv", [["-np", "2"], []], ids=["standalone", "worker"])
def test_mgpu_train_refuses_a_bad_value_of_any_variable(name, argv, monkeypatch, capsys):
    value = BAD[SETTINGS[name].kind]
    monkeypatch.setenv(name, value)
    assert cli.main([*argv, "-c", "raise SystemExit(5)"]) == 2  # the program never ran
    err = capsys.readouterr().err
    assert err.startswith(f"mgpu-train: error: {name}={value!r}: expected ") and \
        f"e.g. {name}=" in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["::", "::1", "[fe80::1]"])
def test_an_ipv6_bind_address_is_refused_at_the_start_with_the_reason(value, monkeypatch,
                                                                      capsys):
    # Issue 51, item 5: '::' passed the check, then every rank failed init with advice about
    # the stall inspector's port, not the address family.
    monkeypatch.setenv("MGPU_BIND_ADDRESS", value)
    assert cli.main(["-np", "2", "-c", "raise SystemExit(5)"]) == 2  # the program never ran
    err = capsys.readouterr().err
    assert f"MGPU_BIND_ADDRESS={value!r}: an IPv6 address; the job's listeners" in err, err
    assert "bind IPv4 only. Expected an IPv4 address of rank 0's host" in err, err
    assert settings.text("MGPU_BIND_ADDRESS", {"MGPU_BIND_ADDRESS": "0.0.0.0"}) == "0.0.0.0"


def test_a_bad_value_given_with_x_is_refused_too(capsys):
    assert cli.main(["-np", "2", "-x", "MGPU_FUSION_MB=big", "-c", "pass"]) == 2
    assert "MGPU_FUSION_MB='big': expected a number of MiB >= 0" in capsys.readouterr().err


def test_mgpu_init_refuses_a_bad_value_before_it_starts_anything(monkeypatch):
    from mgpu_launch import runtime
    monkeypatch.setenv("MGPU_STALL_PORT", "http")
    with pytest.raises(SettingError, match="MGPU_STALL_PORT='http': expected a TCP port"):
        runtime.init()
    assert not runtime.is_initialized()


def test_a_typo_is_a_warning_naming_the_closest_setting(monkeypatch, capsys):
    monkeypatch.setenv("MGPU_FUSION_MBS", "32")
    monkeypatch.setenv("MGPU_SOMETHING_ELSE_ENTIRELY", "1")
    assert settings.unknown_names() == [
        "MGPU_FUSION_MBS is not a setting of mgpu-launch and is ignored (did you mean "
        "MGPU_FUSION_MB?)",
        "MGPU_SOMETHING_ELSE_ENTIRELY is not a setting of mgpu-launch and is ignored "
        "(mgpu-train --env lists the known ones)"]
    # mgpu-train warns and goes on; mgpu.init() in the same process does not repeat it. A job
    # of one process runs in this process and exports its variables here (MGPU_RANK, RANK,
    # MASTER_ADDR, KERAS_DISTRIBUTION_*...): they must not reach the jobs later tests start
    # from this pytest worker, which then read as torchrun's (CI's 2026-11-29 run: 5 failures)
    saved = dict(os.environ)
    try:
        assert cli.main(["-c", "pass"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved)
    err = capsys.readouterr().err
    assert "mgpu-train: warning: MGPU_FUSION_MBS is not a setting" in err and \
        "did you mean MGPU_FUSION_MB?" in err
    from mgpu_launch import runtime
    monkeypatch.setattr(settings, "_warned", set())
    with pytest.warns(SettingWarning, match="did you mean MGPU_FUSION_MB"):
        runtime.init()
    runtime.shutdown()


def test_a_bad_fusion_size_no_longer_falls_back_to_the_base_engine(monkeypatch):
    from mgpu_launch import backends
    monkeypatch.setattr(backends, "_engine", None)
    assert type(backends.get_engine_or_default("no-such-backend")) is backends.KerasOnly
    with pytest.raises(backends.UnknownBackend, match="supported: jax, tensorflow, torch"):
        backends.get_engine("no-such-backend")
    monkeypatch.setenv("MGPU_FUSION_MB", "big")
    for backend in ("jax", "torch"):
        with pytest.raises(SettingError, match="MGPU_FUSION_MB='big'"):
            backends.get_engine_or_default(backend)


# -- one table: code, docs, --env ---------------------------------------------------------------
def test_the_docs_table_is_the_declarations():
    docs = (ROOT / "docs" / "settings.md").read_text()
    assert docs == settings.markdown(), (
        "docs/settings.md differs from mgpu_launch/config/settings_table.py: run "
        "`python -m mgpu_launch.config.settings --markdown > docs/settings.md`")


def test_every_variable_the_project_mentions_is_declared():
    mentioned = set()
    for folder in ("mgpu_launcher", "mgpu_launch", "docs", "scripts", "tests", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".md", ".sh") and path.name != "test_settings.py":
                mentioned |= set(re.findall(r"\bMGPU_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    mentioned |= set(re.findall(r"\bMGPU_[A-Z0-9_]*[A-Z0-9]\b", (ROOT / "README.md").read_text()))
    assert sorted(mentioned - set(SETTINGS)) == []


def test_the_library_reads_settings_only_through_the_settings_module():
    read = re.compile(r"""environ(\.get\(\s*|\.pop\(\s*|\[\s*)["']MGPU_""")
    found = []
    for folder in ("mgpu_launcher", "mgpu_launch"):
        for path in (ROOT / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if read.search(line) and not re.search(r"\]\s*=[^=]", line):  # writes are fine
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_env_lists_every_setting_with_its_value_and_where_it_came_from(monkeypatch, capsys):
    monkeypatch.setenv("MGPU_FUSION_MB", "32")
    monkeypatch.setenv("MGPU_TORCH_OVERLAP", "later")  # shown, not refused: --env is for that
    assert cli.main(["--env"]) == 0
    report = capsys.readouterr().out
    listed = re.findall(r"^  (MGPU_\w+) += (.*)$", report, re.MULTILINE)
    assert [name for name, _ in listed] == [
        n for n, s in SETTINGS.items() if s.reader in (settings.LAUNCHER, settings.RANKS)]
    values = dict(listed)
    assert values["MGPU_FUSION_MB"] == "32  (environment; default 64 (JAX), 25 (torch))"
    assert values["MGPU_TORCH_OVERLAP"] == "'later' (INVALID)  (environment; default 1)"
    assert values["MGPU_STALL_WARNING_S"] == "60  (default)"
    assert "MGPU_RANK" not in values  # internal: set by mgpu-train
    assert "MiB per fused gradient allreduce buffer" in report
