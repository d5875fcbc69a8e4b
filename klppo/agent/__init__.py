"""Multi-turn rollouts: the conversation loop that runs a rollout engine, tools and interactions turn by turn
(:mod:`klppo.agent.multi_turn`)."""
