"""The `slurmguard` command line.

Each area of the package owns its commands in its own module; this file only
maps command names to those modules and loads one when it is invoked, so that
`slurmguard --help` stays fast and a broken optional dependency of one area
(torch, cvxpy) cannot take the whole CLI down.

Other distributions add commands through the entry-point group `slurmguard.commands`
(name = "module:attribute" of a click command): the development tools in the checkout's
dev/ folder (distribution slurmguard-dev: `bench`, `devcluster`, `demo`) register theirs
there, so the product package never imports them and a node install does not carry them.
"""

from __future__ import annotations

import importlib
import sys
from functools import lru_cache
from typing import Any

import click

from slurmguard.errors import SlurmguardError
from slurmguard.extras import missing_extra

# command name -> "module:attribute" of a click.Command / click.Group
COMMANDS: dict[str, str] = {
    "nodes": "slurmguard.report.node_cli:nodes",
    "node": "slurmguard.report.node_cli:node",
    "db": "slurmguard.store.cli:db",
    "policy": "slurmguard.config_cli:policy",
    "ring": "slurmguard.hook.cli:ring",
    "detect": "slurmguard.detect.cli:detect",
    "whatif": "slurmguard.whatif.cli:whatif",
    "plan": "slurmguard.mitigate.cli:plan",
    "agent": "slurmguard.agent.cli:agent_cmd",
    "iterations": "slurmguard.agent.cli:iterations_cmd",
    "controller": "slurmguard.controller.cli:controller_cmd",
    "keys": "slurmguard.controller.cli:keys",
    "triage": "slurmguard.report.cli:triage",
    "incidents": "slurmguard.report.cli:incidents",
    "sweep": "slurmguard.sweeps.cli:sweep",
}

# Short help shown in `slurmguard --help` without importing the module.
HELP: dict[str, str] = {
    "nodes": "Show the fleet as Slurm and slurmguard see it.",
    "node": "Drain, resume or inspect one node.",
    "db": "Create or upgrade the database.",
    "policy": "Validate a policies.yaml file.",
    "ring": "Inspect per-rank collective rings.",
    "detect": "Run the detectors on recorded data.",
    "whatif": "What-if analysis of a job trace.",
    "plan": "Mitigation planners (micro-batch redistribution, consolidation).",
    "agent": "Run the node agent.",
    "iterations": "The iterations the agent derives from rings, per rank.",
    "controller": "Run the controller daemon.",
    "keys": "Derive a node's report key from the controller's master secret.",
    "triage": "Triage report of nodes that are not healthy.",
    "incidents": "List incidents with detection delay and outcome.",
    "sweep": "Run or inspect node sweeps.",
}

PLUGIN_GROUP = "slurmguard.commands"
"""Entry-point group through which other distributions add `slurmguard` commands."""

ELSEWHERE: dict[str, str] = {
    "bench": "slurmguard-dev",
    "devcluster": "slurmguard-dev",
    "demo": "slurmguard-dev",
}
"""Commands another distribution provides -> that distribution, for the error that says
how to install it (a name only: the product never imports it)."""

INSTALL_HINT = {
    "slurmguard-dev": "the development tools (local cluster, demo, benchmarks); "
    "from a source checkout: pip install ./dev",
}


@lru_cache(maxsize=1)
def plugin_commands() -> dict[str, str]:
    """Commands registered in the `slurmguard.commands` entry-point group: name ->
    "module:attribute". A product command of the same name wins (a plugin cannot
    replace `node drain`); the first distribution on sys.path wins among plugins."""
    from importlib.metadata import entry_points

    out: dict[str, str] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        if ep.name not in COMMANDS:
            out.setdefault(ep.name, ep.value)
    return out


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use.

    `commands_map`/`help_map` map a name to "module:attribute" and a short help.
    """

    commands_map: dict[str, str] = COMMANDS
    help_map: dict[str, str] = HELP

    def targets(self) -> dict[str, str]:
        return self.commands_map

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.targets())

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.targets().get(cmd_name)
        if target is None:
            return None
        if ctx.resilient_parsing or _listing_only(ctx):
            # `slurmguard --help` lists commands; avoid importing every area. A plugin's
            # help is its command's own: loading it must not break the listing.
            if cmd_name in self.help_map:
                return click.Command(cmd_name, help=self.help_map[cmd_name])
            try:
                return self.load(cmd_name, target)
            except (click.ClickException, SlurmguardError, ImportError, AttributeError) as exc:
                return click.Command(cmd_name, help=f"(unavailable: {exc})")
        return self.load(cmd_name, target)

    def load(self, cmd_name: str, target: str) -> click.Command:
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A command whose module is not built yet, or whose optional
            # dependency is missing, is reported, not a traceback.
            missing = exc.name or module_name
            need = missing_extra(missing, f"command '{cmd_name}'")
            if need is not None:
                raise need from None
            raise click.ClickException(
                f"command '{cmd_name}' is unavailable: module '{missing}' is not installed"
            ) from exc
        return getattr(module, attr)


class RootGroup(LazyGroup):
    """The top-level group: the product's commands plus those of installed plugins."""

    def targets(self) -> dict[str, str]:
        return {**plugin_commands(), **COMMANDS}

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        # A product command wins over any plugin of its name, so running one needs no
        # entry-point scan (importlib.metadata and every installed distribution's metadata:
        # a tenth of `slurmguard whatif`'s CPU time); listings still see the plugins.
        if cmd_name in COMMANDS and not (ctx.resilient_parsing or _listing_only(ctx)):
            return self.load(cmd_name, COMMANDS[cmd_name])
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        name = args[0] if args else None
        if name in ELSEWHERE and name not in self.targets():
            dist = ELSEWHERE[name]
            raise click.UsageError(
                f"command '{name}' comes with {dist}, which is not installed: "
                f"{INSTALL_HINT.get(dist, f'pip install {dist}')}",
                ctx,
            )
        return super().resolve_command(ctx, args)


def _listing_only(ctx: click.Context) -> bool:
    """True while click only lists this group's commands for --help."""
    args = sys.argv[1:]
    depth = 0
    c = ctx
    while c.parent is not None:
        depth += 1
        c = c.parent
    return len(args) > depth and args[depth] in ("--help", "-h")


@click.group(cls=RootGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    "db_url",
    envvar=None,
    default=None,
    help="Database URL (overrides SLURMGUARD_DB and policies.yaml).",
)
@click.option(
    "--policy",
    "policy_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Policy file (default: $SLURMGUARD_POLICY, /etc/slurmguard/policies.yaml, built-in; never ./). "
    "Run as root, it must be owned by root and not group/other-writable.",
)
@click.version_option(package_name="slurmguard")
@click.pass_context
def cli(ctx: click.Context, db_url: str | None, policy_path: str | None) -> None:
    """slurmguard: find grey GPU nodes, take them out safely, sweep them back."""
    ctx.ensure_object(dict)
    ctx.obj["db_url"] = db_url
    ctx.obj["policy_path"] = policy_path


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point: user mistakes become one-line errors, exit 2."""
    try:
        return cli.main(args=argv, prog_name="slurmguard", standalone_mode=True)
    except SlurmguardError as exc:
        click.echo(f"slurmguard: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except ModuleNotFoundError as exc:
        # a command that imports an optional dependency only when it runs
        need = missing_extra(exc.name, "this command")
        if need is None:
            raise
        click.echo(f"slurmguard: error: {need}", err=True)
        sys.exit(need.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:] if len(sys.argv) > 1 else [])
