"""Fault injection on the network between agents and managers: a TCP proxy that cuts, swallows and delays."""
