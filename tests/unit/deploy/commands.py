"""Parsing a container's command line with the CLI it calls (adstream's Typer app, Ray's click
group), without running it: shared by the compose and k8s checks."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


class CommandError(Exception):
    """A command line its CLI would refuse (unknown command or option, bad value)."""


@lru_cache(maxsize=1)
def click_commands() -> dict[str, Any]:
    """The click groups behind the commands the adstream image runs: `adstream` (Typer, which
    vendors its own click) and `ray`."""
    import typer.main
    from ray.scripts.scripts import cli as ray_cli

    from deploy.cli import app

    return {"adstream": typer.main.get_command(app), "ray": ray_cli}


def parse(groups: dict[str, Any], argv: list[str]) -> str:
    """Parse `argv` exactly as its CLI would (options, types, arguments) without running it;
    returns the sub-command's name or raises CommandError."""
    group = groups[argv[0]]
    name, *rest = argv[1:]
    command = group.commands.get(name)
    if command is None:
        raise CommandError(f"{argv[0]} has no command {name!r} (has: {sorted(group.commands)})")
    try:
        command.make_context(f"{argv[0]} {name}", list(rest), resilient_parsing=False)
    except Exception as exc:  # click's or Typer's vendored click's UsageError
        if not any(c.__name__ == "UsageError" for c in type(exc).__mro__):
            raise
        raise CommandError(f"{' '.join(argv)}: {exc}") from exc
    return name
