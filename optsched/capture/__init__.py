"""Capture: the graph types everything below the compile hooks reads (the joint graph indexed by storage
and phase, its fingerprint), what users write that cannot be captured (capture errors), and what callers
do with a step's outputs (output usage, gradients handed to the backward). Imports nothing of optsched
but the solvers' data types: the compile hooks that drive planning live above, in `optsched.compiler`."""
