"""Layer 2: tasks, tools, the agent harness, rewards and the scripted expert (imports core and sandbox only).

Invariants: hidden tests never enter the agent's workspace; scoring always runs in a fresh sandbox with the
task's protected files restored; the harness is token-exact (see ``harness``).
"""

from tandem.env.expert import expert_corpus, expert_transcript
from tandem.env.harness import run_session
from tandem.env.reward import score
from tandem.env.tasks import SYSTEM_PROMPT, TOOLS, generate_task, get_task, task_split
from tandem.env.tools import ToolResult, execute_tool

__all__ = [
    "SYSTEM_PROMPT",
    "TOOLS",
    "ToolResult",
    "execute_tool",
    "expert_corpus",
    "expert_transcript",
    "generate_task",
    "get_task",
    "run_session",
    "score",
    "task_split",
]
