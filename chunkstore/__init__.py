"""chunkstore."""
