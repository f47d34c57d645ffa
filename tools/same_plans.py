"""Mark the cases whose plan changed in predicted times only, after new model inputs.

When the inputs planners read change (say new workspace-free times in the traces), a policy
may plan the same actions with other Retime times: its digest (vsim.plan.plan_digest, which the
measured run recorded) changes, and `vsim validate` would call the plan changed although the
runtime would carry out the same. This plans each case twice, as `vsim validate` plans it:
under OLD_TREE (a git worktree of the revision the runs were measured at), where the plan's
digest must be the measured run's, and here; where the two plans' actions_digest agree, it
writes `same_plan_as: DIGEST` into the case file, which `vsim validate` then accepts (and
stops accepting once the plan changes again). Cases that fail either check are listed, to
be measured again.

    git worktree add /tmp/old REV && rm -r /tmp/old/vsim && cp -r vsim /tmp/old/
    python tools/same_plans.py /tmp/old ID...
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def digests(ids: list[str]) -> dict[str, list[str | None]]:
    """Per case: [plan_digest, actions_digest, the measured run's digest], as planned by the
    vsim imported from the current folder."""
    from vsim.plan import actions_digest, plan_digest
    from vsim.validate import case_inputs, load_cases, simulate_case

    out: dict[str, list[str | None]] = {}
    for cid in ids:
        case = load_cases([f"validation/cases/{cid}.yaml"])[0]
        trace, hw, measured = case_inputs(case)
        plan = simulate_case(case, trace, hw, measured).plan
        recorded = (measured.get("plan") or {}).get("digest")
        out[cid] = [plan_digest(plan), actions_digest(plan), recorded]
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--digests":  # the run under a tree
        print(json.dumps(digests(sys.argv[2:])))
        return
    old_tree, ids = Path(sys.argv[1]).resolve(), sys.argv[2:]
    script = [sys.executable, "-c",
              "import sys, runpy; sys.path.insert(0, '.'); sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')", str(Path(__file__).resolve()),
              "--digests", *ids]
    old = json.loads(subprocess.run(script, cwd=old_tree, check=True, capture_output=True,
                                    text=True).stdout.splitlines()[-1])
    now = json.loads(subprocess.run(script, cwd=ROOT, check=True, capture_output=True,
                                    text=True).stdout.splitlines()[-1])
    again = []
    for cid in ids:
        (old_digest, old_actions, recorded), (_, actions, _) = old[cid], now[cid]
        if old_digest != recorded or old_actions != actions:
            again.append(cid)
            continue
        path = ROOT / "validation" / "cases" / f"{cid}.yaml"
        text = re.sub(r"^same_plan_as: .*\n", "", path.read_text(), flags=re.M)
        path.write_text(text.replace("tolerance:", f"same_plan_as: {actions}\ntolerance:", 1))
        print(f"{cid}: same actions as measured ({recorded}), same_plan_as {actions}")
    print(f"to measure again ({len(again)}): {','.join(again)}")


if __name__ == "__main__":
    main()
