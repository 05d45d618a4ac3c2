"""Search strategies: the overall strategy (`strategy.solve`), heuristics, reordering windows,
offload planning and fusion groups on the problem."""
