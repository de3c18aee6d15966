"""The gpumgr agent: GPU source, container runtime, memory meter and the link to the manager."""
