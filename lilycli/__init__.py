"""Lily's command line: a thin shell around the `lily-engine` binary (fetch, serve, chat, bench)."""

from importlib import metadata

try:
    __version__ = metadata.version("lily")
except metadata.PackageNotFoundError:  # running from a checkout without installing
    __version__ = "0.0.0+checkout"
