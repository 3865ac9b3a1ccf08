"""Miles runtime: the RL loop and its Ray orchestration, the memory planner, and `miles run`."""
