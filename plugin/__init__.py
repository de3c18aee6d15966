"""The ``docker gpu`` CLI plugin and the node-side pieces Swarm needs (see the Swarm issue)."""
