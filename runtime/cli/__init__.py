"""runtime.cli: the `specmoe` command line (typer), one module per command group.

`app.py` builds the typer app and maps errors to one line and exit code 2; each other module
registers its commands. Commands call the other packages through their exported names only.
"""
