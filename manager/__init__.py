"""The gpumgr manager: the machine × GPU map, the scheduler, the REST API and the agent link."""
