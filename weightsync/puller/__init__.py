"""The engine host's side of the core: a host-local checkpoint brought up to a published
version (plan, seed, apply the chain in place, verify), its marker, identity and lock, and the
positions an update changed.
"""
