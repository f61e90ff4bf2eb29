"""The `specmoe` command line (typer). Each command group lives in its own module of runtime/cli/.

Invariant: bad input ends in one line on stderr, `specmoe: error: ...`, naming what was wrong and
what was expected (click's usage errors too: bad flag, missing option, out-of-range value), exit
code 2, and no traceback unless --debug is given. `--version` and `-h` work on every command.
"""

from __future__ import annotations

import logging
import sys

import click
import typer

from runtime.cli.errors import error_line, usage_line

# Plain click help (rich_markup_mode=None): on/off flags read `--x / --no-x` with no `<bool>`
# placeholder, and `-h` works everywhere (click passes help_option_names down to subcommands).
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 120}
app = typer.Typer(
    name="specmoe",
    help="Run Mixture-of-Experts models larger than memory: experts paged from SSD into a budgeted cache, "
    "speculative decoding with expert prefetch, output identical to the resident model.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
    context_settings=CONTEXT,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("specmoe")
        except PackageNotFoundError:
            v = "unknown (not installed)"
        typer.echo(f"specmoe {v}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks and debug logs."),
          mac_settings: str = typer.Option(None, "--mac-settings", envvar="SPECMOE_MAC_SETTINGS",
                                           help="macOS only: auto (default), off, or e.g. fast_synch=on,wired_limit=off "
                                                "(wired limit, command buffers, fast-synch; see runtime/macos)."),
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")):
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from runtime.macos import apply_at_startup

    _, applied = apply_at_startup(mac_settings)
    if applied:
        logging.getLogger("specmoe.macos").info("Mac settings applied: %s", ", ".join(applied))


def _register() -> None:
    from runtime.cli import chat, demo, doctor, generate, plan, plan_pipeline, profile, selfcheck, serve, store, tune

    for group in (demo, selfcheck, generate, chat, serve, store, profile, tune, plan, plan_pipeline, doctor):
        group.register(app)


_register()
_COMMAND = None


def command():
    """The click command tree `main` runs: typer's, with the root's eager `--version` added to every
    subcommand and group, so `--version` works wherever `-h` does. Built once."""
    global _COMMAND
    if _COMMAND is None:
        import copy

        import typer.main

        root = typer.main.get_command(app)
        version = next(p for p in root.params if p.name == "version")

        def add(group) -> None:
            for sub in getattr(group, "commands", {}).values():
                shared = copy.copy(version)
                shared.expose_value = False  # the command bodies do not take it
                sub.params.append(shared)
                add(sub)

        add(root)
        _COMMAND = root
    return _COMMAND


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        rv = command().main(args=args, prog_name="specmoe", standalone_mode=False)
        return rv if isinstance(rv, int) else 0  # typer.Exit(code) comes back as a return value
    except (typer.Exit, click.exceptions.Exit) as e:
        return e.exit_code
    except (typer.Abort, click.exceptions.Abort, KeyboardInterrupt):
        print("specmoe: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:
        # Usage errors (typer vendors its own click, so match by shape, not class).
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            if debug:
                raise
            print(usage_line(e), file=sys.stderr)
            return 2
        if debug or not isinstance(e, (ValueError, OSError, RuntimeError)):
            raise
        print(error_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
