"""A stand-in LLM for tests/test_llm.py, speaking forge's command protocol: reads the round's JSON document on
stdin, answers with candidates. Its behaviour is the first argument: good (valid, untried points: the first of
each variant's grid it has not seen, up to 20 per variant: the space's validity rule is not in the document, so some are
rejected, as a real model's would be; plus one unknown variant), fail (exit 3), garbage (no JSON),
slow (sleeps past the timeout)."""

import itertools
import json
import sys
import time

mode = sys.argv[1] if len(sys.argv) > 1 else "good"
doc = json.loads(sys.stdin.read())
if mode == "fail":
    print("quota exceeded", file=sys.stderr)
    sys.exit(3)
if mode == "garbage":
    print("I think BLOCK=512 would be nice")
    sys.exit(0)
if mode == "slow":
    time.sleep(30)
tried = {(h["variant"], json.dumps(h["params"], sort_keys=True)) for h in doc["history"]}
out = [{"variant": "no_such_variant", "params": {}}]
for variant, grid in doc["space"]["variants"].items():
    names = sorted(grid)
    mine = 0
    for values in itertools.product(*(grid[n] for n in names)):
        params = dict(zip(names, values, strict=True))
        if (variant, json.dumps(params, sort_keys=True)) not in tried and mine < 20:
            out.append({"variant": variant, "params": params})
            mine += 1
print(json.dumps({"candidates": out, "usage": {"input_tokens": 100 + len(doc["history"]), "output_tokens": 20}}))
