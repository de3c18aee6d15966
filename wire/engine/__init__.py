"""Facts about the Docker engine shared by the agent, the guard and the plugin: GPU device nodes and
device paths, the engine's default runtime, capabilities and security options, Go's JSON, OCI
bundles and the hook's pipe format.

May import the rest of :mod:`gpumgr.wire` only.
"""
