"""How long llguidance's GBNF-to-Lark converter (pure Python) takes as a grammar's rules grow: the basis of
MAX_GBNF_RULES (fovea/core/sampling_params.py). A chain of rules, each naming the next, and one rule of many
alternatives for contrast.

    python benchmarks/gbnf_convert.py [RULES ...]
"""

from __future__ import annotations

import sys
import time

from llguidance.gbnf_to_lark import gbnf_to_lark


def seconds(text: str) -> float:
    start = time.perf_counter()
    gbnf_to_lark(text)
    return time.perf_counter() - start


def main(counts: list[int]) -> None:
    print("rules  chars  chain_s  | alternatives  chars  one_rule_s")
    for n in counts:
        chain = "root ::= r0\n" + "".join(f'r{i} ::= "x{i}" r{i + 1} | "y"\n' for i in range(n)) + f'r{n} ::= "z"\n'
        wide = "root ::= " + " | ".join(f'"w{i}"' for i in range(10 * n)) + "\n"
        print(f"{n:5d} {len(chain):6d} {seconds(chain):8.3f}  | {10 * n:12d} {len(wide):6d} {seconds(wide):10.3f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [250, 500, 1000, 2000, 4000])
