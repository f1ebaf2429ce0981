"""Regenerate the bundled tiny data sets (deterministic; text written for this project).

    python scripts/generate_example_data.py     # writes toolkit/bundled/examples/data/*.jsonl

pretrain.jsonl: {"text": ...} short documents of simple facts (arithmetic, capitals, animals,
counting). sft.jsonl: half {"prompt", "response"} rows, half {"messages": [...]} chat rows (some
with a system turn, some with two exchanges). dpo.jsonl and dpo_text.jsonl: preference pairs,
the SFT questions with the right answer chosen and a wrong one of the same shape rejected, in
TRL's formats: conversational rows with a prompt and without one (the shared user turn is the
prompt) in dpo.jsonl, string {"prompt", "chosen", "rejected"} rows in dpo_text.jsonl (one form
per file: HF datasets reads a column that holds strings in some rows and lists in others as
JSON text, which turns a string like " 3." into a number).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen"]
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Poland": "Warsaw", "Greece": "Athens", "India": "New Delhi", "China": "Beijing",
    "Chile": "Santiago", "Cuba": "Havana", "Ireland": "Dublin", "Portugal": "Lisbon",
    "Sweden": "Stockholm", "Austria": "Vienna",
}
ANIMALS = {
    "cat": ("small", "meows", "fish"), "dog": ("loyal", "barks", "meat"),
    "cow": ("large", "moos", "grass"), "duck": ("small", "quacks", "seeds"),
    "horse": ("fast", "neighs", "hay"), "sheep": ("woolly", "bleats", "grass"),
    "lion": ("strong", "roars", "meat"), "owl": ("wise", "hoots", "mice"),
    "frog": ("green", "croaks", "flies"), "bee": ("busy", "buzzes", "nectar"),
}
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow",
          "blood": "red", "an orange": "orange", "a plum": "purple"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def fact(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(9)
        return f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    if kind == 1:
        country = rng.choice(list(CAPITALS))
        return f"The capital of {country} is {CAPITALS[country]}."
    if kind == 2:
        animal = rng.choice(list(ANIMALS))
        size, sound, food = ANIMALS[animal]
        return rng.choice([f"The {animal} is {size}.", f"The {animal} {sound}.",
                           f"The {animal} eats {food}."])
    if kind == 3:
        thing = rng.choice(list(COLORS))
        return f"The color of {thing} is {COLORS[thing]}."
    if kind == 4:
        i = rng.randrange(7)
        return f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    start = rng.randrange(8)
    return "Counting: " + ", ".join(NUMBERS[start:start + 4]) + "."


def qa(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(9)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        country = rng.choice(list(CAPITALS))
        return (f"What is the capital of {country}?",
                f"The capital of {country} is {CAPITALS[country]}.")
    if kind == 2:
        animal = rng.choice(list(ANIMALS))
        return f"What sound does the {animal} make?", f"The {animal} {ANIMALS[animal][1]}."
    if kind == 3:
        word = rng.choice(list(ANIMALS) + ["apple", "river", "stone", "cloud"])
        return f"Spell the word {word} backwards.", " ".join(reversed(word)) + "."
    i = rng.randrange(7)
    return f"Which day comes after {DAYS[i]}?", f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}."


def wrong_answer(rng: random.Random, question: str, answer: str) -> str:
    """The answer to ``question`` with a wrong fact of the same shape (the rejected completion)."""
    words = question.rstrip("?.").split()
    if question.startswith("What is the capital"):
        country = words[-1]
        other = rng.choice([c for c in CAPITALS.values() if c != CAPITALS[country]])
        return f"The capital of {country} is {other}."
    if question.startswith("What is"):
        a, b = int(words[2]), int(words[4])
        return f"{a} plus {b} is {a + b + rng.choice([-2, -1, 1, 2, 3])}."
    if question.startswith("What sound"):
        animal = words[-2]
        other = rng.choice([s for _, s, _ in ANIMALS.values() if s != ANIMALS[animal][1]])
        return f"The {animal} {other}."
    if question.startswith("Spell"):
        return " ".join(words[3]) + "."  # forwards
    day = words[-1]
    other = rng.choice([d for d in DAYS if d not in (day, DAYS[(DAYS.index(day) + 1) % 7])])
    return f"{other} comes after {day}."


def preference_row(rng: random.Random, text: bool, implicit: bool) -> dict:
    prompt, chosen = qa(rng)
    rejected = wrong_answer(rng, prompt, chosen)
    if text:
        return {"prompt": f"Question: {prompt}\nAnswer:", "chosen": f" {chosen}",
                "rejected": f" {rejected}"}
    user = [{"role": "user", "content": prompt}]
    if implicit:
        return {"chosen": user + [{"role": "assistant", "content": chosen}],
                "rejected": user + [{"role": "assistant", "content": rejected}]}
    return {"prompt": user, "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def main() -> None:
    rng = random.Random(20260)
    out = Path(__file__).resolve().parents[1] / "toolkit" / "bundled" / "examples" / "data"
    with open(out / "pretrain.jsonl", "w") as f:
        for _ in range(1600):
            text = " ".join(fact(rng) for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"text": text}) + "\n")
    with open(out / "sft.jsonl", "w") as f:
        for i in range(900):
            prompt, response = qa(rng)
            if i % 2 == 0:
                row = {"prompt": prompt, "response": response}
            else:
                messages = []
                if rng.random() < 0.3:
                    messages.append({"role": "system", "content": "Answer in one short sentence."})
                messages += [{"role": "user", "content": prompt},
                             {"role": "assistant", "content": response}]
                if rng.random() < 0.3:
                    p2, r2 = qa(rng)
                    messages += [{"role": "user", "content": p2},
                                 {"role": "assistant", "content": r2}]
                row = {"messages": messages}
            f.write(json.dumps(row) + "\n")
    pref = random.Random(20270)  # its own stream: the files above stay as they were
    for name, count, text in (("dpo.jsonl", 400, False), ("dpo_text.jsonl", 200, True)):
        with open(out / name, "w") as f:
            for i in range(count):
                f.write(json.dumps(preference_row(pref, text, implicit=i % 3 == 2)) + "\n")


if __name__ == "__main__":
    main()
