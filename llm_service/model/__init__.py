"""The model on its device: the LM, the step runner, attention, KV pool, batch rows, graphs, kernels."""
