"""A local lm-evaluation-harness task pair, written by the tests (no hub dataset): a multiple-choice task (scored by
loglikelihood: lm-eval's `local-completions` asks the server with `echo` + `logprobs`) and a short-answer task
(`generate_until`, greedy). YAML with `dataset_path: json` over a jsonl of our own, passed with `--include_path`.
"""

from __future__ import annotations

import json
from pathlib import Path

MC_TASK, GEN_TASK = "optb_mc", "optb_gen"

# (question, choices, index of the answer): a few dozen, short enough for the tiny model's 64-token build.
MULTIPLE_CHOICE: list[tuple[str, list[str], int]] = [
    ("What is the capital of France?", ["Paris", "London", "Rome"], 0),
    ("How many legs does a dog have?", ["two", "four", "six"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue"], 2),
    ("Which animal says moo?", ["cow", "cat", "duck"], 0),
    ("What is 2 + 2?", ["3", "4", "5"], 1),
    ("What do bees make?", ["milk", "silk", "honey"], 2),
    ("Which is the largest planet?", ["Jupiter", "Mars", "Venus"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand"], 1),
    ("How many days are in a week?", ["five", "ten", "seven"], 2),
    ("What is the opposite of hot?", ["cold", "tall", "loud"], 0),
    ("Which fruit is yellow and long?", ["cherry", "banana", "grape"], 1),
    ("What do cows drink?", ["oil", "juice", "water"], 2),
    ("What is the capital of Japan?", ["Tokyo", "Paris", "Cairo"], 0),
    ("Which season is the coldest?", ["summer", "winter", "spring"], 1),
    ("How many hours are in a day?", ["12", "60", "24"], 2),
    ("What gas do people breathe in?", ["oxygen", "helium", "neon"], 0),
    ("Which animal can fly?", ["fish", "bird", "horse"], 1),
    ("What is 10 minus 3?", ["5", "13", "7"], 2),
    ("Where does the sun rise?", ["east", "west", "north"], 0),
    ("What do you use to write on paper?", ["spoon", "pen", "shoe"], 1),
    ("Which one is a vegetable?", ["apple", "plum", "carrot"], 2),
    ("What is the capital of Italy?", ["Rome", "Madrid", "Oslo"], 0),
    ("How many wheels does a bicycle have?", ["three", "two", "four"], 1),
    ("What falls from clouds when it rains?", ["sand", "snow", "water"], 2),
]

# (question, answer): greedy answers are compared as text, whatever they are worth.
SHORT_ANSWER: list[tuple[str, str]] = [
    ("What is the capital of France?", "Paris"),
    ("What is 3 + 4?", "7"),
    ("Name a color of the rainbow.", "red"),
    ("What do bees make?", "honey"),
]
GEN_TOKENS = 12


def _task(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
            f"test_split: test\n{body}")


def write_tasks(root: Path) -> Path:
    """Both tasks' jsonl and YAML under `root` (the `--include_path`); returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                          for q, c, a in MULTIPLE_CHOICE), encoding="utf-8")
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in SHORT_ANSWER), encoding="utf-8")
    (root / f"{MC_TASK}.yaml").write_text(_task(MC_TASK, mc, (
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")), encoding="utf-8")
    (root / f"{GEN_TASK}.yaml").write_text(_task(GEN_TASK, gen, (
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_target: answer\n"
        f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n'
        "  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")),
        encoding="utf-8")
    return root
