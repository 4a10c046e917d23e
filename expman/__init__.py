"""expman: declarative experiment manager and artifact registry for EAGLE-3 drafters."""

__version__ = "0.1.0"
