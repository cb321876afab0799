"""The package's version, stated once: pagoda.__version__, the server's
/version and the wheel (tools/build_wheel.py reads this file)."""

__version__ = "0.1.0"
