"""metadata."""
