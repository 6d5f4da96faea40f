"""Replace the "share of the matmul rate" rows of the visits JSONs of 2026-12-02 by "computed
(uncached) tokens/s" rows, from the same JSON's saturation runs.

Those two runs measured the matmul rate once, at start (386 and 205 GFLOP/s on the same machine:
the second while the first command's vLLM workers were still exiting), so the share rows had an
unstable denominator. `python -m benchmarks visits` now writes the computed-tokens/s rows itself; this
script recomputes them for the JSONs written before, with the same `headline_row`, pairing the
runs as the harness did (the reference's runs of pair i are its runs i*R .. (i+1)*R - 1).
Run: .venv/bin/python -m benchmarks.rebuild_computed_rows benchmarks/results/visits-*.json
"""

import json
import sys

from benchmarks.report import headline_row

OLD = "share of the matmul rate at saturation"
NEW = "computed (uncached) tokens/s at saturation"

for path in sys.argv[1:]:
    doc = json.load(open(path))
    systems, repeats, runs = doc["systems"], doc["repeats"], doc["saturation_runs"]
    reference = systems[0]

    def rate(run: dict) -> float:
        return run["cache"]["computed_tokens"] / run["makespan_seconds"]

    others = sorted(systems[1:], key=lambda s: doc["load_of"] not in (reference, s))
    rows = {}
    for i, other in enumerate(others):
        ref_runs = runs[reference][i * repeats : (i + 1) * repeats]
        rows[other] = headline_row(
            NEW,
            "tokens/s",
            (reference, [rate(r) for r in ref_runs]),
            (other, [rate(r) for r in runs[other]]),
            higher_is_better=True,
        )
    new = [rows[row["peer"]["system"]] if row["measure"] == OLD else row for row in doc["headline"]]
    if new != doc["headline"]:
        doc["headline"] = new
        doc["headline_rebuilt"] = __doc__.split("\n\n")[0].replace("\n", " ")
        open(path, "w").write(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"{path}: rebuilt")
