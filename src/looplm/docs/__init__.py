"""The project's docs built from its results files: `looplm docs render` (cli.py)."""
