"""The Ray actors and their groups: train ranks (a backend each) and rollout engines."""
