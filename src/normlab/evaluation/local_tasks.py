"""Three small lm-evaluation-harness tasks built from the default corpus, shipped with normlab so that
evaluation is tested offline and any run can be scored without a dataset hub.

All items come from the last 9% of the Shakespeare corpus: inside the validation split of every
run with ``val_fraction`` >= 0.1 (the default; the 1% margin covers BPE token boundaries), so a
trained model has not seen them. The corpus is split at blank lines into blocks; a speech is a
block whose first line is its speaker ("PANDARUS.").

- ``normlab_shakespeare_next_line`` (multiple choice, acc / acc_norm): a speech's speaker and first
  lines; which of four lines comes next? The three others are lines of other speeches of similar
  length (0.7-1.4x), so length alone does not give the answer away. Chance: 25%.
- ``normlab_shakespeare_speaker`` (generate_until "\\n", exact_match): about 400 characters of a
  scene ending at a speech boundary; generate the next speaker's line.
- ``normlab_shakespeare_ppl`` (loglikelihood_rolling: word/byte perplexity, bits per byte):
  passages of consecutive blocks, 800+ characters each.

`build(text)` is deterministic; ``python -m normlab.evaluation.local_tasks`` rewrites the shipped
JSONL files from the cached corpus (`normlab data fetch`).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"
HOLDOUT = 0.09  # the last 9% of the corpus
SPEAKER = re.compile(r"^[A-Z][A-Z' .,-]*[A-Z]\.$")


def _blocks(text: str) -> list[list[str]]:
    blocks, cur = [], []
    for line in text.splitlines():
        if line.strip():
            cur.append(line.rstrip())
        elif cur:
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    return blocks


def _is_speech(block: list[str]) -> bool:
    return len(block) >= 2 and bool(SPEAKER.match(block[0].strip()))


def _evenly(items: list, n: int) -> list:
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def next_line_items(blocks: list[list[str]], n: int, rng: random.Random) -> list[dict]:
    lines = [line for b in blocks if _is_speech(b) for line in b[1:] if len(line.strip()) >= 20]
    cands = []
    for b in blocks:
        if _is_speech(b) and len(b) >= 4:
            k = len(b) - 2  # context: speaker + all but the last line
            answer = b[k + 1]
            if len(answer.strip()) >= 20:
                cands.append((b[: k + 1], answer))
    items = []
    for context, answer in _evenly(cands, n):
        pool = [ln for ln in lines if ln != answer and 0.7 <= len(ln) / len(answer) <= 1.4 and ln not in context]
        choices = rng.sample(pool, 3) + [answer]
        rng.shuffle(choices)
        items.append({"context": "\n".join(context) + "\n", "choices": choices, "label": choices.index(answer)})
    return items


def speaker_items(blocks: list[list[str]], n: int, min_chars: int = 400) -> list[dict]:
    cands = []
    for i in range(1, len(blocks)):
        if not (_is_speech(blocks[i]) and _is_speech(blocks[i - 1])):
            continue
        j, size = i, 0
        while j > 0 and size < min_chars:
            j -= 1
            size += sum(len(x) + 1 for x in blocks[j]) + 1
        if size >= min_chars:
            context = "\n\n".join("\n".join(b) for b in blocks[j:i]) + "\n\n"
            cands.append({"context": context, "target": blocks[i][0].strip()})
    return _evenly(cands, n)


def passage_items(blocks: list[list[str]], n: int, min_chars: int = 800) -> list[dict]:
    passages, cur = [], []
    for b in blocks:
        cur.append("\n".join(b))
        if sum(len(x) + 2 for x in cur) >= min_chars:
            passages.append({"text": "\n\n".join(cur)})
            cur = []
    return _evenly(passages, n)


def build(
    text: str, n_choice: int = 200, n_speaker: int = 100, n_passages: int = 40, seed: int = 0
) -> dict[str, list[dict]]:
    """The three tasks' items from a corpus text (its last `HOLDOUT` fraction)."""
    held = text[int(len(text) * (1 - HOLDOUT)) :]
    held = held[held.find("\n\n") + 2 :]  # start at a block boundary
    blocks = _blocks(held)
    return {
        "next_line": next_line_items(blocks, n_choice, random.Random(seed)),
        "speaker": speaker_items(blocks, n_speaker),
        "passages": passage_items(blocks, n_passages),
    }


def write(items: dict[str, list[dict]], out: Path = TASKS_DIR) -> None:
    from normlab.io import atomic_write_bytes

    for name, rows in items.items():
        atomic_write_bytes(out / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())


if __name__ == "__main__":
    from normlab.data.corpus import fetch_shakespeare

    corpus = fetch_shakespeare(quiet=True)
    built = build(corpus.read_text(encoding="utf-8"))
    write(built)
    print({k: len(v) for k, v in built.items()}, "->", TASKS_DIR)
