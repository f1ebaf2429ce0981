"""Regenerate the bundled tiny data sets (deterministic; text written for this project).

    python scripts/generate_example_data.py     # writes toolkit/bundled/examples/data/*.jsonl

pretrain.jsonl: {"text": ...} short documents of simple facts (arithmetic, capitals, animals,
counting). sft.jsonl: half {"prompt", "response"} rows, half {"messages": [...]} chat rows (some
with a system turn, some with two exchanges). The facts are regular, so a tiny model learns them
in a few hundred steps and the validation loss visibly falls.
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


if __name__ == "__main__":
    main()
