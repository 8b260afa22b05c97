"""Answer checking with Hugging Face's math-verify (`pip install math-verify`), as a TRL reward function.

    [[rewards]]
    plugin = "reward-python"
    [rewards.config]
    file = "examples/rewards/math_verify_reward.py"

1.0 when the completion's answer is mathematically equal to the gold answer (`\\frac{1}{2}`, `0.5`
and `\\boxed{1/2}` are the same answer), 0.0 when not, None when the gold answer cannot be parsed
(TRL's convention: the function does not apply to that sample). The gold answer is the dataset's
label column, whatever `data.label_key` names it (`solution` in TRL's examples, `answer` in GSM8K).
"""
from math_verify import parse, verify


def _text(completion):
    # TRL's conversational format: a list of messages, the last one the model's.
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def reward_func(completions, **kwargs):
    golds = kwargs.get("solution") or kwargs.get("answer") or kwargs.get("label")
    if golds is None:
        raise KeyError("no gold answers: name the label column solution, answer or label (data.label_key)")
    rewards = []
    for completion, gold in zip(completions, golds):
        gold_parsed = parse(str(gold)) if gold is not None else []
        if not gold_parsed:
            rewards.append(None)
            continue
        rewards.append(1.0 if verify(gold_parsed, parse(_text(completion))) else 0.0)
    return rewards
