#!/bin/bash
find /app/docs -type f -name '*.txt' | while read -r f; do mv "$f" "${f%.txt}.md"; done
