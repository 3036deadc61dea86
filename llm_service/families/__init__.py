"""LM faces of the model families (see `mmserve.families` for the registry)."""
