"""Settings: flags win over TOKENBUS_* variables, which win over defaults; bad values stop the process."""

from __future__ import annotations

import pytest

from services.cli import parser
from shared.runtime.settings import Settings, load


def test_defaults() -> None:
    assert load(environ={}) == Settings()


def test_environment_then_flags() -> None:
    env = {"TOKENBUS_PORT": "9000", "TOKENBUS_REQUEST_TIMEOUT_S": "1.5", "TOKENBUS_MODEL": "x"}
    args = parser().parse_args(["edge", "--port", "9100"])
    settings = load(args, environ=env)
    assert (settings.port, settings.request_timeout_s, settings.model) == (9100, 1.5, "x")


def test_bad_value_is_refused() -> None:
    with pytest.raises(SystemExit, match="port"):
        load(environ={"TOKENBUS_PORT": "eighty"})
    with pytest.raises(SystemExit, match="stream_interval"):
        load(environ={"TOKENBUS_STREAM_INTERVAL": "0"})


@pytest.mark.parametrize("command", ["run", "edge", "worker"])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parser().parse_args([command, "--help"])
    assert exited.value.code == 0
    assert "--redis-url" in capsys.readouterr().out


def test_every_setting_is_in_the_readme() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [name for name in Settings.__struct_fields__ if f"`TOKENBUS_{name.upper()}`" not in readme]
    assert missing == []


def test_every_setting_is_a_flag_of_the_commands_that_read_it() -> None:
    """README: every setting is a flag too (12 were only variables, `--write-stall-s` among them)."""
    from services import cli

    run_only = {"embedding_model", "embedding_model_dir"}
    assert [name for name in Settings.__struct_fields__
            if name not in {*cli.EDGE_SETTINGS, *cli.WORKER_SETTINGS, *run_only}] == []
    assert set(Settings.__struct_fields__) == set(cli.RUN_SETTINGS)
    edge = parser(["edge"]).parse_args(["edge", "--write-stall-s", "5", "--dispatch", "blind"])
    worker = parser(["worker"]).parse_args(["worker", "--reasoning-parser", "qwen3", "--grammar-compile-s", "9"])
    assert (load(edge, environ={}).write_stall_s, load(edge, environ={}).dispatch) == (5.0, "blind")
    assert (load(worker, environ={}).reasoning_parser, load(worker, environ={}).grammar_compile_s) == ("qwen3", 9.0)


def test_every_setting_the_readme_gives_a_command_is_a_flag_of_it() -> None:
    """A row of the README's settings table that says what "an edge" or "a worker" does with it documents a flag
    of `tokenbus edge` or `tokenbus worker` (`--redis-pool-size` was read by workers but refused as their flag)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \| `TOKENBUS_\w+` \| [^|]* \| (.*) \|$", readme, re.MULTILINE)
    assert len(rows) == len(Settings.__struct_fields__)
    documented = [(command.split()[-1].lower(), flag) for flag, meaning in rows
                  for command in sorted(set(re.findall(r"\b(?:an edge|a worker)\b", meaning, re.IGNORECASE)))]
    assert ("worker", "--redis-pool-size") in documented and ("edge", "--shutdown-grace-s") in documented
    refused = []
    for command, flag in documented:
        try:
            parser([command]).parse_args([command, flag, "1"])
        except SystemExit:
            refused.append((command, flag))
    assert refused == []
