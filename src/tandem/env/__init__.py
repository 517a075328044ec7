"""Layer 2: tasks, tools, the agent harness, rewards and the scripted expert (imports core and sandbox only)."""
