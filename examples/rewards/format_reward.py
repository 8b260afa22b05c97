"""A format reward as a TRL reward function: 1.0 when the completion is one short final answer.

    [[rewards]]
    plugin = "reward-python"
    name = "format"
    weight = 0.1
    [rewards.config]
    file = "examples/rewards/format_reward.py"

A completion counts as well formed when, stripped, it is a single number or a `\\boxed{...}`
answer, optionally after a `<think>...</think>` block (DeepSeek-R1's format).
"""
import re

_ANSWER = re.compile(r"^(?:<think>.*?</think>\s*)?(?:-?\d+(?:\.\d+)?|.*\\boxed\{.+\}.*)$", re.DOTALL)


def reward_func(completions, **kwargs):
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(1.0 if _ANSWER.match(text.strip()) else 0.0)
    return out
