"""A request's inputs as every part of the app names them, below the model families: media items
and their placeholder ranges, position plans (M-RoPE's among them), an item's encoder output."""
