"""Check recommend's speedup projection against a run it did not see (normlab.recommend.evidence.holdout).

    python scripts/speedup_holdout.py REC_DIR --out DIR [--workers 2] [--record]

REC_DIR: a finished `normlab recommend` folder whose plan held a ladder (--ladder narrow|wide|auto).
The user's placement and its rival are trained at 2x the ladder's widest width and 4x that rung's tokens
into DIR (a new folder; run again to resume); the measured speedup is compared with the ladder's prediction
interval at that compute. --record adds the comparison to the transfer record's "speedup_projections"
(src/normlab/recommend/evidence/transfer_record.json), replacing an earlier one of the same recommendation folder name.
"""

import argparse
import json
from pathlib import Path

from normlab.recommend.evidence import holdout

RECORD = Path(holdout.__file__).with_name("transfer_record.json")  # the record shipped in the package


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rec", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    rec = holdout.holdout(args.rec, args.out, args.workers)
    print(holdout.words(rec))
    if args.record:
        record = json.loads(RECORD.read_text())
        name = Path(rec["recommendation"]).name
        kept = [r for r in record.get("speedup_projections", []) if Path(r["recommendation"]).name != name]
        record["speedup_projections"] = [*kept, {**rec, "recommendation": name, "validated": rec["inside"]}]
        RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        print(f"recorded in {RECORD.name}")


if __name__ == "__main__":
    main()
