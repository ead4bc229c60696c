"""forge runtime package. Import-light: loads no Typer, Rich or Jinja2.

The decorator/loader shim (`forge.optimize`, `forge.load`, `forge.explain`) is tracked in issue 3;
this package currently holds the pieces the shim and the CLI share: specs, the environment
fingerprint and the cache.
"""

from forge._version import __version__

__all__ = ["__version__"]
