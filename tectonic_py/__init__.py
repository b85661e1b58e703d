"""tectonic_py."""
