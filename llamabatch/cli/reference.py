"""The command line as one Click command: what the docs' CLI reference (mkdocs-click) reads."""

import typer

from . import app

command = typer.main.get_command(app)
