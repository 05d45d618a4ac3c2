"""Graph passes on a captured forward-only program before planning: restore eager's ops, fold
copy-back writes, split foreach ops, batch per-parameter scalars (`prepare.prepare_inference` runs them)."""
