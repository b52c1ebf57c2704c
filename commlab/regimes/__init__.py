"""Worker-side regimes, one module each, found through :mod:`commlab.core.registry`."""
