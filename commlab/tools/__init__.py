"""The command line: ``commlab`` (cli) and ``commlab doctor``."""
