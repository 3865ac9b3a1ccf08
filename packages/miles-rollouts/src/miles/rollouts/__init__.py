"""Miles rollout functions and environments: how a prompt becomes samples (`single_turn`,
`multi_turn` over an environment) and the environments a multi-turn rollout talks to."""
