"""How plug-ins are named and found: registries keyed by config names, user functions by `module:fn`."""
