"""The ``tectonic`` command: one module per group of subcommands, on top of everything."""
