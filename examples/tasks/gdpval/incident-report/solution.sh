#!/bin/bash
# Reference solution: run in the work folder.
set -euo pipefail
cat > report.md <<'MD'
# Post-incident report: slow checkout

## Summary
A report query without an index saturated the primary database and slowed checkout.

## Timeline
- 21:04 alerts: checkout API p99 latency above 5 s
- 21:09 database team paged; primary at 100% CPU
- 21:17 runaway report query found
- 21:26 query killed, index added on orders(created_at)
- 21:31 latency back to normal, incident closed

## Impact
Checkout was slow or failing for 27 minutes (21:04 to 21:31 UTC).

## Follow-ups
- Add a query timeout for report jobs
- Alert on database CPU
- Move reports to a replica
MD
