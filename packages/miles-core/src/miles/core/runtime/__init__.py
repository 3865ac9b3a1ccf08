"""Ray orchestration: placement, the rollout manager and engines, the train group, the loop."""
