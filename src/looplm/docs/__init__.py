"""The project's docs built from its results files: render.py (`looplm docs render`)."""
