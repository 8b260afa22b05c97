# The worker process of the `reward-python` reward plugin: imports the user's file once, then
# answers one JSON request per line on stdin with one JSON line on a private copy of stdout.
#
# Usage: python -c <this file> FILE FUNCTION SIGNATURE
#
# fd 1 is pointed at stderr before the user's file is imported, so `print`, C extensions writing to
# fd 1 and anything else the user's code writes land in the trainer's log and can never corrupt
# the protocol. The worker exits when stdin closes or when its parent dies.
#
# Replies: {"ready": ...} once, then per request either {"error": LAST_LINE, "traceback": TEXT}
# (the whole call failed) or {"scores": [float|null], "errors": {INDEX: LAST_LINE},
# "metrics": {NAME: [MEAN, COUNT]}}. Every string is valid UTF-8 (a lone surrogate in an exception
# message is written as its escape) and a message is cut at MAX_MESSAGE characters.
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
import traceback

MAX_MESSAGE = 2000

PROTO = os.fdopen(os.dup(1), "w", encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr


def clean(text, limit=None):
    """`text` as valid UTF-8 (lone surrogates escaped), cut at `limit` characters."""
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    if limit is not None and len(text) > limit:
        text = text[:limit] + f"… ({len(text) - limit} more characters)"
    return text


def cleaned(obj):
    if isinstance(obj, str):
        return clean(obj)
    if isinstance(obj, dict):
        return {clean(k): cleaned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cleaned(v) for v in obj]
    return obj


def send(obj):
    PROTO.write(json.dumps(cleaned(obj), allow_nan=False) + "\n")
    PROTO.flush()


def last_line(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    line = lines[-1].strip() if lines else type(exc).__name__
    return clean(line, MAX_MESSAGE)


def watch_parent(parent):
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            # The trainer is gone: end this worker's process group, with whatever the user's
            # function started in it.
            try:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            finally:
                os._exit(1)


def number(value, what):
    """A finite float, or None; numpy/torch scalars and bools accepted."""
    if value is None:
        return None
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        raise TypeError(f"{what}: expected a number or None, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what}: not a finite number ({value})")
    return value


def as_list(values, what):
    if hasattr(values, "tolist") and callable(values.tolist):
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what}: expected a list, got {type(values).__name__}")
    return list(values)


class Metrics:
    """Running means: a sum of large finite values (1e308 twice) would overflow, a mean cannot."""

    def __init__(self):
        self.sums = {}

    def add(self, name, value, count=1.0):
        s = self.sums.setdefault(str(name), [0.0, 0.0])
        total = s[1] + count
        # A weighted average of two finite numbers: never beyond the larger of them.
        s[0] = s[0] * (s[1] / total) + value * (count / total)
        s[1] = total

    def add_logged(self, name, value, n):
        """One OpenRLHF `extra_logs` entry: a value per sample or one for the call."""
        if hasattr(value, "tolist") and callable(value.tolist):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            for v in value:
                v = number(v, f"extra_logs[{name!r}]")
                if v is not None:
                    self.add(name, v)
        else:
            v = number(value, f"extra_logs[{name!r}]")
            if v is not None:
                self.add(name, v, n)


def batch_scores(values, n, what):
    """(scores, errors) of a batch function's result: one entry per sample."""
    values = as_list(values, what)
    if len(values) != n:
        raise ValueError(f"{what}: returned {len(values)} values for {n} samples")
    scores, errors = [], {}
    for i, v in enumerate(values):
        try:
            scores.append(number(v, f"{what}[{i}]"))
        except (TypeError, ValueError) as e:
            scores.append(None)
            errors[str(i)] = clean(str(e), MAX_MESSAGE)
    return scores, errors


def call_trl(fn, req):
    n = len(req["completions"])
    columns = req.get("columns", {})
    out = fn(prompts=req["prompts"], completions=req["completions"], completion_ids=req["completion_ids"], **columns)
    scores, errors = batch_scores(out, n, "the reward function")
    return {"scores": scores, "errors": errors, "metrics": {}}


def call_verl(fn, req):
    scores, errors, metrics = [], {}, Metrics()
    for i, s in enumerate(req["samples"]):
        try:
            out = fn(
                data_source=s.get("data_source"),
                solution_str=s["solution_str"],
                ground_truth=s.get("ground_truth"),
                extra_info=s.get("extra_info"),
            )
            if isinstance(out, dict):
                if "score" not in out:
                    raise KeyError(f"the returned dict has no 'score' (keys: {sorted(out)})")
                for key, value in out.items():
                    if key == "score":
                        continue
                    try:
                        value = number(value, key)
                    except (TypeError, ValueError):
                        continue  # verl keeps non-numeric extras for logging; they are no metric here
                    if value is not None:
                        metrics.add(key, value)
                out = out["score"]
            value = number(out, "compute_score")
            if value is None:
                raise TypeError("compute_score: returned None")
            scores.append(value)
        except Exception as e:  # one sample's failure does not fail the others
            scores.append(None)
            errors[str(i)] = last_line(e)
            print(f"reward-python: sample {i}: {traceback.format_exc()}", file=sys.stderr, flush=True)
    return {"scores": scores, "errors": errors, "metrics": metrics.sums}


def call_openrlhf(fn, req):
    n = len(req["queries"])
    out = fn(req["queries"], req["prompts"], req["labels"])
    metrics = Metrics()
    if isinstance(out, dict):
        if "rewards" not in out:
            raise KeyError(f"the returned dict has no 'rewards' (keys: {sorted(out)})")
        for name, value in (out.get("extra_logs") or {}).items():
            metrics.add_logged(name, value, n)
        out = out["rewards"]
    scores, errors = batch_scores(out, n, "reward_func")
    return {"scores": scores, "errors": errors, "metrics": metrics.sums}


CALLS = {"trl": call_trl, "verl": call_verl, "openrlhf": call_openrlhf}


def main():
    path, name, signature = sys.argv[1:4]
    parent = os.getppid()
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        spec = importlib.util.spec_from_file_location("rlhf_reward_user", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path} (not a Python file?)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        fn = getattr(module, name, None)
        if fn is None:
            found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise AttributeError(f"no function `{name}` in {path} (it defines: {', '.join(found) or 'nothing callable'})")
        if not callable(fn):
            raise TypeError(f"`{name}` in {path} is a {type(fn).__name__}, not a function")
    except BaseException as e:
        traceback.print_exc()
        send({"startup_error": last_line(e)})
        sys.exit(1)
    call = CALLS[signature]
    send({"ready": True, "pid": os.getpid(), "python": sys.version.split()[0]})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = call(fn, json.loads(line))
        except Exception as e:
            tb = traceback.format_exc()
            print(f"reward-python: {tb}", file=sys.stderr, flush=True)
            reply = {"error": last_line(e), "traceback": clean(tb[-10 * MAX_MESSAGE :])}
        send(reply)


main()
