#!/bin/bash
# Reference solution: run in the work folder.
set -euo pipefail
cat > config.json <<'JSON'
{
  "service": "ledger",
  "port": 8443,
  "replicas": 3,
  "tls": true,
  "allowed_origins": ["https://admin.example.com", "https://app.example.com", "https://reports.example.com"],
  "memory_mb": 1536
}
JSON
