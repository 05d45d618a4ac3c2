"""Capture: the torch.compile backend's hooks, the joint graph, its fingerprint, the offline fake-tensor
capture and the SDPA kernel prediction, what users write (capture errors) and what callers do with outputs."""
