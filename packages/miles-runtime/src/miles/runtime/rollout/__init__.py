"""The rollout side: the rollout manager, its dispatcher onto engines, the producer (rollout
function, reward, filters), prompts, the sample ledger and the batch buffer."""
