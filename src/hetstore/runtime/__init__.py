"""The runtime: units of parameters, their movement between tiers, and the hooks."""
