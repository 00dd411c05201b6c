"""Fail CI on a skipped test whose reason is not allowed here. Reads pytest's `-rs` summary from the log given.

A test may skip in CI only for a reason below; any other skip (say openai-clip failed to install, so the parity
tests would prove nothing) fails the run, naming the test and its reason.
"""
import re
import sys

ALLOWED = [
    # ../shared (the real annotation files, coco-caption's scored caption sets, the development set) lies beside
    # the repository on development machines; a clone without it runs everything else
    r"\.\./shared/",
    # the cuda group (pytest.ini's `cuda` marker): CI has no GPU
    r"^needs a CUDA GPU",
]

log = open(sys.argv[1], encoding="utf-8", errors="replace").read()
skips = re.findall(r"^SKIPPED \[\d+\] (\S+): (.*)$", log, re.M)
bad = [(where, why) for where, why in skips if not any(re.search(p, why) for p in ALLOWED)]
for where, why in skips:
    print(f"skipped ({'NOT ALLOWED' if (where, why) in bad else 'allowed'}): {where}: {why}")
if bad:
    sys.exit(f"{len(bad)} test(s) skipped for a reason CI does not allow (.ci/check_skips.py ALLOWED)")
