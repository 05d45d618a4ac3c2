"""CP-SAT models: save or recompute per activation (`remat`), the relaxation that bounds and repairs
(`bound`), the exact forward order (`order`), one window's reorder (`window`); `common` runs them."""
