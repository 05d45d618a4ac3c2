"""Lowering: a schedule becomes forward and backward fx programs (`programs`), with the host buffer
pool and copy queues of offloaded activations (`offload_runtime`)."""
